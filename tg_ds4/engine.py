"""Generation: prefill the prompt in chunks, then a TinyJit-captured step per token that samples on the device, so the
only per-token host traffic is the 4-byte id being streamed out and back in (no logits leave the device)."""
from __future__ import annotations

import os, time
from collections.abc import Iterator
from dataclasses import dataclass, field

from tinygrad import Tensor, TinyJit, UOp, dtypes

from tg_ds4.model import Transformer
from tg_ds4.sampling import SamplingParams, greedy, sample

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

@dataclass
class Engine:
  model: Transformer
  stats: Stats = field(default_factory=Stats)

  def __post_init__(self):
    m = self.model
    self._pos = lambda p: UOp.variable("start_pos", 0, m.max_ctx - 1).bind(p)
    self._tok = lambda t: UOp.variable("token", 0, m.cfg.n_vocab - 1).bind(t)  # a variable: the embedding reads one row
    self._greedy_step = TinyJit(lambda tok, sp: greedy(m.forward(tok, sp, last_only=True)[:, -1]).realize())
    self._sample_step = TinyJit(lambda tok, sp, t, k, p, mp, rng: sample(m.forward(tok, sp, last_only=True)[:, -1], t, k, p, mp, rng).realize())

  def generate(self, prompt: list[int], max_new: int, params: SamplingParams = SamplingParams(), stop: set[int] = frozenset(),
               start_pos: int = 0) -> Iterator[int]:
    """Yield up to `max_new` token ids after `prompt` (whose first `start_pos` tokens are already in the cache)."""
    m, n = self.model, len(prompt)
    if n == 0: raise ValueError("empty prompt")
    if n + max_new > m.max_ctx: max_new = m.max_ctx - n
    if max_new <= 0: raise ValueError(f"prompt of {n} tokens leaves no room in the context of {m.max_ctx}")
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = lambda step: Tensor([seed & 0xFFFFFFFF, step], dtype=dtypes.uint32)
    sp = params.tensors()
    self.stats = st = Stats(prompt_tokens=n - start_pos)
    t0 = time.perf_counter()
    logits = m.prefill_last(prompt[start_pos:], start_pos=start_pos)[:, -1]
    tok = (greedy(logits) if params.greedy else sample(logits, *sp, rng(0))).realize()
    st.prefill_s = st.first_token_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    for i in range(max_new):
      tid = int(tok.item())
      st.generated, st.decode_s = st.generated + 1, time.perf_counter() - t1  # kept current: the caller may stop early
      yield tid
      if tid in stop or i == max_new - 1: break
      nxt, pos = self._tok(tid), self._pos(n + i)
      tok = self._greedy_step(nxt, pos) if params.greedy else self._sample_step(nxt, pos, *sp, rng(i + 1))
