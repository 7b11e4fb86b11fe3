"""Continuous batching: several requests generated together through the runner's batched steps (nn/cache_rows.py).

Each admitted request owns a cache slot until it ends. `Batcher.step()` runs one engine step: at most one prefill chunk
of one request (so a long prompt delays the others by at most a chunk per step), then one batched step over every
request that has a token to feed: a prompt tail token (the tail a single request would feed per token, runtime/runner.py's FEED_TOKENS)
or its last generated token. Prompt tails go first: while a request feeds its tail, the batched step runs the tails only
and the generating requests wait (at most FEED_TOKENS one-row steps, less than a chunk), as vLLM's scheduler puts
prefills before decodes. A short request thus gets its first token about as soon as on an idle engine, where fed
beside the generations each of its tail tokens would wait for a step of all rows. Requests join and leave between steps.

A request's answer equals the same request run alone (runtime/runner.py's Runner.steps): the same prefill plan and chunk steps, the
same per-row sampling inputs (its seed and step counter: runtime/sampling.py's uniform hashes a row's own (seed, step)), so greedy
and seeded answers agree token for token and logprobs to float rounding.

With a drafter (runtime/speculative.py), a greedy request without logprobs that is the only one with a token to feed
decodes speculatively: the drafter proposes k tokens, one verify step in its slot checks them. Its tokens are the ones
the batched steps give (greedy: token for token), so a request's answer does not depend on whether it ran alone; as soon
as another request has a token to feed, the batched steps take over again."""
from __future__ import annotations

import os, time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tg_ds4.backend.buffers import host_array
from tg_ds4.runtime.runner import FEED_TOKENS, GREEDY, MAX_TOP_LOGPROBS, Runner, Step, TOP_LOGPROBS_BUCKETS
from tg_ds4.runtime.sampling import SamplingParams, rng
from tg_ds4.runtime.speculative import Drafter, verify_greedy


@dataclass(frozen=True)
class Request:
  prompt: tuple[int, ...]
  max_new: int
  params: SamplingParams = GREEDY
  stop: frozenset[int] = frozenset()
  logprobs: int | None = None  # k: each token's logprob and the k most likely alternatives (0..20)

@dataclass
class Timing:
  submitted: float
  first: float | None = None  # the first token's time
  last: float | None = None
  generated: int = 0

@dataclass
class _Seq:
  rid: int
  req: Request
  slot: int
  seed: int
  chunks: list[int]          # prefill chunk sizes still to run
  at: int                    # the next prompt position a chunk starts at
  fed_from: int              # prompt positions from here on go through the batched step
  token: int | None = None   # what the next batched step feeds, at `pos`
  pos: int = 0
  timing: Timing = field(default_factory=lambda: Timing(time.perf_counter()))

@dataclass(frozen=True)
class Event:
  rid: int
  step: Step | None     # a generated token; None on admission, or when the request ended without one (cancelled)
  finished: bool
  slot: int = -1        # the request's cache slot (-1: it never had one)
  cached: int | None = None  # on admission: the prompt tokens whose cache rows it reuses

Restore = Callable[[tuple[int, ...], int, int], int]

class Batcher:
  """`restore(prompt, slot, start)`, if given, is asked on each admission whether it can put a longer prefix of the prompt
  into the slot's cache than the `start` tokens it holds (a saved prefix on disk); it returns how many it holds then.
  `drafter` and `speculative` = k: speculative decoding for a greedy request running alone (module docstring)."""
  def __init__(self, runner: Runner, restore: Restore | None = None, drafter: Drafter | None = None, speculative: int = 0):
    if runner.parallel < 2: raise ValueError("a Batcher needs a runner loaded with parallel > 1")
    self.runner, self.slots, self.restore = runner, runner.parallel, restore
    self.drafter, self.speculative = drafter, speculative if drafter is not None else 0
    self.drafted = self.accepted = 0
    self.slot_tokens: list[list[int]] = [[] for _ in range(self.slots)]  # per slot: token ids whose cache rows are valid
    self.queue: deque[tuple[int, Request, float]] = deque()
    self.running: dict[int, _Seq] = {}   # admission order
    self.timings: dict[int, Timing] = {}
    self._cancelled: set[int] = set()
    self._next = 0

  def submit(self, req: Request) -> int:
    """Queue a request; its id. Raises ValueError for a request that can never run."""
    n, m = len(req.prompt), self.runner.model
    if n == 0: raise ValueError("empty prompt")
    if n >= m.max_ctx: raise ValueError(f"prompt of {n} tokens leaves no room in the context of {m.max_ctx}")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS: raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
    if req.max_new <= 0: raise ValueError("max_new must be at least 1")
    rid, self._next = self._next, self._next + 1
    self.queue.append((rid, req, time.perf_counter()))
    return rid

  def cancel(self, rid: int) -> None:
    """End a request at the next step (its slot is freed then)."""
    self._cancelled.add(rid)

  @property
  def busy(self) -> bool: return bool(self.queue or self.running)

  def run(self, reqs: list[Request]) -> list[list[Step]]:
    """Every request to its end; the steps of each, in order."""
    ids = [self.submit(r) for r in reqs]
    out: dict[int, list[Step]] = {i: [] for i in ids}
    while self.busy:
      for e in self.step():
        if e.step is not None: out[e.rid].append(e.step)
    return [out[i] for i in ids]

  # *** one engine step

  def step(self) -> list[Event]:
    """One engine step; its events in order: requests that ended cancelled, requests admitted onto slots, tokens."""
    events = self._drop_cancelled()
    events += self._admit()
    if (pre := next((s for s in self.running.values() if s.chunks), None)) is not None: events += self._chunk(pre)
    rows = [s for s in self.running.values() if not s.chunks]
    rows = [s for s in rows if s.pos < len(s.req.prompt)] or rows  # prompt tails first (module docstring)
    if len(rows) == 1 and pre is None and self._speculates(rows[0]): events += self._speculate(rows[0])
    elif rows: events += self._decode(rows)
    return events

  def _drop_cancelled(self) -> list[Event]:
    events = []
    for rid in self._cancelled:
      if (s := self.running.pop(rid, None)) is not None: events.append(Event(rid, None, True, s.slot))
      elif any(q[0] == rid for q in self.queue):
        self.queue = deque(q for q in self.queue if q[0] != rid)
        events.append(Event(rid, None, True))
    self._cancelled.clear()
    return events

  def _free_slots(self) -> list[int]:
    used = {s.slot for s in self.running.values()}
    return [i for i in range(self.slots) if i not in used]

  def _admit(self) -> list[Event]:
    """Queued requests onto free slots, first come first served; each takes the free slot whose cache shares the
    longest prefix with its prompt that the model can resume from (runtime/runner.py's Runner.reusable; the lowest
    slot on a tie) and prefills only past that prefix."""
    events = []
    while self.queue and (free := self._free_slots()):
      rid, req, t = self.queue.popleft()
      common = [self.runner.reusable(list(req.prompt), self.slot_tokens[i]) for i in free]
      slot = free[int(np.argmax(common))]
      n, start = len(req.prompt), max(common)
      if self.restore is not None:
        self.slot_tokens[slot] = self.slot_tokens[slot][:start]  # what the restore may overwrite is no longer known
        start = self.restore(req.prompt, slot, start)
      sizes, fed = self.runner.prefill_plan(n - start, FEED_TOKENS)
      self.slot_tokens[slot] = list(req.prompt[:start])
      seed = req.params.seed if req.params.seed is not None else int.from_bytes(os.urandom(4), "little")
      s = _Seq(rid, req, slot, seed & 0xFFFFFFFF, list(sizes), start, n - fed, timing=Timing(t))
      if not sizes: s.token, s.pos = req.prompt[start], start
      self.running[rid] = s
      self.timings[rid] = s.timing
      events.append(Event(rid, None, False, slot, start))
    return events

  def _k(self, reqs: list[Request]) -> int | None:
    want = [r.logprobs for r in reqs if r.logprobs is not None]
    return next(b for b in TOP_LOGPROBS_BUCKETS if b >= max(want)) if want else None

  def _chunk(self, s: _Seq) -> list[Event]:
    """One prefill chunk of `s`; after its last chunk, with no tail to feed, its first token from the chunk's logits."""
    C, r, n = s.chunks.pop(0), self.runner, len(s.req.prompt)
    part = list(s.req.prompt[s.at:min(s.at + C, s.fed_from)])
    out = r.prefill_chunks(part, s.at, [C], s.slot)
    self.slot_tokens[s.slot] = list(s.req.prompt[:s.at + len(part)])
    s.at += len(part)
    if s.chunks: return []
    if s.fed_from < n:  # the tail goes through the batched steps
      s.token, s.pos = s.req.prompt[s.fed_from], s.fed_from
      return []
    p, k = s.req.params, self._k([s.req])
    sampling = () if p.greedy else (*p.tensors(), rng(s.seed, 0))
    tok = r.head(out, "greedy" if p.greedy else "sample", k)(out, *sampling)
    return self._emitted(s, host_array(tok)[0], k)

  def _decode(self, rows: list[_Seq]) -> list[Event]:
    n_of = lambda s: len(s.req.prompt)
    k = self._k([s.req for s in rows])
    sampling = None
    if not all(s.req.params.greedy for s in rows):
      ps = [s.req.params for s in rows]
      sampling = (np.array([p.greedy for p in ps]), np.array([p.temperature for p in ps], np.float32), np.array([p.top_k for p in ps]),
                  np.array([p.top_p for p in ps], np.float32), np.array([p.min_p for p in ps], np.float32),
                  np.array([[s.seed, max(s.pos - n_of(s) + 1, 0)] for s in rows], np.uint32))
    out = self.runner.batch_step([s.token for s in rows], [s.slot for s in rows], [s.pos for s in rows], sampling, k)
    events = []
    for s, row in zip(rows, out):
      self.slot_tokens[s.slot].append(s.token)
      if s.pos < n_of(s) - 1:  # a prompt tail token: its output is not a new token
        s.pos += 1
        s.token = s.req.prompt[s.pos]
        continue
      s.pos += 1
      events += self._emitted(s, np.atleast_1d(row), k)
    return events

  def _speculates(self, s: _Seq) -> bool:
    """Whether `s` takes a speculative round now: a greedy request without logprobs, past its prompt, with room for the
    k + 1 verify rows in the context."""
    k, r = self.speculative, s.req
    return k > 0 and r.params.greedy and r.logprobs is None and s.pos >= len(r.prompt) and s.pos + k + 1 <= self.runner.model.max_ctx

  def _speculate(self, s: _Seq) -> list[Event]:
    """One speculative round of `s`: k drafts, one verify step in its slot, the accepted drafts and the target's next token."""
    k, held = self.speculative, self.slot_tokens[s.slot]
    seq = held + [s.token]
    drafts, _ = self.drafter.propose(seq, k, (), None, s.slot)
    new = verify_greedy(self.runner, s.token, drafts, s.pos, s.slot)
    self.slot_tokens[s.slot] = seq + new[:-1]  # rows of the pending token and the accepted drafts
    self.drafted, self.accepted = self.drafted + k, self.accepted + len(new) - 1
    events = []
    for t in new:
      events += self._emitted(s, np.array([t]), None)
      if events[-1].finished: break
    return events

  def _emitted(self, s: _Seq, row: np.ndarray, k: int | None) -> list[Event]:
    """`s` produced a token (`row`: its id, or its _with_logprobs row): the event, and the request's end if it was."""
    st = Step(int(row[0])) if s.req.logprobs is None else Step.from_row(row, k, s.req.logprobs)
    t, n = s.timing, len(s.req.prompt)
    t.last, t.generated = time.perf_counter(), t.generated + 1
    if t.first is None: t.first = t.last
    max_new = min(s.req.max_new, self.runner.model.max_ctx - n)
    done = st.token in s.req.stop or t.generated >= max_new
    if done: del self.running[s.rid]
    else: s.token, s.pos = st.token, n + t.generated - 1
    return [Event(s.rid, st, done, s.slot)]
