"""deepseek4 (DeepSeek V4 Flash architecture, tg_ds4/models/deepseek4.py) against the independent references in
tests/fixtures/deepseek4/flash (tests/fixtures/make_ds4_fixtures.py: a tiny random transformers deepseek_v4 model, GGUFs
written by llama.cpp's converter and quantizer, logits from transformers and llama.cpp; see its README).

The 375-token prompt runs far past the 32-row window, fills 93 ratio-4 rows (the indexer keeps 8) and 2 ratio-128
rows; the 16-token greedy continuation crosses the third ratio-128 boundary in decode. Decode goes token by token
through the TinyJit-captured step over the whole prompt. flash-MXFP4.gguf holds transformers' weights exactly, so exact
math is held to transformers; llama.cpp rounds every quantized matmul input to 8 bits, so for the llama.cpp comparisons
the model rounds them the same way (`numerics="llama.cpp"`, tg_ds4/quant/activations.py)."""
import functools, json, pathlib

import numpy as np
import pytest
from tinygrad.codegen import to_program_cache

from tg_ds4.runtime.runner import Runner

ROOT = pathlib.Path(__file__).parent / "fixtures" / "deepseek4" / "flash"
MAN = json.loads((ROOT / "manifest.json").read_text())  # a missing manifest fails the run
IDS, N_GEN = MAN.get("token_ids", []), MAN.get("n_gen", 0)

def rel(a, b) -> float: return float(np.abs(a - b).max() / np.abs(b).max())

_models: dict[tuple[str, bool], Runner] = {}
def load(q: str, llama_cpp: bool = False) -> Runner:
  """One model per (file, rounding) for the whole module: runs restart at position 0, which needs no cache reset."""
  if (q, llama_cpp) not in _models:
    _models[q, llama_cpp] = Runner.load(ROOT / MAN["ggufs"][q]["file"], max_ctx=len(IDS) + N_GEN, numerics="llama.cpp" if llama_cpp else "exact")
  return _models[q, llama_cpp]

@functools.cache
def prefill(q: str, llama_cpp: bool = False) -> np.ndarray:
  return load(q, llama_cpp).prefill(IDS).numpy()[0]

@functools.cache
def decode(q: str, llama_cpp: bool = False) -> dict:
  """The prompt token by token through the captured decode step, then greedy for N_GEN tokens."""
  m, rows, greedy = load(q, llama_cpp), [], []
  for i in range(len(IDS) + N_GEN - 1):
    rows.append(m.decode(IDS[i] if i < len(IDS) else greedy[-1], i).numpy()[0, 0])
    if i >= len(IDS) - 1: greedy.append(int(rows[-1].argmax()))
  return {"prompt": np.stack(rows[:len(IDS)]), "gen": np.stack(rows[len(IDS) - 1:]), "greedy": greedy}

def test_prefill_matches_transformers():
  r = rel(prefill("MXFP4"), hf := np.load(ROOT / "logits_hf.npy"))
  print(f"\nMXFP4 prefill vs transformers: {r:.2e} (max|d| / max|logit|), top-1 {(prefill('MXFP4').argmax(-1) == hf.argmax(-1)).mean():.1%}")
  assert r <= 2e-5  # measured 9.6e-7

def test_decode_matches_transformers():
  d, hf = decode("MXFP4"), np.load(ROOT / "logits_hf.npy")
  print(f"\nMXFP4 decode vs transformers: prompt {rel(d['prompt'], hf):.2e}, continuation {rel(d['gen'], np.load(ROOT / 'gen_logits_hf.npy')):.2e}")
  assert rel(d["prompt"], hf) <= 2e-5 and rel(d["gen"], np.load(ROOT / "gen_logits_hf.npy")) <= 2e-5  # measured 7.8e-7, 9.6e-7
  assert d["greedy"] == MAN["hf_greedy_ids"]
  assert rel(d["prompt"], prefill("MXFP4")) <= 2e-5, "decode and prefill disagree"

def test_quantized_exact_matches_transformers_on_same_weights():
  """The IQ2_XXS file in exact math against transformers on gguf-py's dequantization of its weights (hfdq)."""
  g, d = MAN["ggufs"]["IQ2_XXS"], decode("IQ2_XXS")
  dq, gdq = np.load(ROOT / g["logits_hfdq"]), np.load(ROOT / g["gen_logits_hfdq"])
  print(f"\nIQ2_XXS vs hfdq: prefill {rel(prefill('IQ2_XXS'), dq):.2e}, decode {rel(d['prompt'], dq):.2e}, continuation {rel(d['gen'], gdq):.2e}")
  assert rel(prefill("IQ2_XXS"), dq) <= 5e-5 and rel(d["prompt"], dq) <= 5e-5 and rel(d["gen"], gdq) <= 5e-5  # measured ~1e-6
  assert d["greedy"] == g["hfdq_greedy_ids"]

ENGINE_K, RESUME_AT = 360, 300  # 12 captured 32-token chunks (the last padded), then 30 per-token steps

@pytest.mark.parametrize("q", ["MXFP4", "IQ2_XXS"])
def test_engine_path_matches_the_reference(q):
  """What generation runs, against transformers (MXFP4 holds its weights exactly) or hfdq: the captured prefill chunks'
  and per-token step's logits, `generate`'s greedy ids, and a second turn resumed at start_pos > 0 (within the rings'
  rewind) after a shorter first one."""
  g = MAN["ggufs"][q]
  name, want = ("logits_hf.npy", MAN["hf_greedy_ids"]) if q == "MXFP4" else (g["logits_hfdq"], g["hfdq_greedy_ids"])
  ref = np.concatenate([np.load(ROOT / name), np.load(ROOT / ("gen_" + name))[1:]])[ENGINE_K - 1:]
  m = Runner.load(ROOT / g["file"], max_ctx=len(IDS) + N_GEN, numerics="exact")
  e = m.engine_logits(IDS + want[:-1], prefill_tokens=ENGINE_K)
  print(f"\n{q}: engine path vs reference {rel(e, ref):.2e} over {len(ref)} rows")
  assert e.shape == ref.shape and rel(e, ref) <= 5e-5  # measured 8.3e-7 (MXFP4), 9.8e-7 (IQ2_XXS)
  assert list(m.generate(IDS, N_GEN)) == want
  list(m.generate(IDS[:RESUME_AT], 1))
  assert (start := m.reusable(IDS)) == RESUME_AT and list(m.generate(IDS, N_GEN, start_pos=start)) == want

def test_prefill_matches_llama_cpp():
  """llama.cpp's own run of the MXFP4 file, its q8_0 rounding of the expert inputs reproduced: the same choices
  everywhere and logits up to rounding flips (a 1e-7 difference in float summation order can move an 8-bit rounding by
  one step, ~1% of a block's largest input, so they cannot agree to 1e-3 everywhere). Decode under llama.cpp's rounding
  is checked on the quantized file below."""
  ll, p = np.load(ROOT / MAN["ggufs"]["MXFP4"]["logits"]), prefill("MXFP4", True)
  top1 = float((p.argmax(-1) == ll.argmax(-1)).mean())
  print(f"\nMXFP4 prefill vs llama.cpp: {rel(p, ll):.2e}, top-1 {top1:.1%}")
  assert top1 >= 0.99 and rel(p, ll) <= 1e-2

def test_quantized_greedy_matches_llama_cpp():
  """IQ2_XXS/Q4_0 experts, Q8_0 elsewhere, with llama.cpp's activation rounding (every matmul input rounded, so more
  rounding flips, some of which change a routing or indexer choice): its greedy tokens and its top-1 choices."""
  g = MAN["ggufs"]["IQ2_XXS"]
  ll, d = np.load(ROOT / g["logits"]), decode("IQ2_XXS", True)
  top1 = float((d["prompt"].argmax(-1) == ll.argmax(-1)).mean())
  same = "identical" if d["greedy"] == g["greedy_ids"] else "differs"
  print(f"\nIQ2_XXS vs llama.cpp: decode {rel(d['prompt'], ll):.2e}, top-1 {top1:.1%}, greedy {same}")
  assert d["greedy"] == g["greedy_ids"] and top1 >= 0.97

def test_decode_recompiles_nothing():
  """After warm-up every position replays the one captured step (window completions included): no new kernel, no
  recapture."""
  decode("MXFP4")
  m = load("MXFP4")
  n, captured = len(to_program_cache), m._jits["greedy"].captured
  for i in range(120, 135): m.decode(IDS[i], i).realize()  # 127: a ratio-128 row completes
  assert len(to_program_cache) == n and m._jits["greedy"].captured is captured

def test_mtp_block_is_ignored(tmp_path):
  """A GGUF that also carries an MTP block (`nextn_predict_layers`, one more `blk.N`) loads as the same 3-layer model."""
  import gguf
  r = gguf.GGUFReader(ROOT / MAN["ggufs"]["MXFP4"]["file"])
  w = gguf.GGUFWriter(str(path := tmp_path / "mtp.gguf"), "deepseek4")
  extend = {"deepseek4.attention.compress_ratios": [0], "deepseek4.swiglu_clamp_exp": [1.5], "deepseek4.swiglu_clamp_shexp": [1.5]}
  for f in r.fields.values():
    if f.name.startswith("GGUF.") or f.name == "general.architecture": continue
    v = f.contents() + extend.get(f.name, []) if f.name in extend else f.contents() + 1 if f.name == "deepseek4.block_count" else f.contents()
    w.add_key_value(f.name, v, f.types[0], sub_type=f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
  w.add_uint32("deepseek4.nextn_predict_layers", 1)
  copy = lambda name, t: w.add_tensor(name, np.array(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
  for t in r.tensors: copy(t.name, t)
  for t in r.tensors:
    if t.name.startswith("blk.2."): copy(t.name.replace("blk.2.", "blk.3."), t)  # the MTP block: a full layer more
  w.add_tensor("blk.3.nextn.eh_proj.weight", np.zeros((256, 512), np.float32))
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  m = Runner.load(path, max_ctx=64).model
  assert m.cfg.n_layer == 3 and len(m.blk) == 3 and m.cfg.compress_ratios == (0, 4, 128, 0) and m.cfg.n_nextn == 1 and m.nextn is None
