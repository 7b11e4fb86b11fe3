"""qwen3 (GQA with per-head q/k norms, a head size other than hidden / heads, NEOX RoPE, untied head) against
transformers and llama.cpp: the tiny random model of tests/fixtures/qwen3 (make_qwen3_fixtures.py), converted by
llama.cpp's converter and quantized by llama.cpp to Q8_0. The reference for each file is transformers on that file's
gguf-py-dequantized weights; llama.cpp's own Q8_0 run (activations rounded to Q8_0) is matched with
`llama_cpp_activations`. Exact mode over the prompt and the continuation, the engine path (a captured 32-token chunk,
then per-token steps), and greedy generation."""
import functools, json, pathlib

import numpy as np
import pytest

from tg_ds4.runner import Runner

ROOT = pathlib.Path(__file__).parent / "fixtures" / "qwen3"
MAN = json.loads((ROOT / "manifest.json").read_text())
IDS = MAN["token_ids"]
QUANTS = ["F32", "Q8_0"]

def rel(a, b) -> float: return float(np.abs(a - b).max() / np.abs(b).max())

@functools.cache
def run(q: str) -> dict:
  g = MAN["ggufs"][q]
  seq, r = IDS + g["hf_greedy_ids"][:-1], Runner.load(ROOT / g["file"], max_ctx=64)
  K = r.chunked(len(IDS))
  assert r._plan(len(IDS), 12) == ([32], 8) and K == 32  # a chunk, then 8 prompt tokens through the per-token step
  return {"prefill": r.prefill(seq, chunk=len(seq)).numpy()[0], "engine": r.engine_logits(seq, prefill_tokens=K), "K": K,
          "greedy": list(r.generate(IDS, MAN["n_gen"]))}

@pytest.mark.parametrize("q", QUANTS)
def test_qwen3_matches_transformers(q):
  g, r = MAN["ggufs"][q], run(q)
  ref = np.load(ROOT / g["logits"])
  print(f"\nqwen3 {q} {g['tensor_types']}: exact mode {rel(r['prefill'], ref):.1e}, engine rows {r['K'] - 1}.. "
        f"{rel(r['engine'], ref[r['K'] - 1:]):.1e} (llama.cpp's own run: {g['llama_vs_hf_prompt_rel']:.1e} from transformers)")
  assert rel(r["prefill"], ref) <= 2e-5 and rel(r["engine"], ref[r["K"] - 1:]) <= 2e-5
  assert r["greedy"] == g["hf_greedy_ids"] and min(g["hf_greedy_top2_margin"]) > 1e-2

@pytest.mark.parametrize("q", QUANTS[1:])
def test_qwen3_matches_llama_cpp_rounding(q):
  """With llama.cpp's activation rounding (Q8_0 rows into every matmul) the prompt logits are llama.cpp's to float
  summation noise, 100x closer than to transformers' unrounded ones, and the greedy continuation is its own (which
  differs from transformers' at its 6th token)."""
  g = MAN["ggufs"][q]
  r = Runner.load(ROOT / g["file"], max_ctx=64, llama_cpp_activations=True)
  got, lcp, hf = r.prefill(IDS, chunk=len(IDS)).numpy()[0], np.load(ROOT / g["llama_logits"]), np.load(ROOT / g["logits"])[:len(IDS)]
  print(f"\nqwen3 {q} with llama.cpp rounding: {rel(got, lcp):.1e} from llama.cpp; llama.cpp {rel(lcp, hf):.1e} from transformers")
  assert rel(got, lcp) <= 2e-5 and rel(lcp, hf) > 100 * rel(got, lcp)
  assert list(r.generate(IDS, MAN["n_gen"])) == g["llama_greedy_ids"] and min(g["llama_greedy_top2_margin"]) > 1e-2
