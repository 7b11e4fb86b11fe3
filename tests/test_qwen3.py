"""qwen3 (GQA with per-head q/k norms, a head size other than hidden / heads, NEOX RoPE, untied head) against
transformers and llama.cpp: the tiny random model of tests/fixtures/qwen3 (make_qwen3_fixtures.py), converted by
llama.cpp's converter and quantized by llama.cpp to Q8_0. The reference for each file is transformers on that file's
gguf-py-dequantized weights; llama.cpp's own Q8_0 run (activations rounded to Q8_0) is matched with
`llama_cpp_activations`. Exact mode over the prompt and the continuation, the engine path (a captured 32-token chunk,
then per-token steps), and greedy generation."""
import json, pathlib

import numpy as np
import pytest

from family import assert_matches_transformers, llama_cpp_rounded, rel

ROOT = pathlib.Path(__file__).parent / "fixtures" / "qwen3"
MAN = json.loads((ROOT / "manifest.json").read_text())
IDS = MAN["token_ids"]
QUANTS = ["F32", "Q8_0"]

@pytest.mark.parametrize("q", QUANTS)
def test_qwen3_matches_transformers(q):
  g = MAN["ggufs"][q]
  assert_matches_transformers(f"qwen3 {q} {g['tensor_types']}", ROOT, g, IDS)

@pytest.mark.parametrize("q", QUANTS[1:])
def test_qwen3_matches_llama_cpp_rounding(q):
  """With llama.cpp's activation rounding (Q8_0 rows into every matmul) the prompt logits are llama.cpp's to float
  summation noise, 100x closer than to transformers' unrounded ones, and the greedy continuation is its own (which
  differs from transformers' at its 6th token)."""
  g = MAN["ggufs"][q]
  (got, greedy), lcp, hf = llama_cpp_rounded(ROOT, g, IDS, MAN["n_gen"]), np.load(ROOT / g["llama_logits"]), np.load(ROOT / g["logits"])[:len(IDS)]
  print(f"\nqwen3 {q} with llama.cpp rounding: {rel(got, lcp):.1e} from llama.cpp; llama.cpp {rel(lcp, hf):.1e} from transformers")
  assert rel(got, lcp) <= 2e-5 and rel(lcp, hf) > 100 * rel(got, lcp)
  assert greedy == g["llama_greedy_ids"] and min(g["llama_greedy_top2_margin"]) > 1e-2
