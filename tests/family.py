"""What the small families' reference tests (gpt2, bitnet, qwen3, gemma4) share: one engine run of a fixture file
(exact mode over the prompt and the reference's continuation, the engine path, greedy generation) and the comparisons
of that run with transformers' logits and with llama.cpp's own (activation-rounded) run."""
import functools, pathlib

import numpy as np

from tg_ds4.runner import Runner

def rel(a, b) -> float: return float(np.abs(a - b).max() / np.abs(b).max())

@functools.cache
def engine_run(path: pathlib.Path, prompt: tuple[int, ...], continuation: tuple[int, ...]) -> dict:
  """`path` over prompt + continuation[:-1] in exact mode (one forward) and through the engine (a captured 32-token
  chunk, then per-token steps), and generate's greedy continuation of the prompt (as long as `continuation`)."""
  seq, r = list(prompt) + list(continuation[:-1]), Runner.load(path, max_ctx=64)
  K = r.chunked(len(prompt))
  assert r._plan(len(prompt), 12) == ([32], 8) and K == 32  # a chunk, then 8 prompt tokens through the per-token step
  return {"prefill": r.prefill(seq, chunk=len(seq)).numpy()[0], "engine": r.engine_logits(seq, prefill_tokens=K), "K": K,
          "greedy": list(r.generate(list(prompt), len(continuation)))}

def assert_matches_transformers(label: str, root: pathlib.Path, g: dict, prompt: list[int], tol: float = 2e-5) -> None:
  """The fixture entry `g` (file, logits, hf_greedy_ids, ...) run by the engine is within `tol` of max|logit| of
  transformers' logits in both modes, and its greedy continuation is transformers' (whose margins are clear)."""
  r, ref = engine_run(root / g["file"], tuple(prompt), tuple(g["hf_greedy_ids"])), np.load(root / g["logits"])
  note = f"; transformers float32: {g['hf_float32_vs_float64_rel']:.1e}" if "hf_float32_vs_float64_rel" in g else ""
  print(f"\n{label}: exact mode {rel(r['prefill'], ref):.1e}, engine rows {r['K'] - 1}.. {rel(r['engine'], ref[r['K'] - 1:]):.1e} "
        f"(llama.cpp's own run: {g['llama_vs_hf_prompt_rel']:.1e} from transformers{note})")
  assert rel(r["prefill"], ref) <= tol and rel(r["engine"], ref[r["K"] - 1:]) <= tol
  assert r["greedy"] == g["hf_greedy_ids"] and min(g["hf_greedy_top2_margin"]) > 1e-2

def llama_cpp_rounded(root: pathlib.Path, g: dict, prompt: list[int], n_gen: int) -> tuple[np.ndarray, list[int]]:
  """The engine with llama.cpp's activation rounding on the fixture entry `g`: (prompt logits, greedy continuation)."""
  r = Runner.load(root / g["file"], max_ctx=64, llama_cpp_activations=True)
  return r.prefill(prompt, chunk=len(prompt)).numpy()[0], list(r.generate(prompt, n_gen))
