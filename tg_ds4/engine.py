"""Generation: prefill the prompt in chunks, then a TinyJit-captured step per token that samples on the device, so the
only per-token host traffic is the 4-byte id being streamed out and back in (no logits leave the device).

The engine remembers which token ids its KV cache holds (`cached`), so a caller can prefill only past the longest common
prefix with the previous request (`reusable`), and can save/restore the cache rows of a prefix (`kv_rows`/`load_kv_rows`)."""
from __future__ import annotations

import os, time
from collections.abc import Iterator
from dataclasses import dataclass, field
from math import prod

import numpy as np
from tinygrad import Tensor, UOp, dtypes
from tinygrad.device import Buffer
from tinygrad.dtype import _to_np_dtype

from tg_ds4.model import Transformer
from tg_ds4.sampling import SamplingParams, greedy, sample
from tg_ds4.replay import Jit

MAX_TOP_LOGPROBS = 20
TOP_LOGPROBS_BUCKETS = (0, 5, MAX_TOP_LOGPROBS)  # k is rounded up to one of these and the extra entries dropped on the host

@dataclass
class Stats:
  prompt_tokens: int = 0
  generated: int = 0
  prefill_s: float = 0.0
  decode_s: float = 0.0
  first_token_s: float = 0.0
  @property
  def prefill_tps(self) -> float: return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0
  @property
  def decode_tps(self) -> float: return max(self.generated - 1, 0) / self.decode_s if self.decode_s else 0.0

@dataclass(frozen=True)
class Step:
  """One generated token; with logprobs asked for, its log-probability under the model (before sampling filters and
  temperature) and the `k` most likely tokens as (id, logprob), best first."""
  token: int
  logprob: float | None = None
  top: tuple[tuple[int, float], ...] = ()

def _with_logprobs(logits: Tensor, tok: Tensor, k: int) -> Tensor:
  """`[1, V]` logits and the chosen `[1, 1]` id -> one `[1, 2 + 2k]` float row (id, logprob, k top ids, k top logprobs):
  a single small copy to the host per token. Top-k by k masked argmaxes (k <= 20), not a vocabulary sort."""
  lp = logits.float().log_softmax(-1)
  cols, ids, vals, ar = [tok.float(), lp.gather(-1, tok)], [], [], Tensor.arange(lp.shape[-1]).reshape(1, -1)
  x = lp
  for _ in range(k):
    i = x.argmax(-1, keepdim=True)
    ids.append(i.float()); vals.append(x.max(-1, keepdim=True))
    x = (ar == i).where(float("-inf"), x)
  return Tensor.cat(*cols, *ids, *vals, dim=-1)  # float32 holds ids exactly below 2^24

def _buffer(t: Tensor) -> Buffer:
  buf = t.uop.base.buffer
  if not isinstance(buf, Buffer) or not buf.is_allocated(): raise ValueError("cache tensors must be realized single-device buffers")
  return buf

def _prefix_view(t: Tensor, axis: int, n: int) -> Buffer | None:
  """Rows [0:n] as a view of the buffer when they are its first bytes (every axis before the row axis has size 1)."""
  if any(d != 1 for d in t.shape[:axis]): return None
  (view := _buffer(t).view(n * prod(t.shape[axis + 1:]), t.dtype, 0)).ensure_allocated()
  return view

def _row_to_step(row: np.ndarray, k: int, want: int) -> Step:
  return Step(int(row[0]), float(row[1]), tuple((int(row[2 + j]), float(row[2 + k + j])) for j in range(want)))

@dataclass
class Engine:
  model: Transformer
  stats: Stats = field(default_factory=Stats)
  cached: list[int] = field(default_factory=list)  # token ids whose K/V rows [0:len] in the cache are valid

  def __post_init__(self):
    m = self.model
    self._pos = lambda p: UOp.variable("start_pos", 0, m.max_ctx - 1).bind(p)
    self._tok = lambda t: UOp.variable("token", 0, m.cfg.n_vocab - 1).bind(t)  # a variable: the embedding reads one row
    steps = getattr(m, "steps", None)
    self._greedy_step = Jit(lambda tok, sp: greedy(m.forward(tok, sp, last_only=True)[:, -1]).realize(), steps, "greedy")
    self._sample_step = Jit(lambda tok, sp, t, k, p, mp, rng: sample(m.forward(tok, sp, last_only=True)[:, -1], t, k, p, mp, rng).realize(),
                            steps, "sample")
    self._lp_steps: dict[tuple[bool, int], Jit] = {}  # (greedy, k) -> step that also returns logprobs; built on first use
    self._heads: dict[tuple[bool, int | None], Jit] = {}

  def _lp_step(self, is_greedy: bool, k: int) -> Jit:
    if (key := (is_greedy, k)) not in self._lp_steps:
      m = self.model
      def step(tok, sp, *sargs):
        logits = m.forward(tok, sp, last_only=True)[:, -1]
        return _with_logprobs(logits, greedy(logits) if is_greedy else sample(logits, *sargs), k).realize()
      self._lp_steps[key] = Jit(step, getattr(m, "steps", None), f"logprobs-{'greedy' if is_greedy else 'sample'}-{k}")
    return self._lp_steps[key]

  def _head(self, is_greedy: bool, k: int | None) -> Jit:
    """The first token from the prefill's `[1, 1, vocab]` logits, as a captured step like the others (so a warm start
    lowers nothing): greedy or sampled, with k logprobs or none."""
    if (key := (is_greedy, k)) not in self._heads:
      def head(out, *sargs):
        logits = out[:, -1]
        tok = greedy(logits) if is_greedy else sample(logits, *sargs)
        return (tok if k is None else _with_logprobs(logits, tok, k)).realize()
      self._heads[key] = Jit(head, getattr(self.model, "steps", None), f"head-{'greedy' if is_greedy else 'sample'}-{'ids' if k is None else k}")
    return self._heads[key]

  def reusable(self, prompt: list[int]) -> int:
    """How many leading tokens of `prompt` the cache already holds, at most len(prompt) - 1: the last prompt token is
    always run again, since its logits give the first new token."""
    n = 0
    for a, b in zip(prompt, self.cached):
      if a != b: break
      n += 1
    n = min(n, max(len(prompt) - 1, 0))
    # ring caches (DeepSeek V4) keep only the last rows: restarting further back than `max_rewind` from the furthest row
    # written (a padded prefill chunk may write PREFILL_CHUNK rows past the cached tokens) means prefilling from scratch
    if (rewind := getattr(self.model, "max_rewind", None)) is not None and len(self.cached) + self.model.PREFILL_CHUNK - n > rewind: return 0
    return n

  def generate(self, prompt: list[int], max_new: int, params: SamplingParams = SamplingParams(), stop: set[int] = frozenset(),
               start_pos: int = 0) -> Iterator[int]:
    """Yield up to `max_new` token ids after `prompt` (whose first `start_pos` tokens are already in the cache)."""
    for s in self.steps(prompt, max_new, params, stop, start_pos): yield s.token

  def steps(self, prompt: list[int], max_new: int, params: SamplingParams = SamplingParams(), stop: set[int] = frozenset(),
            start_pos: int = 0, logprobs: int | None = None) -> Iterator[Step]:
    """`generate` yielding Steps; `logprobs` = k (0..20) adds each token's logprob and the k most likely alternatives,
    computed inside the captured step. A caller that stops resuming the iterator cancels the rest (nothing runs ahead)."""
    m, n = self.model, len(prompt)
    if n == 0: raise ValueError("empty prompt")
    if n + max_new > m.max_ctx: max_new = m.max_ctx - n
    if max_new <= 0: raise ValueError(f"prompt of {n} tokens leaves no room in the context of {m.max_ctx}")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS: raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = lambda step: Tensor([seed & 0xFFFFFFFF, step], dtype=dtypes.uint32)
    sp = params.tensors()
    self.stats = st = Stats(prompt_tokens=n - start_pos)
    self.cached = list(prompt[:start_pos])  # rows past start_pos are about to be overwritten
    t0 = time.perf_counter()
    k = next(b for b in TOP_LOGPROBS_BUCKETS if b >= logprobs) if logprobs is not None else 0  # few distinct k: few captured steps
    out = m.prefill_last(prompt[start_pos:], start_pos=start_pos)
    tok = self._head(params.greedy, k if logprobs is not None else None)(out, *(() if params.greedy else (*sp, rng(0))))
    self.cached = list(prompt)
    st.prefill_s = st.first_token_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    for i in range(max_new):
      s = Step(int(tok.item())) if logprobs is None else _row_to_step(tok.numpy()[0], k, logprobs)
      st.generated, st.decode_s = st.generated + 1, time.perf_counter() - t1  # kept current: the caller may stop early
      yield s
      if s.token in stop or i == max_new - 1: break
      nxt, pos = self._tok(s.token), self._pos(n + i)
      if logprobs is not None: tok = self._lp_step(params.greedy, k)(nxt, pos, *(() if params.greedy else (*sp, rng(i + 1))))
      else: tok = self._greedy_step(nxt, pos) if params.greedy else self._sample_step(nxt, pos, *sp, rng(i + 1))
      self.cached.append(s.token)  # its K/V row is written by the step that just ran

  # *** KV rows of a prefix, for a persistent cache ***
  # Byte copies on the cache buffers themselves (the tensors are allocated once and written in place by the captured
  # steps): no kernel is compiled per prefix length, and the captured steps keep pointing at the same memory.

  def kv_rows(self, n: int) -> list[tuple[str, np.ndarray]]:
    """Host copies of rows [0:n] of every cache tensor (only meaningful for n <= len(self.cached))."""
    out = []
    for name, t, axis in self.model.cache_tensors():
      if (view := _prefix_view(t, axis, n)) is not None: a = view.numpy().reshape(*t.shape[:axis], n, *t.shape[axis + 1:])
      else: a = _buffer(t).numpy().reshape(t.shape)[(slice(None),) * axis + (slice(0, n),)]
      out.append((name, np.array(a)))
    return out

  def load_kv_rows(self, tokens: list[int], rows: dict[str, np.ndarray]) -> None:
    """Write saved rows [0:len(tokens)] back into the cache tensors."""
    n, self.cached = len(tokens), []
    for name, t, axis in self.model.cache_tensors():
      a = rows[name]
      if a.shape[axis] < n or a.shape[:axis] + a.shape[axis + 1:] != t.shape[:axis] + t.shape[axis + 1:]:
        raise ValueError(f"{name}: saved rows {a.shape} do not fit {t.shape} up to row {n}")
      a = np.ascontiguousarray(a[(slice(None),) * axis + (slice(0, n),)], dtype=_to_np_dtype(t.dtype))
      if (view := _prefix_view(t, axis, n)) is None:  # rows are not one contiguous prefix: rewrite the whole buffer
        whole = _buffer(t).numpy().reshape(t.shape).copy()
        whole[(slice(None),) * axis + (slice(0, n),)] = a
        view, a = _buffer(t), whole
      view.copy_from(Buffer("PYTHON", a.size, t.dtype, opaque=memoryview(a.reshape(-1)).cast("B")))
    self.cached = list(tokens)

  def cache_layout(self) -> list[tuple[str, tuple[int, ...], str, int]]:
    """(name, shape, dtype, row axis) of every cache tensor: part of a saved cache's identity."""
    return [(name, tuple(t.shape), t.dtype.name, axis) for name, t, axis in self.model.cache_tensors()]
