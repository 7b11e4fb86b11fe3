"""Hugging Face checkpoint folders (tg_ds4/io/hf_folder.py, io/hf_tokenizer.py) against independent references: transformers'
logits, greedy ids, tokenizations, decodes and (gemma3) chat rendering of the same folders
(tests/fixtures/make_hf_fixtures.py), llama.cpp's converter's GGUF of the same DeepSeek-V3-style and Gemma 3 models
(metadata and every tensor), gguf-py's quantizers and ggml's own Q4_K blocks (tests/fixtures/make_q4k_reference.py)."""
import hashlib, json, os, pathlib, struct, subprocess, sys

import gguf
import numpy as np
import pytest
from gguf.quants import quantize
from tinygrad import dtypes

from tg_ds4.config import ModelConfig
from tg_ds4.io.gguf import GGUFError, GGUFFile
from tg_ds4.io.hf_folder import Checkpoint, open_model
from tg_ds4.quant.kquant_writer import Q4_K_BLOCK, quantize_blocks, quantize_q4_k
from tg_ds4.runtime.runner import GREEDY, Runner
from tg_ds4.text.chat_template import Template
from tg_ds4.text.tokenizer import Tokenizer

FIX = pathlib.Path(__file__).parent / "fixtures"
HF = FIX / "hf"
NAMES = ["llama", "llama3", "qwen2", "gemma3", "ds3"]

def ref(name: str) -> dict: return json.loads((HF / name / "reference.json").read_text())

def test_ds3_is_what_llama_cpps_converter_writes():
  """Metadata and tensors of the ds3 folder equal the converter's F32 GGUF of the same model: every model key (GGUF's
  own version fields aside), the vocab, token types, merges and special ids, and every tensor bit for bit. The one
  difference: the converter splits attn_kv_b into attn_k_b / attn_v_b, which the model does at load from attn_kv_b."""
  c, g = Checkpoint(HF / "ds3"), GGUFFile(FIX / "deepseek2/ds3/ds3-F32.gguf")
  for k, v in g.metadata.items():
    if k.startswith(("GGUF.", "general.")) or k == "tokenizer.ggml.pre": continue
    assert k in c.metadata, k
    assert c.metadata[k] == v or (isinstance(v, float) and c.metadata[k] == pytest.approx(v, rel=1e-6)), (k, v, c.metadata[k])
  split = {n for n in g.infos if n.endswith(("attn_k_b.weight", "attn_v_b.weight"))}
  assert set(g.infos) - split == set(c.infos) - {n for n in c.infos if n.endswith("attn_kv_b.weight")}
  for n in set(g.infos) - split:
    np.testing.assert_array_equal(c.tensor(n).dequant(dtypes.float32).numpy(), g.tensor(n).dequant(dtypes.float32).numpy(), err_msg=n)

def test_gemma3_is_what_llama_cpps_converter_writes():
  """The gemma3 folder's model keys equal those of the converter's GGUF of it (sliding window, both RoPE bases, the
  global layers' linear scaling, key/value length, the final softcap) and every tensor bit for bit: the 1 + w norms
  (F32) included. Its vocab keys are not compared: for a folder without tokenizer.model the converter takes the
  byte-level path, which a SentencePiece-style vocab is not (the tokenizer is checked against transformers instead)."""
  c, g = Checkpoint(HF / "gemma3"), GGUFFile(HF / "gemma3" / "converter-BF16.gguf")
  keys = [k for k in g.metadata if not k.startswith(("GGUF.", "general.", "tokenizer."))]
  assert "gemma3.rope.freq_base_swa" in keys and "gemma3.rope.scaling.factor" in keys and "gemma3.attention.sliding_window" in keys
  for k in keys:
    v = g.metadata[k]
    assert c.metadata.get(k) == (pytest.approx(v, rel=1e-6) if isinstance(v, float) else v), (k, v, c.metadata.get(k))
  assert set(c.infos) == set(g.infos) and "blk.0.post_ffw_norm.weight" in c.infos and "output.weight" not in c.infos
  for n, info in c.infos.items():
    assert info.qtype.name == g.infos[n].qtype.name, n
    np.testing.assert_array_equal(c.tensor(n).dequant(dtypes.float32).numpy(), g.tensor(n).dequant(dtypes.float32).numpy(), err_msg=n)

@pytest.mark.parametrize("name", NAMES)
def test_logits_and_greedy_match_transformers(name):
  r, want = ref(name), np.load(HF / name / "logits_hf.npy")
  runner = Runner.load(Checkpoint(HF / name), max_ctx=64)
  got = runner.prefill(r["token_ids"], chunk=len(r["token_ids"])).numpy()[0]
  err = float(np.abs(got - want).max() / np.abs(want).max())
  print(f"\n{name}: prefill vs transformers {err:.2e}")
  assert err <= 2e-5
  assert list(Runner.load(Checkpoint(HF / name), max_ctx=64).generate(r["token_ids"], len(r["greedy_ids"]), GREEDY)) == r["greedy_ids"]

@pytest.mark.parametrize("name", NAMES)
def test_tokenizer_matches_transformers(name):
  tok = Tokenizer.from_gguf(Checkpoint(HF / name))
  assert tok.backend == "tokenizer.json"
  for case in ref(name)["tokenizations"]:
    assert tok.encode(case["text"], add_special=True, parse_special=True) == case["ids"], case["text"]
    if "decoded" in case: assert tok.decode(case["ids"], skip_special=True) == case["decoded"], case["text"]
    if "<" not in case["text"] and "\u2581" not in case["text"]: assert tok.decode(case["ids"], skip_special=True) == case["text"]

def test_gemma3_chat_template_matches_transformers():
  """Gemma 3's template (system turn folded into the first user turn, roles user/model, trimmed contents) renders as
  transformers renders it, starting with <bos>, so encoding adds none and the ids are transformers' ids."""
  c, want = Checkpoint(HF / "gemma3"), ref("gemma3")["chat"]
  t, tok = Template.from_gguf(c), Tokenizer.from_gguf(c)
  text = t.render(want["messages"])
  assert text == want["text"] and text.startswith("<bos><start_of_turn>user\n")
  assert tok.encode(text, add_special=t.encode_add_special(text), parse_special=True) == want["ids"]

def _gemma3_variant(d: pathlib.Path, **changes) -> Checkpoint:
  cfg = {**json.loads((HF / "gemma3" / "config.json").read_text()), **changes}
  (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not ...}))
  for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    if not (d / f).exists(): (d / f).symlink_to(HF / "gemma3" / f)
  return Checkpoint(d)

def test_gemma3_config_forms_and_layer_patterns(tmp_path):
  """config.json as transformers 4.5x wrote Gemma 3's (rope_theta, rope_local_base_freq, rope_scaling,
  sliding_window_pattern; no layer_types or rope_parameters) gives the same GGUF keys as transformers 5's form. The
  converter writes no window pattern (llama.cpp: every 6th layer global); layer_types of another layout get llama.cpp's
  per-layer pattern array, none sliding no window; what llama.cpp's gemma3 cannot compute is refused."""
  new = Checkpoint(HF / "gemma3")
  assert "gemma3.attention.sliding_window_pattern" not in new.metadata
  assert ModelConfig.from_gguf(new).swa_layers == (True,) * 5 + (False,)
  old = _gemma3_variant(tmp_path, rope_parameters=..., layer_types=..., _sliding_window_pattern=..., sliding_window_pattern=6,
                        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rope_scaling={"rope_type": "linear", "factor": 8.0})
  model_keys = lambda c: {k: v for k, v in c.metadata.items() if k.startswith("gemma3.")}
  assert model_keys(old) == model_keys(new)
  alt = ["sliding_attention", "full_attention"] * 3
  c = _gemma3_variant(tmp_path, layer_types=alt)
  assert c.metadata["gemma3.attention.sliding_window_pattern"] == [True, False] * 3
  assert ModelConfig.from_gguf(c).swa_layers == (True, False) * 3
  c = _gemma3_variant(tmp_path, layer_types=["full_attention"] * 6)
  assert "gemma3.attention.sliding_window" not in c.metadata and ModelConfig.from_gguf(c).swa_window == 0
  with pytest.raises(GGUFError, match="query_pre_attn_scalar 256 differs from the 16"): _gemma3_variant(tmp_path, query_pre_attn_scalar=256)
  with pytest.raises(GGUFError, match="attn_logit_softcapping"): _gemma3_variant(tmp_path, attn_logit_softcapping=50.0)

@pytest.mark.parametrize("qtype,gets", [("q8_0", "Q8_0"), ("q4_0", "Q4_0"), ("q4_k", "Q5_0")])
def test_quantize_at_load_is_gguf_pys_quantize(qtype, gets):
  """Each quantized matrix holds exactly gguf-py's blocks for the converter's float tensor of the same name; vectors, the
  router and attn_kv_b stay float. ds3's rows (32..128 elements) are no whole Q4_K block, so q4_k gives every matrix
  llama.cpp's fallback Q5_0."""
  c, g = Checkpoint(HF / "ds3", qtype), GGUFFile(FIX / "deepseek2/ds3/ds3-F32.gguf")
  qt = gguf.GGMLQuantizationType[gets]
  quantized = [n for n, i in c.infos.items() if i.qtype.name == gets]
  assert "blk.1.ffn_gate_exps.weight" in quantized and "token_embd.weight" in quantized and "output.weight" in quantized
  assert all(c.infos[n].qtype.name == "F32" for n in c.infos if n.endswith(("norm.weight", "ffn_gate_inp.weight", "attn_kv_b.weight", ".bias")))
  for n in quantized:
    want = quantize(g.tensor(n).dequant(dtypes.float32).numpy(), qt)
    np.testing.assert_array_equal(c.tensor(n).blocks.numpy().reshape(want.shape), want, err_msg=n)

def test_q4_k_is_ggmls_quantizer():
  """kquant's blocks equal ggml's (`ggml_quantize_chunk`, no importance matrix) byte for byte on every case of the
  committed reference (weights-like blocks, outliers, ties, flat blocks, d rounding to float16 0 or overflowing it),
  and on 16k streamed weights-like blocks by the SHA-256 of ggml's blocks per 1024: there a sum or product taken in
  another order than ggml's changes 14..205 of the blocks (measured per order change), the few hundred committed ones
  would likely miss it."""
  from fixtures.make_q4k_reference import STREAM_BLOCKS, STREAM_CHUNK, stream_blocks
  ref = np.load(FIX / "q4k_reference.npz")
  with np.errstate(all="ignore"): got = quantize_blocks(ref["x"])  # the overflowing cases compute with inf, as ggml does
  for i, kind in enumerate(ref["kinds"]):
    np.testing.assert_array_equal(got[ref["kind"] == i], ref["q4k"][ref["kind"] == i], err_msg=str(kind))
  chunks = quantize_blocks(stream_blocks(STREAM_BLOCKS)).reshape(-1, STREAM_CHUNK * got.shape[1])
  assert [hashlib.sha256(c.tobytes()).hexdigest() for c in chunks] == list(ref["stream_sha256"])

def test_q4_k_load_is_kquant_with_q5_0_fallback(tmp_path):
  """A q4_k load of a folder with 256-element rows: each matrix with whole 256-element rows holds exactly kquant's blocks
  of its converter-order floats (llama's q/k permuted), ffn_down's 288-element rows get llama.cpp's fallback Q5_0
  (gguf-py's blocks), norms stay F32. The engine's dequant of each Q4_K block is within R/15 of the floats, R a block's
  span max(x, 0) - min(x, 0): half a 4-bit step of a sub-block's span (<= R/30), plus the 6-bit rounding of its min
  (<= R/126) and of its scale times the top quant 15 (~R/126), ~R/20, leaves room for the weighted fit's leaving a
  sub-block's extremes outside its grid (measured: R/22 here, R/17 at worst on 20k N(0, 1) or uniform blocks); a
  packing or scale bug costs ~R."""
  _write_big_llama(tmp_path, layers=1, dim=256, ff=288, vocab=512)
  c = Checkpoint(tmp_path, "q4_k")
  types = {n: i.qtype.name for n, i in c.infos.items()}
  assert types["blk.0.ffn_down.weight"] == "Q5_0" and types["blk.0.attn_norm.weight"] == "F32"
  assert {n for n, t in types.items() if t == "Q4_K"} == {n for n, i in c.infos.items() if len(i.shape) == 2 and i.shape[-1] % Q4_K_BLOCK == 0}
  for n, t in types.items():
    if t == "F32": continue
    x = c.host_array(n).astype(np.float32)
    want = quantize_q4_k(x) if t == "Q4_K" else quantize(x, gguf.GGMLQuantizationType[t])
    np.testing.assert_array_equal(c.tensor(n).blocks.numpy().reshape(want.shape), want, err_msg=n)
    if t != "Q4_K": continue
    blocks, got = x.reshape(-1, Q4_K_BLOCK), c.tensor(n).dequant(dtypes.float32).numpy().reshape(-1, Q4_K_BLOCK)
    span = np.maximum(blocks.max(1), 0) - np.minimum(blocks.min(1), 0)
    assert (np.abs(got - blocks).max(1) <= span / 15).all(), (n, float((np.abs(got - blocks).max(1) / span).max()))

def test_errors_name_the_file_and_what_was_expected(tmp_path):
  with pytest.raises(GGUFError, match="is a directory without config.json"): open_model(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
  with pytest.raises(GGUFError, match="'MambaForCausalLM' is not supported"): open_model(tmp_path)
  for f in ("config.json", "tokenizer.json", "tokenizer_config.json"): (tmp_path / f).write_bytes((HF / "llama" / f).read_bytes())
  with pytest.raises(GGUFError, match="no model.safetensors"): open_model(tmp_path)
  (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
  with pytest.raises(GGUFError, match="header length .* runs past the end"): open_model(tmp_path)
  with pytest.raises(GGUFError, match="--quantize 'q2_k' is not supported"): open_model(HF / "llama", "q2_k")
  with pytest.raises(GGUFError, match="--quantize applies to checkpoint folders"): open_model(FIX / "deepseek2/ds3/ds3-F32.gguf", "q4_0")

def _write_big_llama(d: pathlib.Path, layers: int = 8, dim: int = 1024, ff: int = 4096, vocab: int = 8192) -> int:
  """A random llama checkpoint of ~580 MB float32 (no transformers needed); returns its largest tensor's bytes."""
  rng = np.random.default_rng(0)
  shapes = {"model.embed_tokens.weight": (vocab, dim), "model.norm.weight": (dim,), "lm_head.weight": (vocab, dim)}
  for i in range(layers):
    p = f"model.layers.{i}."
    shapes.update({p + "input_layernorm.weight": (dim,), p + "post_attention_layernorm.weight": (dim,),
                   p + "self_attn.q_proj.weight": (dim, dim), p + "self_attn.k_proj.weight": (dim // 2, dim),
                   p + "self_attn.v_proj.weight": (dim // 2, dim), p + "self_attn.o_proj.weight": (dim, dim),
                   p + "mlp.gate_proj.weight": (ff, dim), p + "mlp.up_proj.weight": (ff, dim), p + "mlp.down_proj.weight": (dim, ff)})
  header, off = {}, 0
  for n, s in shapes.items():
    header[n] = {"dtype": "F32", "shape": list(s), "data_offsets": [off, off + 4 * int(np.prod(s))]}; off += 4 * int(np.prod(s))
  hj = json.dumps(header).encode()
  with open(d / "model.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(hj)) + hj)
    for n, s in shapes.items(): f.write((rng.standard_normal(s, dtype=np.float32) * 0.02).tobytes())
  cfg = json.loads((HF / "llama" / "config.json").read_text())
  cfg.update(hidden_size=dim, intermediate_size=ff, num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8, head_dim=dim // 16,
             vocab_size=vocab)
  (d / "config.json").write_text(json.dumps(cfg))
  for f in ("tokenizer.json", "tokenizer_config.json"): (d / f).write_bytes((HF / "llama" / f).read_bytes())
  return max(4 * int(np.prod(s)) for s in shapes.values())

RSS_SCRIPT = """
import re, sys
from tg_ds4.io.hf_folder import Checkpoint
from tg_ds4.runtime.runner import Runner
kb = lambda key: int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
Runner.load(Checkpoint(sys.argv[2]), max_ctx=16)  # the runtime's one-time setup (compiler, tables) before measuring
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from the resident size now
base = kb("VmRSS")
c = Checkpoint(sys.argv[1], "q4_0")
r = Runner.load(c, max_ctx=16)
print(base, kb("VmHWM"), sum(i.nbytes for i in c.infos.values()))
"""

def test_quantizing_load_holds_one_float_tensor_at_a_time(tmp_path):
  """Peak RSS of a --quantize q4_0 load of a ~580 MB float32 checkpoint: at most 1.3x the quantized model plus the largest
  float tensor over the process's RSS before the load (never the whole model in float32, nor the file's pages). The
  process has loaded a tiny model first, so the runtime's one-time setup (~40 MB) is not counted: at this size it would
  be half the bound. Measured: 131 MB over for 80 MB quantized and a 34 MB largest tensor (bound 138 MB); rows replaced
  by gate|up stacking but left in tinygrad's allocator cache would pass it (146 MB)."""
  largest = _write_big_llama(tmp_path)
  env = {**os.environ, "TG_DS4_STEP_CACHE": "0"}
  out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path), str(HF / "llama")], capture_output=True, text=True, env=env, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  base, peak, qbytes = map(int, out.stdout.split()[-3:])
  file_bytes = (tmp_path / "model.safetensors").stat().st_size
  print(f"\nfile {file_bytes / 1e6:.0f} MB, quantized {qbytes / 1e6:.0f} MB, largest tensor {largest / 1e6:.0f} MB: "
        f"RSS {base / 1e6:.0f} -> {peak / 1e6:.0f} MB (+{(peak - base) / 1e6:.0f})")
  assert peak - base <= 1.3 * qbytes + largest

def test_sharded_folder_loads_the_same_model(tmp_path):
  """model.safetensors split into two shards with model.safetensors.index.json (as save_pretrained writes big models):
  the same tensors, so the same logits bit for bit."""
  src = Checkpoint(HF / "llama")
  with open(HF / "llama" / "model.safetensors", "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header, data = json.loads(f.read(n)), f.read()
  names = sorted(k for k in header if k != "__metadata__")
  weight_map = {}
  for part, chunk in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
    fname, hdr, blobs, off = f"model-0000{part + 1}-of-00002.safetensors", {}, [], 0
    for k in chunk:
      a, b = header[k]["data_offsets"]
      hdr[k] = {**header[k], "data_offsets": [off, off + b - a]}; blobs.append(data[a:b]); off += b - a
      weight_map[k] = fname
    hj = json.dumps(hdr).encode()
    (tmp_path / fname).write_bytes(struct.pack("<Q", len(hj)) + hj + b"".join(blobs))
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
  for f in ("config.json", "tokenizer.json", "tokenizer_config.json"): (tmp_path / f).write_bytes((HF / "llama" / f).read_bytes())
  sharded = Checkpoint(tmp_path)
  assert len(sharded.paths) == 2 and sharded.infos.keys() == src.infos.keys()
  ids = ref("llama")["token_ids"]
  a = Runner.load(src, max_ctx=64).prefill(ids, chunk=len(ids)).numpy()
  b = Runner.load(sharded, max_ctx=64).prefill(ids, chunk=len(ids)).numpy()
  np.testing.assert_array_equal(a, b)
