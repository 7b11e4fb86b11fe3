"""Benchmark GGUFs at real DeepSeek shapes with random weights, for `bench --vs-llama-cpp` and `profile`.

    python profiles/make_bench_model.py v2lite               # DeepSeek-V2-Lite shapes, 4 layers (1 dense + 3 MoE), Q4_0
    python profiles/make_bench_model.py v2lite --layers 27   # full depth, ~9 GB
    python profiles/make_bench_model.py glm47flash           # GLM-4.7-Flash shapes: q_lora, sigmoid routing + bias
    python profiles/make_bench_model.py v3groups             # the same with V3-style expert groups (8 groups, best 4)
    python profiles/make_bench_model.py v4flash              # DeepSeek V4 Flash (arch deepseek4), ds4.c's "q2" mix, ~9.5 GB
    python profiles/make_bench_model.py --list

Files go to `$TG_DS4_CACHE/bench/<preset>-<layers>L-<type>.gguf` (never into the repository) and are rebuilt only when
missing. The weights are random packed blocks (uniform random quants, block scales set so every matrix has RMS
1/sqrt(fan_in), which keeps activations O(1) through any depth), norms 1, routers N(0, 1/fan_in): no quantization pass,
so even the 9 GB file is quick to write, and every byte is written with gguf-py's writer, one tensor at a time. The
tokenizer is the deepseek2 test fixture's byte-level BPE (512 tokens) padded with unreachable tokens to the real vocabulary
size, so tg_ds4 and llama.cpp both load it and the benchmark's prompt tokenizes the same in both. Metadata follows
llama.cpp's converter for these models (MLA with `attn_k_b`/`attn_v_b`, `key_length_mla`, YaRN as in the release).

`v4flash` is a deepseek4 GGUF at the release's per-layer shapes (4096 wide, 64 heads x 512, q LoRA 1024, output LoRA 8 x
1024, window 128, 256 experts x 2048 with 6 active + 1 shared, 4 hyper-connection streams, indexer 64 x 128 top-512,
vocabulary 129280). Its layers follow the release's pattern (compress ratio 0 for layers 0-1, then 4 and 128 alternating;
the first 3 route by the token-id hash table `ffn_gate_tid2eid`, which holds `used` distinct random experts per token),
so the default 4 layers have one of each attention kind. Its type is ds4.c's "q2" mix (`-q2.gguf`): routed gate/up
experts IQ2_XXS and down Q2_K, attention projections, shared experts and the head Q8_0, embedding, router,
hyper-connection fns, compressor and indexer weights F16 (random normal / sqrt(fan_in)), norms 1, sinks and the small
F32 vectors (HC scale/base, selection bias) N(0, 0.01). The tensor-name set and every shape rule are checked against the
tiny deepseek4 test fixture (which llama.cpp's own converter wrote), whose metadata and tokenizer are copied with the
dimension keys set to the release's values."""
from __future__ import annotations

import argparse, pathlib, sys
from dataclasses import dataclass, replace

import gguf
import numpy as np
from gguf import GGMLQuantizationType as G

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tg_ds4.backend.cache import cache_dir  # noqa: E402

TOKENIZER_SOURCE = REPO / "tests/fixtures/deepseek2/ds2lite/ds2lite-Q4_0.gguf"
V4_TEMPLATE = REPO / "tests/fixtures/deepseek4/flash/flash-IQ2_XXS.gguf"

@dataclass(frozen=True)
class Shape:
  """A deepseek2 model's per-layer shapes and routing (HF config names in the comments)."""
  name: str
  layers: int          # num_hidden_layers of the release
  dim: int             # hidden_size
  heads: int           # num_attention_heads
  q_lora: int          # q_lora_rank (0: one attn_q matrix)
  kv_lora: int         # kv_lora_rank
  nope: int            # qk_nope_head_dim
  rope: int            # qk_rope_head_dim
  v: int               # v_head_dim
  experts: int         # n_routed_experts
  used: int            # num_experts_per_tok
  shared: int          # n_shared_experts
  expert_ff: int       # moe_intermediate_size
  dense_ff: int        # intermediate_size
  dense_lead: int      # first_k_dense_replace
  vocab: int
  gating: int          # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid
  bias: bool           # e_score_correction_bias (exp_probs_b)
  groups: int = 1      # n_group
  groups_used: int = 1  # topk_group
  weights_norm: bool = False   # norm_topk_prob
  weights_scale: float = 1.0   # routed_scaling_factor
  ctx: int = 163840
  yarn: tuple[float, int, float] | None = (40.0, 4096, 0.0707)  # factor, original context, mscale_all_dim * 0.1
  eps: float = 1e-6

PRESETS = {
  "v2lite": Shape("v2lite", 27, 2048, 16, 0, 512, 128, 64, 128, 64, 6, 2, 1408, 10944, 1, 102400, 1, False),
  "glm47flash": Shape("glm47flash", 47, 2048, 20, 768, 512, 192, 64, 256, 64, 4, 1, 1536, 10240, 1, 154880, 2, True,
                      weights_norm=True, weights_scale=1.8, ctx=202752, yarn=None, eps=1e-5),
}
PRESETS["v3groups"] = replace(PRESETS["glm47flash"], name="v3groups", groups=8, groups_used=4)

@dataclass(frozen=True)
class V4Shape:
  """A deepseek4 (DeepSeek V4) model's per-layer shapes (release config.json names in the comments)."""
  name: str
  layers: int          # num_hidden_layers
  dim: int             # hidden_size
  heads: int           # num_attention_heads (one shared K=V head)
  head_dim: int        # head_dim (K = V)
  rope: int            # qk_rope_head_dim: RoPE on the last dims of each head
  q_lora: int          # q_lora_rank
  o_groups: int        # o_groups
  o_lora: int          # o_lora_rank (per group)
  window: int          # sliding_window
  experts: int         # n_routed_experts
  used: int            # num_experts_per_tok
  shared: int          # n_shared_experts
  expert_ff: int       # moe_intermediate_size
  hash_layers: int     # num_hash_layers
  idx_heads: int       # index_n_heads
  idx_dim: int         # index_head_dim
  idx_top_k: int       # index_topk
  hc: int              # hc_mult
  vocab: int
  clamp: float = 10.0  # swiglu_limit (routed and shared experts)

  def ratios(self, layers: int) -> list[int]:
    """compress_ratios of the release's first `layers` layers: 0, 0, then 4 (even) and 128 (odd) alternating."""
    return [0 if i < 2 else 4 if i % 2 == 0 else 128 for i in range(layers)]

PRESETS["v4flash"] = V4Shape("v4flash", 43, 4096, 64, 512, 64, 1024, 8, 1024, 128, 256, 6, 1, 2048, 3, 64, 128, 512, 4, 129280)

# ds4.c's published mixes only quantize the routed experts: (gate/up, down); everything else has one fixed type
V4_MIXES = {"q2": (G.IQ2_XXS, G.Q2_K)}
V4_FILE_TYPE = {"q2": gguf.LlamaFileType.MOSTLY_IQ2_XXS}

# byte offsets of each block's fp16 scale fields: set to make the matrix RMS 1/sqrt(fan_in) (values are linear in them)
SCALE_FIELDS = {G.Q4_0: (0,), G.Q8_0: (0,), G.Q4_K: (0, 2), G.Q2_K: (80, 82), G.Q6_K: (208,), G.IQ2_XXS: (0,)}

def _unit_rms(qtype: G) -> float:
  """RMS of random blocks whose scale fields are all 1.0."""
  rng = np.random.default_rng(0)
  bs, ts = gguf.GGML_QUANT_SIZES[qtype]
  raw = np.frombuffer(rng.bytes(4096 * ts), np.uint8).reshape(4096, ts).copy()
  for off in SCALE_FIELDS[qtype]: raw[:, off:off + 2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
  return float(np.sqrt(np.mean(np.square(gguf.quants.dequantize(raw, qtype).astype(np.float64)))))

def random_packed(rng: np.random.Generator, shape: tuple[int, ...], qtype: G, unit_rms: dict) -> np.ndarray:
  """Packed bytes of a `shape` (numpy order, last axis = fan_in) matrix of random blocks with RMS 1/sqrt(fan_in)."""
  bs, ts = gguf.GGML_QUANT_SIZES[qtype]
  n = int(np.prod(shape)) // bs
  raw = np.frombuffer(rng.bytes(n * ts), np.uint8).reshape(n, ts).copy()
  if qtype not in unit_rms: unit_rms[qtype] = _unit_rms(qtype)
  d = np.float16(1.0 / (unit_rms[qtype] * np.sqrt(shape[-1])))
  for off in SCALE_FIELDS[qtype]: raw[:, off:off + 2] = np.frombuffer(d.tobytes(), np.uint8)
  return raw.reshape(*shape[:-1], shape[-1] // bs * ts)

def tensors(s: Shape, layers: int, qtype: G) -> list[tuple[str, tuple[int, ...], G]]:
  """(GGUF name, numpy-order shape, type) of every tensor, in file order."""
  H, qk = s.heads, s.nope + s.rope
  out = [("token_embd.weight", (s.vocab, s.dim), qtype), ("output_norm.weight", (s.dim,), G.F32), ("output.weight", (s.vocab, s.dim), G.Q8_0)]
  for i in range(layers):
    b = f"blk.{i}."
    out += [(b + "attn_norm.weight", (s.dim,), G.F32)]
    if s.q_lora: out += [(b + "attn_q_a.weight", (s.q_lora, s.dim), qtype), (b + "attn_q_a_norm.weight", (s.q_lora,), G.F32),
                         (b + "attn_q_b.weight", (H * qk, s.q_lora), qtype)]
    else: out += [(b + "attn_q.weight", (H * qk, s.dim), qtype)]
    out += [(b + "attn_kv_a_mqa.weight", (s.kv_lora + s.rope, s.dim), qtype), (b + "attn_kv_a_norm.weight", (s.kv_lora,), G.F32),
            (b + "attn_k_b.weight", (H, s.kv_lora, s.nope), qtype), (b + "attn_v_b.weight", (H, s.v, s.kv_lora), qtype),
            (b + "attn_output.weight", (s.dim, H * s.v), qtype), (b + "ffn_norm.weight", (s.dim,), G.F32)]
    if i < s.dense_lead:
      out += [(b + "ffn_gate.weight", (s.dense_ff, s.dim), qtype), (b + "ffn_up.weight", (s.dense_ff, s.dim), qtype),
              (b + "ffn_down.weight", (s.dim, s.dense_ff), qtype)]
      continue
    E, F, SF = s.experts, s.expert_ff, s.expert_ff * s.shared
    out += [(b + "ffn_gate_inp.weight", (E, s.dim), G.F32)] + ([(b + "exp_probs_b.bias", (E,), G.F32)] if s.bias else [])
    out += [(b + "ffn_gate_exps.weight", (E, F, s.dim), qtype), (b + "ffn_up_exps.weight", (E, F, s.dim), qtype),
            (b + "ffn_down_exps.weight", (E, s.dim, F), qtype)]
    if s.shared: out += [(b + "ffn_gate_shexp.weight", (SF, s.dim), qtype), (b + "ffn_up_shexp.weight", (SF, s.dim), qtype),
                         (b + "ffn_down_shexp.weight", (s.dim, SF), qtype)]
  return out

def v4_tensors(s: V4Shape, ratios: list[int], n_hash: int, mix: str = "q2") -> list[tuple[str, tuple[int, ...], G]]:
  """(GGUF name, numpy-order shape, type) of every deepseek4 tensor, in file order. The shapes are written GGUF-order
  (ne0 = fan_in first, as in llama.cpp's loader, the architecture doc and the fixture) and reversed at the end."""
  D, hd, QL, E, V = s.dim, s.head_dim, s.q_lora, s.experts, s.vocab
  hcD, mixes = s.hc * D, (2 + s.hc) * s.hc  # HC fns read all streams; they give pre (hc) + post (hc) + comb (hc x hc)
  F16, F32, Q8 = G.F16, G.F32, G.Q8_0
  gate_up, down = V4_MIXES[mix]
  FF, SF = s.expert_ff, s.expert_ff * s.shared
  out = [("token_embd.weight", (D, V), F16), ("output_hc_fn.weight", (hcD, s.hc), F16), ("output_hc_scale.weight", (1,), F32),
         ("output_hc_base.weight", (s.hc,), F32), ("output_norm.weight", (D,), F32), ("output.weight", (D, V), Q8)]
  for i, r in enumerate(ratios):
    b = f"blk.{i}."
    hc = lambda site: [(f"{b}hc_{site}_fn.weight", (hcD, mixes), F16), (f"{b}hc_{site}_scale.weight", (3,), F32),
                       (f"{b}hc_{site}_base.weight", (mixes,), F32)]
    out += hc("attn") + [
      (b + "attn_norm.weight", (D,), F32), (b + "attn_q_a.weight", (D, QL), Q8), (b + "attn_q_a_norm.weight", (QL,), F32),
      (b + "attn_q_b.weight", (QL, s.heads * hd), Q8), (b + "attn_kv.weight", (D, hd), Q8), (b + "attn_kv_a_norm.weight", (hd,), F32),
      (b + "attn_sinks.weight", (s.heads,), F32),
      (b + "attn_output_a.weight", (s.heads * hd // s.o_groups, s.o_groups * s.o_lora), Q8),  # group g reads its heads' slice
      (b + "attn_output_b.weight", (s.o_groups * s.o_lora, D), Q8)]
    if r:  # ratio-4 windows overlap (each compressed row mixes two half-width parts), so their compressor is twice as wide
      W = (2 if r == 4 else 1) * hd
      out += [(b + "attn_compressor_kv.weight", (D, W), F16), (b + "attn_compressor_gate.weight", (D, W), F16),
              (b + "attn_compressor_ape.weight", (W, r), F16), (b + "attn_compressor_norm.weight", (hd,), F32)]
    if r == 4:  # only ratio-4 layers select compressed rows with the indexer
      IW = 2 * s.idx_dim
      out += [(b + "indexer.attn_q_b.weight", (QL, s.idx_heads * s.idx_dim), F16), (b + "indexer.proj.weight", (D, s.idx_heads), F16),
              (b + "indexer_compressor_kv.weight", (D, IW), F16), (b + "indexer_compressor_gate.weight", (D, IW), F16),
              (b + "indexer_compressor_ape.weight", (IW, r), F16), (b + "indexer_compressor_norm.weight", (s.idx_dim,), F32)]
    out += hc("ffn") + [(b + "ffn_norm.weight", (D,), F32), (b + "ffn_gate_inp.weight", (D, E), F16)]
    # hash layers pick experts by token id (the router only weighs them); the others select with a bias
    out += [(b + "ffn_gate_tid2eid.weight", (s.used, V), G.I32)] if i < n_hash else [(b + "exp_probs_b.bias", (E,), F32)]
    out += [(b + "ffn_gate_exps.weight", (D, FF, E), gate_up), (b + "ffn_up_exps.weight", (D, FF, E), gate_up),
            (b + "ffn_down_exps.weight", (FF, D, E), down),
            (b + "ffn_gate_shexp.weight", (D, SF), Q8), (b + "ffn_up_shexp.weight", (D, SF), Q8), (b + "ffn_down_shexp.weight", (SF, D), Q8)]
  return [(n, tuple(reversed(sh)), t) for n, sh, t in out]

def _check_v4_template(r: gguf.GGUFReader) -> None:
  """v4_tensors at the fixture's own dims must give exactly the fixture's tensor names and shapes: the fixture was written
  by llama.cpp's converter, so this pins the name set, the per-layer-kind differences and every shape rule."""
  k = lambda name: r.fields[f"deepseek4.{name}"].contents()
  ratios = [int(x) for x in k("attention.compress_ratios")]
  t = V4Shape("fixture", len(ratios), k("embedding_length"), k("attention.head_count"), k("attention.key_length"), k("rope.dimension_count"),
              k("attention.q_lora_rank"), k("attention.output_group_count"), k("attention.output_lora_rank"), k("attention.sliding_window"),
              k("expert_count"), k("expert_used_count"), k("expert_shared_count"), k("expert_feed_forward_length"), k("hash_layer_count"),
              k("attention.indexer.head_count"), k("attention.indexer.key_length"), k("attention.indexer.top_k"), k("hyper_connection.count"),
              len(r.fields["tokenizer.ggml.tokens"].data))
  want = {n: tuple(reversed(sh)) for n, sh, _ in v4_tensors(t, ratios, t.hash_layers)}
  got = {x.name: tuple(int(d) for d in x.shape) for x in r.tensors}
  if want != got:
    bad = sorted(n for n in want.keys() | got.keys() if want.get(n) != got.get(n))
    raise SystemExit(f"{V4_TEMPLATE.name}: tensor table differs from v4_tensors: " + ", ".join(f"{n} {got.get(n)} vs {want.get(n)}" for n in bad))

def _metadata_v4(w: gguf.GGUFWriter, s: V4Shape, layers: int, mix: str, r: gguf.GGUFReader) -> None:
  """The fixture's metadata (the converter's keys and types, YaRN, gating, HC and tokenizer settings as in the release) with
  the dimension keys set to `s`, and its tokenizer padded with tokens no merge produces up to the real vocabulary."""
  a = "deepseek4."
  toks = r.fields["tokenizer.ggml.tokens"].contents()
  pad = s.vocab - len(toks)
  over = {"general.name": f"tg-ds4-bench-{s.name}-{layers}L-{mix}", "general.file_type": int(V4_FILE_TYPE[mix]),
          a + "block_count": layers, a + "embedding_length": s.dim, a + "attention.head_count": s.heads, a + "attention.head_count_kv": 1,
          a + "attention.key_length": s.head_dim, a + "attention.value_length": s.head_dim, a + "rope.dimension_count": s.rope,
          a + "attention.q_lora_rank": s.q_lora, a + "attention.sliding_window": s.window, a + "expert_count": s.experts,
          a + "expert_used_count": s.used, a + "expert_shared_count": s.shared, a + "expert_feed_forward_length": s.expert_ff,
          a + "swiglu_clamp_exp": [s.clamp] * layers, a + "swiglu_clamp_shexp": [s.clamp] * layers,
          a + "attention.indexer.head_count": s.idx_heads, a + "attention.indexer.key_length": s.idx_dim,
          a + "attention.indexer.top_k": s.idx_top_k, a + "attention.output_group_count": s.o_groups, a + "attention.output_lora_rank": s.o_lora,
          a + "attention.compress_ratios": s.ratios(layers), a + "hash_layer_count": min(s.hash_layers, layers),
          a + "hyper_connection.count": s.hc, a + "embedding_length_out": s.hc * s.dim,
          "tokenizer.ggml.tokens": toks + [f"<bench_{i}>" for i in range(pad)],
          "tokenizer.ggml.token_type": r.fields["tokenizer.ggml.token_type"].contents() + [1] * pad}
  for key, f in r.fields.items():
    if key.startswith("GGUF.") or key in ("general.architecture", "general.size_label"): continue  # the writer's own / the fixture's size
    val = over.pop(key) if key in over else f.contents()
    w.add_key_value(key, val, f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
  if over: raise SystemExit(f"{V4_TEMPLATE.name} lacks metadata keys {sorted(over)}")
  w.add_uint32(a + "vocab_size", s.vocab)  # not written by the converter; ds4.c validates it

def _metadata(w: gguf.GGUFWriter, s: Shape, layers: int, qtype: G) -> None:
  a = "deepseek2"
  w.add_name(f"tg-ds4-bench-{s.name}-{layers}L")
  ft = gguf.LlamaFileType
  w.add_file_type(int({G.Q4_0: ft.MOSTLY_Q4_0, G.Q8_0: ft.MOSTLY_Q8_0, G.Q4_K: ft.MOSTLY_Q4_K_M}[qtype]))
  w.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
  u32 = lambda k, v: w.add_uint32(f"{a}.{k}", int(v))
  f32 = lambda k, v: w.add_float32(f"{a}.{k}", float(v))
  u32("block_count", layers); u32("context_length", s.ctx); u32("embedding_length", s.dim); u32("feed_forward_length", s.dense_ff)
  u32("attention.head_count", s.heads); u32("attention.head_count_kv", 1); f32("attention.layer_norm_rms_epsilon", s.eps)
  u32("attention.q_lora_rank", s.q_lora); u32("attention.kv_lora_rank", s.kv_lora)
  u32("attention.key_length", s.kv_lora + s.rope); u32("attention.value_length", s.kv_lora)
  u32("attention.key_length_mla", s.nope + s.rope); u32("attention.value_length_mla", s.v)
  u32("rope.dimension_count", s.rope); f32("rope.freq_base", 10000.0 if s.yarn else 1000000.0)
  if s.yarn:
    w.add_string(f"{a}.rope.scaling.type", "yarn"); f32("rope.scaling.factor", s.yarn[0]); u32("rope.scaling.original_context_length", s.yarn[1])
    f32("rope.scaling.yarn_log_multiplier", s.yarn[2]); f32("rope.scaling.yarn_beta_fast", 32.0); f32("rope.scaling.yarn_beta_slow", 1.0)
  u32("leading_dense_block_count", s.dense_lead); u32("expert_count", s.experts); u32("expert_used_count", s.used)
  u32("expert_shared_count", s.shared); u32("expert_feed_forward_length", s.expert_ff); u32("expert_gating_func", s.gating)
  f32("expert_weights_scale", s.weights_scale); w.add_bool(f"{a}.expert_weights_norm", s.weights_norm)
  u32("expert_group_count", s.groups); u32("expert_group_used_count", s.groups_used); u32("vocab_size", s.vocab)
  # the fixture's tokenizer, padded with tokens no merge produces
  r = gguf.GGUFReader(TOKENIZER_SOURCE)
  field = lambda k: r.fields[k].contents()
  toks = field("tokenizer.ggml.tokens")
  w.add_string("tokenizer.ggml.model", field("tokenizer.ggml.model")); w.add_string("tokenizer.ggml.pre", field("tokenizer.ggml.pre"))
  w.add_array("tokenizer.ggml.tokens", toks + [f"<bench_{i}>" for i in range(s.vocab - len(toks))])
  w.add_array("tokenizer.ggml.token_type", field("tokenizer.ggml.token_type") + [1] * (s.vocab - len(toks)))
  w.add_array("tokenizer.ggml.merges", field("tokenizer.ggml.merges"))
  w.add_uint32("tokenizer.ggml.bos_token_id", field("tokenizer.ggml.bos_token_id"))
  w.add_uint32("tokenizer.ggml.eos_token_id", field("tokenizer.ggml.eos_token_id"))
  w.add_bool("tokenizer.ggml.add_bos_token", True); w.add_bool("tokenizer.ggml.add_eos_token", False)

def path_for(preset: str, layers: int, qtype: G | str) -> pathlib.Path:
  return cache_dir() / "bench" / f"{preset}-{layers}L-{qtype if isinstance(qtype, str) else qtype.name}.gguf"

# F32 vectors that are not norms but offsets and gains added into logits (biases, sinks, HC scales/bases): kept small
SMALL_F32 = (".bias", "_sinks.weight", "_scale.weight", "_base.weight")

def random_f16(rng: np.random.Generator, shape: tuple[int, ...], chunk: int = 1 << 24) -> np.ndarray:
  """N(0, 1/fan_in) as float16, drawn in float32 chunks (a float64 draw of the 530M-entry embedding would take 4 GB)."""
  out = np.empty(int(np.prod(shape)), np.float16)
  for i in range(0, out.size, chunk):
    n = min(chunk, out.size - i)
    out[i:i + n] = rng.standard_normal(n, dtype=np.float32) * np.float32(1 / np.sqrt(shape[-1]))
  return out.reshape(shape)

def random_tid2eid(rng: np.random.Generator, shape: tuple[int, ...], n_expert: int) -> np.ndarray:
  """`[vocab, used]` hash routing table: `used` distinct expert ids per token (duplicates would double-count an expert)."""
  out = np.empty(shape, np.int32)
  for i in range(0, shape[0], 8192):  # argpartition of 8192 x n_expert random keys at a time
    keys = rng.random((min(8192, shape[0] - i), n_expert), dtype=np.float32)
    out[i:i + len(keys)] = np.argpartition(keys, shape[1], axis=1)[:, :shape[1]]
  return out

def make(preset: str, layers: int = 4, qtype: G | str | None = None, seed: int = 0, force: bool = False) -> pathlib.Path:
  s = PRESETS[preset]
  v4 = isinstance(s, V4Shape)
  qtype = qtype or ("q2" if v4 else G.Q4_0)
  if v4 != (qtype in V4_MIXES): raise ValueError(f"type {qtype} does not apply to {preset}")
  out = path_for(preset, layers, qtype)
  if out.exists() and not force: return out
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.with_suffix(".tmp")
  if v4:
    tmpl = gguf.GGUFReader(V4_TEMPLATE)
    _check_v4_template(tmpl)
    w = gguf.GGUFWriter(str(tmp), "deepseek4")
    _metadata_v4(w, s, layers, str(qtype), tmpl)
    spec = v4_tensors(s, s.ratios(layers), min(s.hash_layers, layers), str(qtype))
  else:
    w = gguf.GGUFWriter(str(tmp), "deepseek2")
    _metadata(w, s, layers, qtype)
    spec = tensors(s, layers, qtype)
  plain = {G.F32: np.float32, G.F16: np.float16, G.I32: np.int32}
  for name, shape, qt in spec:
    if qt in plain: w.add_tensor_info(name, shape, np.dtype(plain[qt]), int(np.prod(shape)) * np.dtype(plain[qt]).itemsize)
    else:
      bs, ts = gguf.GGML_QUANT_SIZES[qt]
      w.add_tensor_info(name, (*shape[:-1], shape[-1] // bs * ts), np.dtype(np.uint8), int(np.prod(shape)) // bs * ts, raw_dtype=qt)
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_ti_data_to_file()
  rng, unit = np.random.default_rng(seed), {}
  for name, shape, qt in spec:  # one tensor in memory at a time
    if qt == G.I32: data = random_tid2eid(rng, shape, s.experts)
    elif qt == G.F16: data = random_f16(rng, shape)
    elif qt != G.F32: data = random_packed(rng, shape, qt, unit)
    elif name.endswith("norm.weight"): data = np.ones(shape, np.float32)
    else: data = (rng.standard_normal(shape) * (0.1 if name.endswith(SMALL_F32) else 1 / np.sqrt(shape[-1]))).astype(np.float32)
    w.write_tensor_data(data)
  w.close()
  tmp.rename(out)
  return out

def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("preset", nargs="?", choices=sorted(PRESETS))
  ap.add_argument("--layers", type=int, default=4,
                  help="transformer blocks (default 4: the dense lead + MoE layers; v4flash: ratios 0, 0, 4, 128, the first 3 hash-routed)")
  ap.add_argument("--type", choices=["Q4_0", "Q8_0", "Q4_K", *V4_MIXES],
                  help="deepseek2 presets: weight type of every matrix but the head (Q8_0), default Q4_0; v4flash: the mix, default q2")
  ap.add_argument("--force", action="store_true", help="rebuild even if the file exists")
  ap.add_argument("--list", action="store_true")
  a = ap.parse_args()
  if a.list or not a.preset:
    for k, s in PRESETS.items(): print(f"{k:<12} {s}")
    return 0
  v4 = isinstance(PRESETS[a.preset], V4Shape)
  if a.type and v4 != (a.type in V4_MIXES): ap.error(f"--type {a.type} does not apply to {a.preset}")
  print(make(a.preset, a.layers, G[a.type] if a.type in G.__members__ else a.type, force=a.force))
  return 0

if __name__ == "__main__": sys.exit(main())
