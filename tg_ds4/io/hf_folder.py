"""Hugging Face checkpoint folders (`config.json`, `model.safetensors` or shards with their index, `tokenizer.json`,
`tokenizer_config.json`) opened as the GGUF model llama.cpp's converter would write from them.

`Checkpoint` has GGUFFile's interface: `metadata` holds the GGUF keys convert_hf_to_gguf.py derives from config.json
and the tokenizer files, and `infos` / `tensor(name)` the tensors under their GGUF names, mapped by one table per
architecture. The model code, its config and the tokenizer therefore never know where the weights came from.
Architectures: llama, qwen2, deepseek2 (DeepSeek V2/V3) and gemma3 (Gemma3ForCausalLM, text only; its
SentencePiece-style tokenizer.json included, see io/hf_tokenizer.py). Tensors are read from the mmapped safetensors
without a copy on the CPU where the file's bytes are the GGUF tensor as they are; four cases need a copy made at load:
llama's q/k rows reordered for its interleaved RoPE (the converter's permute), a mixture of experts' per-expert
matrices stacked into one `[E, out, in]` tensor, Gemma 3's norm vectors (the converter stores 1 + w, the scale
Gemma's RMSNorm applies, as F32), and quantization.

`quantize="q8_0"|"q4_0"|"q4_k"` quantizes each matrix at load, one tensor at a time with reference quantizers: gguf-py's
for q8_0 / q4_0 (so the blocks are bit for bit what `gguf.quants.quantize` makes of the same floats) and tg_ds4.quant.kquant_writer's
for q4_k (bit for bit ggml's `quantize_row_q4_K_ref`, what llama.cpp's quantizer writes without an importance matrix),
a few rows at a time: one source tensor read into memory is the most ever held beside the packed result. A q4_k
matrix whose rows are not whole 256-element blocks gets Q5_0 instead, llama.cpp's fallback for Q4_K. Not quantized, as
llama.cpp's quantizer also leaves them: vectors (norms, biases), the MoE router `ffn_gate_inp` and the MLA
`attn_kv_b`, which the model splits into float k_b / v_b; nor a matrix whose rows are not whole blocks of the type it
would get (32 elements for q8_0 / q4_0 / Q5_0), which stays in the file's float type."""
from __future__ import annotations

import hashlib, json, os, pathlib, re, struct, weakref
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
from gguf.quants import quantize as gguf_quantize
from tinygrad import Device, Tensor, UOp, dtypes

from tg_ds4.backend.buffers import device_buffer, host_tensor
from tg_ds4.io.gguf import GGUFError, GGUFFile, TensorInfo
from tg_ds4.io.hf_tokenizer import tokenizer_metadata
from tg_ds4.quant.formats import QTYPE_BY_NAME, QTensor
from tg_ds4.quant.kquant_writer import quantize_q4_k

# config.json "architectures"[0] -> GGUF architecture
ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "DeepseekV2ForCausalLM": "deepseek2", "DeepseekV3ForCausalLM": "deepseek2",
         "Gemma3ForCausalLM": "gemma3"}
QUANTIZE = ("q8_0", "q4_0", "q4_k")
# the type a matrix gets when its rows are not whole blocks of the one asked for: llama.cpp's (llama-quant.cpp
# tensor_type_fallback), so a q4_k load is the model its quantizer writes
QUANTIZE_FALLBACK = {"Q4_K": "Q5_0"}
QUANTIZE_ROWS_BYTES = 1 << 20  # float32 rows quantized at once (see Checkpoint._packed)

# HF tensor name -> GGUF name, per GGUF architecture; `{i}` is the layer (the converter's tensor_mapping.py, for these archs)
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_DENSE_BLOCK = {
  "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
  "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
  "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
  "self_attn.o_proj.weight": "attn_output.weight",
  "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
_MLA_BLOCK = {
  "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
  "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_a_proj.weight": "attn_q_a.weight",
  "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
  "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight", "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
  "self_attn.kv_b_proj.weight": "attn_kv_b.weight", "self_attn.o_proj.weight": "attn_output.weight",
  "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
  "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
  "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight", "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
  "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
# gemma3's sandwich norms: post_attention_layernorm is the attention output's norm (the converter's ATTN_POST_NORM, as
# the arch has no FFN_NORM), pre_feedforward_layernorm the FFN input's
_GEMMA3_BLOCK = {
  "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
  "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
  "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
  "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
  "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
BLOCK_TABLES = {"llama": _DENSE_BLOCK, "qwen2": _DENSE_BLOCK, "deepseek2": _MLA_BLOCK, "gemma3": _GEMMA3_BLOCK}
# routed experts, stacked along a new first axis: HF `mlp.experts.{e}.<proj>` -> GGUF blk.{i}.<name>
EXPERT_TABLE = {"gate_proj.weight": "ffn_gate_exps.weight", "up_proj.weight": "ffn_up_exps.weight", "down_proj.weight": "ffn_down_exps.weight"}

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(.+)$")
_ST_DTYPES = {"F32": ("F32", np.float32), "F16": ("F16", np.float16), "BF16": ("BF16", np.uint16)}

@dataclass(frozen=True)
class Source:
  """One tensor of a safetensors file."""
  name: str
  path: pathlib.Path
  dtype: str           # F32, F16 or BF16
  shape: tuple[int, ...]
  offset: int          # absolute byte offset in `path`
  nbytes: int

def is_checkpoint(path: str | os.PathLike) -> bool: return pathlib.Path(path, "config.json").is_file()

def read_safetensors_header(path: pathlib.Path) -> dict[str, Source]:
  size = path.stat().st_size
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8: raise GGUFError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
    (n,) = struct.unpack("<Q", head)
    if n > min(size - 8, 1 << 28): raise GGUFError(f"{path}: safetensors header length {n} runs past the end of the file ({size} bytes)")
    try: header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e: raise GGUFError(f"{path}: safetensors header is not JSON ({e})") from None
  out = {}
  for name, h in header.items():
    if name == "__metadata__": continue
    if not isinstance(h, dict) or h.get("dtype") not in _ST_DTYPES:
      raise GGUFError(f"{path}: tensor {name!r} has dtype {h.get('dtype') if isinstance(h, dict) else h!r}, expected one of {', '.join(_ST_DTYPES)}")
    shape, (a, b) = tuple(int(d) for d in h["shape"]), h["data_offsets"]
    want = int(np.prod(shape, dtype=np.int64)) * np.dtype(_ST_DTYPES[h["dtype"]][1]).itemsize
    if b - a != want or a < 0 or 8 + n + b > size:
      raise GGUFError(f"{path}: tensor {name!r} ({h['dtype']} {list(shape)}) has data offsets {[a, b]} that do not fit it or the file")
    out[name] = Source(name, path, h["dtype"], shape, 8 + n + a, b - a)
  return out

def _permute_heads(w: np.ndarray, n_head: int) -> np.ndarray:
  """The converter's LlamaModel.permute: each head's rows reordered from rotate-half pairs (i, i + d/2) to adjacent
  pairs (2i, 2i + 1), the layout of llama.cpp's interleaved RoPE."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

def _rope_parameters(cfg: dict) -> tuple[str, dict]:
  rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
  return rp.get("rope_type") or rp.get("type") or "default", rp

def llama3_rope_freqs(cfg: dict) -> np.ndarray:
  """The `rope_freqs.weight` the converter writes for llama 3.1+'s "llama3" RoPE scaling: per rotated pair, 1 for
  short wavelengths, `factor` for long ones, a smooth blend between (its LlamaModel.generate_extra_tensors)."""
  _, rp = _rope_parameters(cfg)
  base = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
  dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
  freqs = 1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
  factor, lo, hi = float(rp.get("factor", 8.0)), float(rp.get("low_freq_factor", 1.0)), float(rp.get("high_freq_factor", 4.0))
  old = float(rp.get("original_max_position_embeddings", 8192))
  out = []
  for f in freqs.astype(np.float64):
    wavelen = 2 * np.pi / f
    if wavelen < old / hi: out.append(1.0)
    elif wavelen > old / lo: out.append(factor)
    else:
      smooth = (old / wavelen - lo) / (hi - lo)
      out.append(1 / ((1 - smooth) / factor + smooth))
  return np.array(out, np.float32)

def _rope_metadata(arch: str, cfg: dict) -> dict[str, Any]:
  kind, rp = _rope_parameters(cfg)
  out: dict[str, Any] = {f"{arch}.rope.freq_base": float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))}
  if kind == "default" or (kind == "llama3" and arch == "llama"): return out  # llama3: a rope_freqs.weight tensor instead
  if kind not in ("linear", "yarn"):
    raise GGUFError(f"config.json: RoPE scaling {kind!r} is not supported for checkpoint folders (supported: none, linear, yarn, llama3)")
  out.update({f"{arch}.rope.scaling.type": kind, f"{arch}.rope.scaling.factor": float(rp["factor"])})
  if kind == "yarn":
    out.update({f"{arch}.rope.scaling.original_context_length": int(rp["original_max_position_embeddings"]),
                f"{arch}.rope.scaling.yarn_beta_fast": float(rp.get("beta_fast", 32.0)),
                f"{arch}.rope.scaling.yarn_beta_slow": float(rp.get("beta_slow", 1.0))})
    if arch == "deepseek2": out[f"{arch}.rope.scaling.yarn_log_multiplier"] = 0.1 * float(rp.get("mscale_all_dim", 0.0))
  return out

def gemma3_layer_types(cfg: dict) -> list[bool]:
  """Per layer, whether it is a sliding-window one: config.json's layer_types, else transformers' rule for configs
  without them (every `sliding_window_pattern`-th layer global, 6 by default)."""
  n, types = int(cfg["num_hidden_layers"]), cfg.get("layer_types")
  if types is None:
    pat = int(cfg.get("sliding_window_pattern") or 6)
    return [bool((i + 1) % pat) for i in range(n)]
  if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
    raise GGUFError(f"config.json: layer_types {types!r} is not one of sliding_attention / full_attention per layer ({n} layers)")
  return [t == "sliding_attention" for t in types]

def _gemma3_metadata(cfg: dict) -> dict[str, Any]:
  """The converter's Gemma3Model.set_gguf_parameters, on config.json as transformers reads it: the global layers' RoPE
  (base and scaling) from rope_parameters' full_attention (or the older rope_theta / rope_scaling), the sliding
  layers' base from its sliding_attention (or rope_local_base_freq; transformers' default 10000 when neither is
  given, which the converter sees through AutoConfig), key/value length head_dim, the sliding window. The converter
  writes no window pattern: llama.cpp takes every 6th layer as global, the layout of every released Gemma 3. A config
  whose layer_types differ gets llama.cpp's per-layer `sliding_window_pattern` array (no window at all when no layer
  slides), so the model is transformers' where the converter's file would not be. llama.cpp scales q by
  1/sqrt(head_dim) (1/sqrt(dim / n_head) for the 62-layer 27B) where transformers uses query_pre_attn_scalar: equal
  for the released models; a config where they differ, or with attention logit softcapping (which the converter
  refuses), is refused. The converter also cuts token_embd to len(vocab) + len(added_tokens) of tokenizer.json rows:
  no cut where the vocab holds the added tokens too, as Gemma's does, so it is not reproduced."""
  a, g = "gemma3", cfg.get
  dim, n_head, n_layer = int(cfg["hidden_size"]), int(g("num_attention_heads") or 8), int(cfg["num_hidden_layers"])
  head_dim = int(g("head_dim") or 256)
  if g("attn_logit_softcapping") is not None:
    raise GGUFError("config.json: attn_logit_softcapping is set; Gemma 3 has none and llama.cpp's gemma3 cannot apply it")
  scale_dim = dim / n_head if n_layer == 62 else head_dim
  if (q := g("query_pre_attn_scalar")) is not None and float(q) != scale_dim:
    raise GGUFError(f"config.json: query_pre_attn_scalar {q} differs from the {scale_dim:g} llama.cpp's gemma3 scales q by "
                    f"({'hidden_size / num_attention_heads for 62 layers' if n_layer == 62 else 'head_dim'})")
  rp = g("rope_parameters") or g("rope_scaling") or {}
  full, local = rp.get("full_attention", rp), rp.get("sliding_attention") or {}
  md: dict[str, Any] = {
    "general.architecture": a, f"{a}.block_count": n_layer, f"{a}.context_length": int(g("max_position_embeddings") or 131072),
    f"{a}.embedding_length": dim, f"{a}.feed_forward_length": int(cfg["intermediate_size"]), f"{a}.attention.head_count": n_head,
    f"{a}.attention.head_count_kv": int(g("num_key_value_heads") or 4), f"{a}.attention.layer_norm_rms_epsilon": float(g("rms_norm_eps") or 1e-6),
    f"{a}.attention.key_length": head_dim, f"{a}.attention.value_length": head_dim, f"{a}.vocab_size": int(cfg["vocab_size"]),
    **_rope_metadata(a, {"rope_parameters": {**full, "rope_theta": float(full.get("rope_theta", g("rope_theta") or 1_000_000.0))}}),
    f"{a}.rope.freq_base_swa": float(local.get("rope_theta", g("rope_local_base_freq") or 10000.0))}
  if g("final_logit_softcapping"): md[f"{a}.final_logit_softcapping"] = float(cfg["final_logit_softcapping"])
  swa = gemma3_layer_types(cfg)
  if any(swa):
    if not isinstance(w := g("sliding_window"), int) or w <= 0: raise GGUFError(f"config.json: layers slide but sliding_window is {w!r}")
    md[f"{a}.attention.sliding_window"] = w
    if swa != [i % 6 < 5 for i in range(n_layer)]: md[f"{a}.attention.sliding_window_pattern"] = swa
  return md

def model_metadata(arch: str, cfg: dict) -> dict[str, Any]:
  """The GGUF model keys convert_hf_to_gguf.py writes for `cfg` (config.json)."""
  if arch == "gemma3": return _gemma3_metadata(cfg)
  a, g = arch, cfg.get
  md: dict[str, Any] = {
    "general.architecture": a, f"{a}.block_count": int(cfg["num_hidden_layers"]), f"{a}.context_length": int(g("max_position_embeddings", 4096)),
    f"{a}.embedding_length": int(cfg["hidden_size"]), f"{a}.feed_forward_length": int(cfg["intermediate_size"]),
    f"{a}.attention.head_count": int(cfg["num_attention_heads"]),
    f"{a}.attention.head_count_kv": int(g("num_key_value_heads") or cfg["num_attention_heads"]),
    f"{a}.attention.layer_norm_rms_epsilon": float(g("rms_norm_eps", 1e-6)), f"{a}.vocab_size": int(cfg["vocab_size"]), **_rope_metadata(a, cfg)}
  if a != "deepseek2":
    head_dim = g("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    md[f"{a}.rope.dimension_count"] = int(head_dim)
    if head_dim != cfg["hidden_size"] // cfg["num_attention_heads"]:
      md.update({f"{a}.attention.key_length": head_dim, f"{a}.attention.value_length": head_dim})
    return md
  nope, rope, kv_lora = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["kv_lora_rank"])
  scoring = g("scoring_func") or ("sigmoid" if cfg.get("model_type") == "deepseek_v3" else "softmax")
  if scoring not in ("softmax", "sigmoid"): raise GGUFError(f"config.json: scoring_func {scoring!r} is not supported (softmax, sigmoid)")
  md.update({f"{a}.attention.head_count_kv": 1, f"{a}.attention.key_length": kv_lora + rope, f"{a}.attention.value_length": kv_lora,
             f"{a}.attention.key_length_mla": nope + rope, f"{a}.attention.value_length_mla": int(cfg["v_head_dim"]),
             f"{a}.attention.q_lora_rank": int(g("q_lora_rank") or 0), f"{a}.attention.kv_lora_rank": kv_lora, f"{a}.rope.dimension_count": rope,
             f"{a}.expert_count": int(g("n_routed_experts") or 0), f"{a}.expert_used_count": int(g("num_experts_per_tok") or 0),
             f"{a}.expert_shared_count": int(g("n_shared_experts") or 0), f"{a}.expert_feed_forward_length": int(g("moe_intermediate_size") or 0),
             f"{a}.leading_dense_block_count": int(g("first_k_dense_replace") or 0),
             f"{a}.expert_weights_scale": float(g("routed_scaling_factor") or 1.0),
             f"{a}.expert_weights_norm": bool(g("norm_topk_prob", False)), f"{a}.expert_gating_func": 2 if scoring == "sigmoid" else 1,
             f"{a}.expert_group_count": int(g("n_group") or 1), f"{a}.expert_group_used_count": int(g("topk_group") or 1)})
  return md

class Checkpoint:
  """A Hugging Face checkpoint folder with GGUFFile's interface (see the module docstring)."""

  def __init__(self, path: str | os.PathLike, quantize: str | None = None):
    self.path = pathlib.Path(path)
    if quantize is not None and quantize not in QUANTIZE:
      raise GGUFError(f"--quantize {quantize!r} is not supported (supported: {', '.join(QUANTIZE)})")
    self.quantize = quantize
    cfg = self.config = self._json("config.json")
    arch_name = (cfg.get("architectures") or ["?"])[0]
    if (arch := ARCHS.get(arch_name)) is None:
      raise GGUFError(f"{self.path / 'config.json'}: architecture {arch_name!r} is not supported for checkpoint folders "
                      f"(supported: {', '.join(ARCHS)})")
    self.metadata: dict[str, Any] = {"general.name": self.path.name, **model_metadata(arch, cfg)}
    self.metadata.update(tokenizer_metadata(self.path, cfg))
    self.paths = self._shards()
    sources: dict[str, Source] = {}
    for p in self.paths:
      for name, s in read_safetensors_header(p).items():
        if name in sources: raise GGUFError(f"{p}: tensor {name!r} also appears in {sources[name].path.name}")
        sources[name] = s
    self._plan(arch, sources)
    self._maps: dict[pathlib.Path, np.memmap] = {}

  def _json(self, name: str) -> dict:
    p = self.path / name
    try: return json.loads(p.read_text())
    except FileNotFoundError: raise GGUFError(f"{self.path}: no {name}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e: raise GGUFError(f"{p}: not valid JSON ({e})") from None

  def _shards(self) -> list[pathlib.Path]:
    if (self.path / "model.safetensors").is_file(): return [self.path / "model.safetensors"]
    if not (self.path / "model.safetensors.index.json").is_file():
      raise GGUFError(f"{self.path}: no model.safetensors or model.safetensors.index.json (other weight formats are not read)")
    files = sorted(set(self._json("model.safetensors.index.json").get("weight_map", {}).values()))
    if not files: raise GGUFError(f"{self.path / 'model.safetensors.index.json'}: empty weight_map")
    for f in files:
      if not (self.path / f).is_file(): raise GGUFError(f"{self.path / 'model.safetensors.index.json'}: shard {f!r} is missing")
    return [self.path / f for f in files]

  def _plan(self, arch: str, sources: dict[str, Source]) -> None:
    """GGUF name -> the sources it is made of and how (`self.parts`), and its TensorInfo as the model sees it."""
    n_layer, table = int(self.config["num_hidden_layers"]), BLOCK_TABLES[arch]
    self.parts: dict[str, tuple[str, list[Source]]] = {}
    experts: dict[str, dict[int, Source]] = {}
    shift = lambda hf_name: arch == "gemma3" and hf_name.endswith("norm.weight")  # the converter's Gemma3Model.norm_shift
    for name, s in sources.items():
      if (gname := _GLOBAL.get(name)) is not None: self.parts[gname] = ("shift" if shift(name) else "plain", [s]); continue
      m = _LAYER_RE.match(name)
      if m is None: raise GGUFError(f"{s.path}: tensor {name!r} has no GGUF name for {arch}")
      i, rest = int(m.group(1)), m.group(2)
      if i >= n_layer: continue  # DeepSeek V3's multi-token-prediction layers (the converter drops them too)
      if (e := _EXPERT_RE.match(rest)) is not None and e.group(2) in EXPERT_TABLE:
        experts.setdefault(f"blk.{i}.{EXPERT_TABLE[e.group(2)]}", {})[int(e.group(1))] = s
        continue
      if rest not in table: raise GGUFError(f"{s.path}: tensor {name!r} has no GGUF name for {arch}")
      how = "permute_q" if arch == "llama" and rest == "self_attn.q_proj.weight" else \
            "permute_k" if arch == "llama" and rest == "self_attn.k_proj.weight" else "shift" if shift(name) else "plain"
      self.parts[f"blk.{i}.{table[rest]}"] = (how, [s])
    n_exp = int(self.config.get("n_routed_experts") or 0)
    for gname, by_e in experts.items():
      if sorted(by_e) != list(range(n_exp)): raise GGUFError(f"{self.path}: {gname} needs experts 0..{n_exp - 1}, the files have {sorted(by_e)}")
      if len({(s.shape, s.dtype) for s in by_e.values()}) != 1: raise GGUFError(f"{self.path}: the experts of {gname} differ in shape or dtype")
      self.parts[gname] = ("stack", [by_e[e] for e in range(n_exp)])
    self.generated: dict[str, np.ndarray] = {}
    if arch == "llama" and _rope_parameters(self.config)[0] == "llama3": self.generated["rope_freqs.weight"] = llama3_rope_freqs(self.config)
    self.infos: dict[str, TensorInfo] = {}
    for gname, a in self.generated.items():
      self.parts[gname] = ("generated", [])
      self.infos[gname] = TensorInfo(gname, QTYPE_BY_NAME["F32"], a.shape, self.path / "config.json", 0, a.nbytes)
    for gname, (how, srcs) in self.parts.items():
      if how == "generated": continue
      shape = (len(srcs), *srcs[0].shape) if how == "stack" else srcs[0].shape
      qt = QTYPE_BY_NAME["F32" if how == "shift" else self._qtype(gname, shape, srcs[0].dtype)]
      nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // qt.block) * qt.nbytes
      self.infos[gname] = TensorInfo(gname, qt, shape, srcs[0].path, srcs[0].offset, nbytes)

  def _qtype(self, gname: str, shape: tuple[int, ...], dtype: str) -> str:
    q = self.quantize.upper() if self.quantize else None
    if q is None or len(shape) < 2 or gname.endswith(("ffn_gate_inp.weight", "attn_kv_b.weight")): return dtype
    if shape[-1] % QTYPE_BY_NAME[q].block: q = QUANTIZE_FALLBACK.get(q)
    return dtype if q is None or shape[-1] % QTYPE_BY_NAME[q].block else q

  @property
  def arch(self) -> str: return self.metadata["general.architecture"]
  @property
  def file_size(self) -> int: return sum(p.stat().st_size for p in self.paths)
  @property
  def n_params(self) -> int: return sum(i.n_elements for i in self.infos.values())
  def __contains__(self, name: str) -> bool: return name in self.infos
  def __repr__(self): return f"Checkpoint({str(self.path)!r}, arch={self.arch!r}, tensors={len(self.infos)}, quantize={self.quantize!r})"
  def get(self, key: str, default: Any = None) -> Any: return self.metadata.get(key.replace("{arch}", self.arch), default)

  def identity(self) -> str:
    """What the step cache keys a loaded model by: the config and tokenizer files, every shard's size and header, and
    the quantization asked for."""
    h = hashlib.sha256(f"quantize={self.quantize}".encode())
    for p in sorted(self.path.iterdir()):
      if p.suffix == ".json" or p.name.endswith(".jinja"): h.update(p.name.encode() + p.read_bytes())
    for p in self.paths:
      h.update(f"{p.name}:{p.stat().st_size}".encode())
      with open(p, "rb") as f: h.update(f.read(struct.unpack("<Q", f.read(8))[0]))  # the JSON header
    return h.hexdigest()

  def _mmap(self, path: pathlib.Path) -> np.memmap:
    if path not in self._maps: self._maps[path] = np.memmap(path, mode="r")
    return self._maps[path]

  @staticmethod
  def _read(s: Source) -> np.ndarray:
    """A source tensor read into memory of its own: through the mapping, its pages would stay resident as part of the
    process (a quantizing load would end up holding the whole float file)."""
    return np.fromfile(s.path, _ST_DTYPES[s.dtype][1], s.nbytes // np.dtype(_ST_DTYPES[s.dtype][1]).itemsize, offset=s.offset).reshape(s.shape)

  def host_array(self, name: str) -> np.ndarray:
    """The tensor `name` as the GGUF converter would store it unquantized: the file's dtype (BF16 as uint16 bits),
    reordered or stacked as its name needs."""
    how, srcs = self.parts[name]
    if how == "generated": return self.generated[name]
    if how == "stack": return np.stack([self._read(s) for s in srcs])
    a = self._read(srcs[0])
    if how == "plain": return a
    if how == "shift":  # Gemma's norm weights w as the 1 + w its RMSNorm multiplies by, in the converter's arithmetic:
      # float32 (bfloat16 widened first), float16 in float16 (the converter adds in the tensor's own type), stored F32
      if srcs[0].dtype == "BF16": a = (a.astype(np.uint32) << 16).view(np.float32)
      return (a + a.dtype.type(1)).astype(np.float32)
    heads = self.config["num_attention_heads"] if how == "permute_q" else self.config.get("num_key_value_heads") or self.config["num_attention_heads"]
    return _permute_heads(a, int(heads))

  def release(self, t: Tensor) -> None:
    """GGUFFile.release's counterpart: nothing, as a tensor made from a checkpoint is in memory and freed with its last
    reference."""

  def tensor(self, name: str, device: str | None = None) -> QTensor:
    if (info := self.infos.get(name)) is None: raise GGUFError(f"{self.path}: no tensor named {name!r}")
    device = Device.canonicalize(device or Device.DEFAULT)
    how, srcs = self.parts[name]
    if device.startswith("NULL"): raw = Tensor.empty(info.nbytes, dtype=dtypes.uint8, device=device)
    elif how == "generated": raw = host_tensor(self.generated[name].view(np.uint8).reshape(-1), "CPU").to(device).realize()
    elif how == "plain" and info.qtype.name == srcs[0].dtype and device.startswith("CPU") and \
        (info.qtype.name != "F32" or (self._mmap(srcs[0].path).ctypes.data + srcs[0].offset) % 32 == 0):
      mm = self._mmap(srcs[0].path)  # the file's own bytes, as GGUFFile maps them (F32 only where 32-byte aligned: kernel_opts)
      raw = Tensor.from_blob(mm.ctypes.data + srcs[0].offset, (info.nbytes,), dtype=dtypes.uint8, device=device)
      weakref.finalize(raw.uop.buffer, lambda m: None, mm)
    else:
      data = self._packed(name, info)
      if device.startswith("CPU"): raw = host_tensor(data, device)
      else:
        def fill(piece: memoryview, off: int) -> None: piece[:] = data[off:off + len(piece)]
        raw = Tensor(UOp.from_buffer(device_buffer(device, data.size, dtypes.uint8, fill)))
    return QTensor(raw.reshape(info.block_shape), info.qtype, info.shape)

  def _packed(self, name: str, info: TensorInfo) -> np.ndarray:
    """The bytes of `name` in its GGUF type: the file's floats as they are, or quantized from float32 (gguf-py's
    quantizers, kquant's for Q4_K) a few rows at a time (the quantizers hold several float temporaries of their input:
    whole, a big head would cost ~3x its float size, ~10x with Q4_K's) and for stacked experts one expert at a time.
    Blocks never span rows, so this is bit for bit the quantization of the whole tensor."""
    how, srcs = self.parts[name]
    if how in ("generated", "shift") or info.qtype.name == srcs[0].dtype:
      return np.ascontiguousarray(self.host_array(name)).view(np.uint8).reshape(-1)
    qt, row_bytes = gguf.GGMLQuantizationType[info.qtype.name], info.shape[-1] // info.qtype.block * info.qtype.nbytes
    quantize = quantize_q4_k if info.qtype.name == "Q4_K" else lambda f: gguf_quantize(f, qt)
    out = np.empty((int(np.prod(info.shape[:-1], dtype=np.int64)), row_bytes), np.uint8)
    pieces = [(s, None) for s in srcs] if how == "stack" else [(srcs[0], name)]
    row = 0
    for s, whole in pieces:
      a = self.host_array(whole) if whole is not None else self._read(s)
      a = a.reshape(-1, a.shape[-1])
      step = max(1, QUANTIZE_ROWS_BYTES // (4 * a.shape[-1]))
      for i in range(0, a.shape[0], step):
        f = (a[i:i + step].astype(np.uint32) << 16).view(np.float32) if s.dtype == "BF16" else a[i:i + step].astype(np.float32)
        out[row + i:row + i + len(f)] = quantize(f)
      row += a.shape[0]
    return out.reshape(-1)

  def tensors(self, device: str | None = None) -> dict[str, QTensor]: return {name: self.tensor(name, device) for name in self.infos}

def open_model(path: str | os.PathLike, quantize: str | None = None):
  """A GGUF file or a checkpoint folder, by what `path` is. `quantize` applies to checkpoint folders only."""
  if is_checkpoint(path): return Checkpoint(path, quantize)
  if pathlib.Path(path).is_dir():
    raise GGUFError(f"{path}: is a directory without config.json, expected a .gguf file or a Hugging Face checkpoint folder")
  if quantize is not None: raise GGUFError(f"{path}: --quantize applies to checkpoint folders; a GGUF file is used as it is")
  return GGUFFile(path)
