"""What the reference tests share: one engine run of a small family's fixture file (exact mode over the prompt and the
reference's continuation, the engine path, greedy generation) and its comparisons with transformers' logits and with
llama.cpp's own (activation-rounded) run; a model's dequantized twin; what counts as a clear greedy choice; a
multi-token-prediction block speculating in serve's slots."""
import functools, os, pathlib

import gguf
import numpy as np
from tinygrad import Tensor

from tg_ds4.models.transformer import Transformer
from tg_ds4.nn.layers import packed_weights
from tg_ds4.runtime.runner import Runner

def rel(a, b) -> float: return float(np.abs(a - b).max() / np.abs(b).max())

@functools.cache
def engine_run(path: pathlib.Path, prompt: tuple[int, ...], continuation: tuple[int, ...]) -> dict:
  """`path` over prompt + continuation[:-1] in exact mode (one forward) and through the engine (a captured 32-token
  chunk, then per-token steps), and generate's greedy continuation of the prompt (as long as `continuation`)."""
  seq, r = list(prompt) + list(continuation[:-1]), Runner.load(path, max_ctx=64, numerics="exact")
  K = r.chunked(len(prompt))
  assert r.prefill_plan(len(prompt), 12) == ([32], 8) and K == 32  # a chunk, then 8 prompt tokens through the per-token step
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
  r = Runner.load(root / g["file"], max_ctx=64, numerics="llama.cpp")
  return r.prefill(prompt, chunk=len(prompt)).numpy()[0], list(r.generate(prompt, n_gen))

def dequantized_twin(m: Transformer) -> Transformer:
  """Replace every packed weight of `m` by gguf-py's own dequantization of its bytes (plain float32 tensors)."""
  for owner, k, v in list(packed_weights(m)):
    raw = v.blocks.numpy().reshape(*v.shape[:-1], -1)
    val = Tensor(np.ascontiguousarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(v.qtype.id)), dtype=np.float32))
    if isinstance(owner, list): owner[k] = val
    else: setattr(owner, k, val)
  return m

def file_formats(path, max_ctx: int = 64) -> Transformer:
  """The model with the file's own packed formats (no CPU widening, `models/widen.py`), for gguf-py to dequantize."""
  old = os.environ.get("TG_DS4_WIDEN")
  os.environ["TG_DS4_WIDEN"] = "0"
  try: return Runner.load(path, max_ctx=max_ctx, numerics="exact")
  finally:
    if old is None: del os.environ["TG_DS4_WIDEN"]
    else: os.environ["TG_DS4_WIDEN"] = old

NEAR_TIE = 0.01


def log_softmax(logits: np.ndarray) -> np.ndarray:
  """float64 log-probabilities over the last axis."""
  x = logits.astype(np.float64) - logits.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))

def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
  """Per row, KL(softmax(p) || softmax(q)) over the whole vocabulary."""
  lp, lq = log_softmax(p_logits), log_softmax(q_logits)
  return (np.exp(lp) * (lp - lq)).sum(-1)

def topk_kl(p_ids: np.ndarray, p_logprobs: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
  """Per row, KL(P || Q) over the K+1 bins that P's top-K tokens and everything else make, from P's top-K ids and
  log-probabilities (normalized over the whole vocabulary) and Q's full logits: what a fixture that keeps only the
  top-K of a reference run can hold. It bounds the full KL from below (merging bins never raises it) and equals it as
  the tail's mass goes to zero; two runs are compared with it only against the same P."""
  q_lp = np.take_along_axis(log_softmax(q_logits), p_ids, -1)
  p_lp = p_logprobs.astype(np.float64)
  p_tail = np.clip(1 - np.exp(p_lp).sum(-1), 1e-300, None)
  q_tail = np.clip(1 - np.exp(q_lp).sum(-1), 1e-300, None)
  return (np.exp(p_lp) * (p_lp - q_lp)).sum(-1) + p_tail * (np.log(p_tail) - np.log(q_tail))

def assert_mtp_slots_answer_as_plain(r: Runner, prompts: list[list[int]], max_new: list[int], want: list[list[int]]) -> None:
  """serve's slots (runner `r` with two, loaded with a multi-token-prediction block): a greedy request alone drafts with
  the block in its own slot and answers `want` (plain decoding's tokens); two requests at once take the batched steps,
  whose rows keep the block's rows of both slots up to date for the one that speculates after the other ends. The
  server's warm-up captures the verify and draft steps."""
  from tg_ds4.runtime.batcher import Batcher, Request
  from tg_ds4.runtime.speculative import MTPDraft, warm_steps
  reqs, d = [Request(tuple(p), n) for p, n in zip(prompts, max_new)], MTPDraft(r)
  assert [name for name, _ in warm_steps(r, d, 3)] == ["verify-4", "mtp"]
  tokens = lambda steps: [[s.token for s in q] for q in steps]
  b = Batcher(r, drafter=d, speculative=3)
  assert [tokens(b.run([q]))[0] for q in reqs] == want
  drafted = b.drafted
  assert tokens(b.run(reqs)) == want and b.drafted > drafted
