"""gpt2 (learned positions, LayerNorm with bias, one q|k|v tensor, ungated gelu MLP, tied head) against transformers:
the tiny random GPT-2 of tests/fixtures/gpt2 (make_gpt2_fixtures.py), converted by llama.cpp's converter. F32: the
original model; Q8_0: transformers on that file's gguf-py-dequantized weights. Exact mode over the prompt and the
reference's continuation, the engine path (a captured 32-token chunk, then per-token steps), and `generate`."""
import functools, json, pathlib

import numpy as np
import pytest

from tg_ds4.gguf import GGUFError
from tg_ds4.runner import Runner

ROOT = pathlib.Path(__file__).parent / "fixtures" / "gpt2"
MAN = json.loads((ROOT / "manifest.json").read_text())
IDS = MAN["token_ids"]

def rel(a, b) -> float: return float(np.abs(a - b).max() / np.abs(b).max())

@functools.cache
def run(q: str) -> dict:
  g = MAN["ggufs"][q]
  seq, r = IDS + g["hf_greedy_ids"][:-1], Runner.load(ROOT / g["file"], max_ctx=64)
  K = r.chunked(len(IDS))
  assert r._plan(len(IDS), 12) == ([32], 8) and K == 32  # a chunk, then 8 prompt tokens through the per-token step
  return {"prefill": r.prefill(seq, chunk=len(seq)).numpy()[0], "engine": r.engine_logits(seq, prefill_tokens=K), "K": K,
          "greedy": list(r.generate(IDS, MAN["n_gen"]))}

@pytest.mark.parametrize("q", ["F32", "Q8_0"])
def test_gpt2_matches_transformers(q):
  g, r = MAN["ggufs"][q], run(q)
  ref = np.load(ROOT / g["logits"])
  tol = 2e-5 if q == "F32" else 5e-5
  print(f"\ngpt2 {q}: exact mode {rel(r['prefill'], ref):.1e}, engine rows {r['K'] - 1}.. {rel(r['engine'], ref[r['K'] - 1:]):.1e} "
        f"(llama.cpp's own run: {g['llama_vs_hf_prompt_rel']:.1e} from transformers)")
  assert rel(r["prefill"], ref) <= tol and rel(r["engine"], ref[r["K"] - 1:]) <= tol
  assert r["greedy"] == g["hf_greedy_ids"] and min(g["hf_greedy_top2_margin"]) > 1e-2

def test_gpt2_context_is_its_learned_positions():
  with pytest.raises(GGUFError, match=r"learned positions \(position_embd\) for 128 tokens, a context of 129 was asked for"):
    Runner.load(ROOT / "gpt2-F32.gguf", max_ctx=129)
