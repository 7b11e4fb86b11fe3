"""bitnet (BitNet b1.58: sub-norms before the output and down projections, silu-gated FFN, ternary weights) against
transformers and llama.cpp: the tiny random model of tests/fixtures/bitnet (make_bitnet_fixtures.py), converted by
llama.cpp's converter (which ternarizes the projections) and quantized by llama.cpp to TQ1_0 and TQ2_0. The reference for
each file is transformers on that file's gguf-py-dequantized weights; llama.cpp's own run (activations rounded to Q8_K
inside its ternary matmuls) is matched with `llama_cpp_activations`. Exact mode over the prompt and the continuation,
the engine path (a captured 32-token chunk, then per-token steps), and greedy generation."""
import json, pathlib

import gguf
import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from family import assert_matches_transformers, llama_cpp_rounded, rel
from tg_ds4.runtime.runner import Runner

ROOT = pathlib.Path(__file__).parent / "fixtures" / "bitnet"
MAN = json.loads((ROOT / "manifest.json").read_text())
IDS = MAN["token_ids"]
QUANTS = ["F32", "TQ1_0", "TQ2_0"]

@pytest.mark.parametrize("q", QUANTS)
def test_bitnet_matches_transformers(q):
  """F32 is the converter's float file; TQ1_0/TQ2_0 are the packed ternary files against their dequantized twins (the
  issue's bar there is 1e-4; they hold the F32 bar)."""
  g = MAN["ggufs"][q]
  assert_matches_transformers(f"bitnet {q} {g['tensor_types']}", ROOT, g, IDS)

@pytest.mark.parametrize("q", QUANTS[1:])
def test_bitnet_matches_llama_cpp_rounding(q):
  """With llama.cpp's activation rounding (Q8_K rows into the ternary and Q6_K matmuls) the prompt logits are llama.cpp's
  to float-summation noise, 100x closer than to transformers' unrounded ones, and the greedy continuation is its own."""
  g = MAN["ggufs"][q]
  (got, greedy), lcp, hf = llama_cpp_rounded(ROOT, g, IDS, MAN["n_gen"]), np.load(ROOT / g["llama_logits"]), np.load(ROOT / g["logits"])[:len(IDS)]
  print(f"\nbitnet {q} with llama.cpp rounding: {rel(got, lcp):.1e} from llama.cpp; llama.cpp {rel(lcp, hf):.1e} from transformers")
  assert rel(got, lcp) <= 2e-5 and rel(lcp, hf) > 100 * rel(got, lcp)
  assert greedy == g["llama_greedy_ids"] and min(g["llama_greedy_top2_margin"]) > 1e-2

def _with_scales(dst: pathlib.Path, scales: dict[str, float]) -> None:
  """The F32 fixture with each `name` in `scales` stored as weight / c plus a one-element `name.scale` = c, the per-tensor
  scales llama.cpp's bitnet graph multiplies each projection's output by (each optional)."""
  r = GGUFReader(ROOT / MAN["ggufs"]["F32"]["file"])
  w = GGUFWriter(str(dst), "bitnet")
  for name, f in r.fields.items():
    if name.startswith("GGUF.") or name == "general.architecture": continue
    t = f.types[0]
    if t == GGUFValueType.ARRAY: w.add_array(name, f.contents())
    elif t == GGUFValueType.STRING: w.add_string(name, f.contents())
    else: w.add_key_value(name, f.contents(), t)
  for t in r.tensors:
    a = np.asarray(t.data, np.float32).reshape([int(x) for x in reversed(t.shape)])
    base = t.name.removesuffix(".weight")
    if base in scales:
      w.add_tensor(t.name, (a / np.float32(scales[base])).astype(np.float32))
      w.add_tensor(base + ".scale", np.array([scales[base]], np.float32))
    else: w.add_tensor(t.name, a)
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

def test_bitnet_per_tensor_scales(tmp_path):
  """A file whose projections carry `.scale` tensors (some, not all: each is optional) computes the same model."""
  scales = {"blk.0.attn_q": 0.37, "blk.0.attn_output": 3.0, "blk.0.ffn_gate": 0.5, "blk.1.ffn_up": 1.7, "blk.1.ffn_down": 0.21,
            "blk.1.attn_k": 2.5}
  _with_scales(path := tmp_path / "scaled.gguf", scales)
  assert sum(t.name.endswith(".scale") for t in gguf.GGUFReader(path).tensors) == len(scales)
  r = Runner.load(path, max_ctx=64)
  assert r.model.cfg.weight_scales and r.model.blk[0].attn.attn_q.scale is not None and r.model.blk[0].attn.attn_k.scale is None
  ref = np.load(ROOT / MAN["ggufs"]["F32"]["logits"])[:len(IDS)]
  got = r.prefill(IDS, chunk=len(IDS)).numpy()[0]
  print(f"\nbitnet with .scale tensors: {rel(got, ref):.1e} from transformers")
  assert rel(got, ref) <= 2e-5
