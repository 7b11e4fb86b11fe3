"""The single inference thread: every tinygrad call happens here (tinygrad is not thread-safe). Requests wait in a
bounded FIFO queue; results go back to the event loop as events on the job's asyncio queue.

One sequence at a time (a runner loaded with parallel=1): per job, reuse the longest common prefix with what the KV cache
holds (or, when longer, with a saved prefix on disk), prefill the rest, then stream tokens, checking the job's cancel
flag before every further token, so a client that went away costs at most the token in flight.

Slots (parallel=N > 1): jobs move from the queue, first come first served, onto free cache slots of a runtime/batcher.py Batcher,
which steps them together: each engine step runs at most one prefill chunk and one batched decode step over every
running job. A job takes the free slot whose cache shares the longest prefix with its prompt, or a saved prefix from
disk when that is longer; a cancelled job leaves its slot at the next step (at most one more token computed).

Either way, long prompts' KV rows are saved for later (after the answer, off the hot path)."""
from __future__ import annotations

import asyncio, itertools, logging, queue, threading, time
from collections.abc import Callable
from dataclasses import dataclass, field

from tg_ds4.runtime.batcher import Batcher, Request
from tg_ds4.runtime.runner import Runner, Step
from tg_ds4.runtime.sampling import SamplingParams
from tg_ds4.runtime.speculative import Drafter, speculate, warm_steps
from tg_ds4.server.kvstore import KVStore

log = logging.getLogger("tg_ds4.server")
_ids = itertools.count(1)
MIN_DISK_GAIN = 16  # load a saved prefix only when it saves at least this many tokens of prefill over what is in memory

@dataclass
class Started:
  cached_tokens: int   # prompt tokens whose KV rows were reused (memory or disk)

@dataclass
class Done:
  reason: str          # "stop" (a stop token), "length", "cancelled"

@dataclass
class Failed:
  message: str

@dataclass
class Job:
  prompt: list[int]
  max_tokens: int
  params: SamplingParams
  stop_ids: frozenset[int]
  logprobs: int | None = None
  loop: asyncio.AbstractEventLoop | None = None
  events: asyncio.Queue = field(default_factory=asyncio.Queue)
  id: int = field(default_factory=lambda: next(_ids))
  generated: int = 0                 # tokens produced so far (written by the worker)
  cancel_at: int | None = None       # `generated` when the cancel arrived
  _cancelled: threading.Event = field(default_factory=threading.Event)

  def cancel(self):
    if not self._cancelled.is_set(): self.cancel_at = self.generated; self._cancelled.set()

  @property
  def cancelled(self) -> bool: return self._cancelled.is_set()

  def emit(self, ev):
    try: self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
    except RuntimeError: pass  # the event loop is gone (shutdown): nobody is listening

class QueueFull(Exception): pass

class Worker:
  """`load` builds the runner (and the KV store, if any) on the worker's own thread: tinygrad keeps per-thread state
  (its compile cache's SQLite connection), so the model is never touched from any other thread."""
  def __init__(self, load: Callable[[], tuple[Runner, KVStore | None]], max_queue: int = 64, warmup: bool = False,
               draft: Callable[[Runner], Drafter] | None = None, speculative: int = 0):
    self.load, self.warmup, self.runner, self.kvstore, self.load_error = load, warmup, None, None, None
    # speculative decoding (runtime/speculative.py) for greedy requests without logprobs: the drafter, loaded with the model
    self.load_draft, self.speculative, self.drafter = draft, speculative, None
    self.drafts = {"drafted": 0, "accepted": 0}  # one sequence at a time: summed over its speculative jobs
    self.warming: str | None = None  # while the warm-up runs: "i/n step" of the steps captured so far
    self.queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
    self.loaded, self.ready, self.current = threading.Event(), threading.Event(), None
    self.batcher: Batcher | None = None  # with slots
    self.jobs: dict[int, tuple[Job, float]] = {}  # with slots: the batcher's requests (and when each left the queue)
    self.peak_running = 0  # the most requests running together so far
    self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "tokens": 0}
    self.last_cancel: dict | None = None
    self.job_seconds = 1.0  # running mean, for Retry-After
    self.thread = threading.Thread(target=self._run, name="inference", daemon=True)

  def start(self) -> Worker:
    self.thread.start()
    return self

  def wait_loaded(self) -> Worker:
    """Block until the model is loaded; re-raise what went wrong if it could not be."""
    self.loaded.wait()
    if self.load_error is not None: raise self.load_error
    return self

  def submit(self, job: Job) -> None:
    try: self.queue.put_nowait(job)
    except queue.Full: raise QueueFull() from None

  @property
  def slots(self) -> int: return getattr(self.runner, "parallel", 1) if self.runner is not None else 1

  def retry_after(self) -> int: return max(1, min(60, round(self.job_seconds * max(self.queue.qsize(), 1) / self.slots)))

  def status(self) -> dict:
    b = self.batcher
    cached = [len(t) for t in b.slot_tokens] if b is not None else [len(self.runner.cached)] if self.runner else [0]
    return {"ready": self.ready.is_set(), **({"warming_up": self.warming} if self.warming else {}),
            "queued": self.queue.qsize(), "busy": bool(self.jobs) or self.current is not None,
            "running": len(self.jobs) if b is not None else int(self.current is not None), "slots": self.slots,
            "peak_running": self.peak_running, **self.counts,
            "last_cancel": self.last_cancel, "cached_tokens": max(cached), "kv_store": self.kvstore.stats() if self.kvstore else None,
            **({"speculative": {"k": self.speculative, **(self.drafts if b is None else {"drafted": b.drafted, "accepted": b.accepted})}}
               if self.drafter is not None else {})}

  def _run(self):
    try:
      self.runner, self.kvstore = self.load()
      if self.load_draft is not None: self.drafter = self.load_draft(self.runner)
    except Exception as e: self.load_error = e; return
    finally: self.loaded.set()
    if self.warmup:  # every step a request can take, captured (or loaded) before the first request: none waits on a compile
      t = time.perf_counter()
      extra = warm_steps(self.runner, self.drafter, self.speculative) if self.drafter is not None else []
      try: self.runner.warm_up(self._warmed, extra)
      except Exception: log.exception("warm-up failed")
      log.info("warm-up done in %.1fs", time.perf_counter() - t)
    self.warming = None
    self.ready.set()
    if self.slots > 1: return self._run_slots()
    while True:
      job = self.queue.get()
      if job.cancelled: self._cancelled_queued(job); continue
      self.current, t, self.peak_running = job, time.perf_counter(), max(self.peak_running, 1)
      try: self._generate(job)
      except Exception as e:  # a failing request must not take the worker down
        log.exception("job %d failed", job.id)
        self.counts["failed"] += 1
        job.emit(Failed(f"{type(e).__name__}: {e}"))
      finally:
        self.current = None
        self.job_seconds = 0.8 * self.job_seconds + 0.2 * (time.perf_counter() - t)

  def _warmed(self, i: int, n: int, name: str, seconds: float):
    self.warming = f"{i}/{n} {name}"
    log.info("warm-up %d/%d: %s in %.1fs", i, n, name, seconds)

  def _cancelled_queued(self, job: Job):  # left while queued: costs nothing
    self.counts["cancelled"] += 1
    self.last_cancel = {"job": job.id, "generated": 0, "tokens_after_cancel": 0}
    job.emit(Done("cancelled"))

  def _ended(self, job: Job, reason: str):
    self.counts["tokens"] += job.generated
    if reason == "cancelled":
      self.counts["cancelled"] += 1
      self.last_cancel = {"job": job.id, "generated": job.generated, "tokens_after_cancel": job.generated - (job.cancel_at or 0)}
    else: self.counts["completed"] += 1
    job.emit(Done(reason))

  def _run_slots(self):
    """The loop with slots: fill free slots from the queue, pass cancels on, one engine step, hand out its events."""
    self.batcher = b = Batcher(self.runner, self._restore if self.kvstore is not None else None, self.drafter, self.speculative)
    while True:
      while len(b.running) + len(b.queue) < b.slots:
        try: job = self.queue.get(block=not b.busy)  # nothing running: wait for work
        except queue.Empty: break
        if job.cancelled: self._cancelled_queued(job); continue
        try: rid = b.submit(Request(tuple(job.prompt), job.max_tokens, job.params, frozenset(job.stop_ids), job.logprobs))
        except ValueError as e:
          self.counts["failed"] += 1; job.emit(Failed(str(e))); continue
        self.jobs[rid] = (job, time.perf_counter())
        self.peak_running = max(self.peak_running, len(self.jobs))
      for rid, (job, _) in self.jobs.items():
        if job.cancelled: b.cancel(rid)
      try: events = b.step()
      except Exception as e:  # a failing step must not take the worker down; the requests in it fail
        log.exception("engine step failed")
        for job, _ in self.jobs.values():
          self.counts["failed"] += 1
          job.emit(Failed(f"{type(e).__name__}: {e}"))
        self.jobs.clear()
        self.batcher = b = Batcher(self.runner, b.restore, self.drafter, self.speculative)  # the slots' caches are in an unknown state: reuse nothing
        continue
      for e in events: self._event(b, e)

  def _event(self, b: Batcher, e):
    job, started = self.jobs[e.rid]
    if e.cached is not None: job.emit(Started(e.cached)); return
    if e.step is not None:
      job.generated += 1
      job.emit(e.step)
    if not e.finished: return
    del self.jobs[e.rid]
    reason = "cancelled" if e.step is None else "stop" if e.step.token in job.stop_ids else "length"
    self._ended(job, reason)
    self.job_seconds = 0.8 * self.job_seconds + 0.2 * (time.perf_counter() - started)
    kv = self.kvstore
    if kv is not None and reason != "cancelled" and (keep := self._to_save(b.slot_tokens[e.slot], job.prompt)) and kv.wants(keep):
      kv.save(keep, self.runner.kv_rows(len(keep), e.slot))

  def _to_save(self, held: list[int], prompt) -> list[int] | None:
    """What a finished request leaves to save when its cache holds `held` (None: not its prompt): the prompt's rows, or,
    for a model whose state resumes only where it ends (ring caches: the model's max_rewind), all it holds (a
    conversation's next turn extends it)."""
    if list(held[:len(prompt)]) != list(prompt): return None
    return list(prompt) if self.runner.model.max_rewind is None else list(held)

  def _restore(self, prompt: tuple[int, ...], slot: int, start: int) -> int:
    """A saved prefix of `prompt` into `slot` when it saves MIN_DISK_GAIN tokens over the `start` the slot holds."""
    kv, entry = self.kvstore, None
    try:
      entry, _ = kv.lookup(list(prompt), whole=self.runner.model.max_rewind is not None)
      n = self.runner.reusable(list(prompt), entry.tokens.tolist()) if entry is not None else 0
      if entry is not None and n >= start + MIN_DISK_GAIN and (rows := kv.load(entry)) is not None:
        self.runner.load_kv_rows(entry.tokens[:n].tolist(), rows, slot)
        return n
    except Exception as e:  # a bad saved prefix costs its reuse, never the request
      if entry is not None: kv.discard(entry, f"{type(e).__name__}: {e}", delete=True)
      else: log.warning("kv cache: lookup failed: %s: %s", type(e).__name__, e)
      return 0  # the slot may be half-written: nothing of it is reused
    return start

  def _reuse(self, prompt: list[int]) -> int:
    eng, kv, start = self.runner, self.kvstore, self.runner.reusable(prompt)
    if kv is None: return start
    entry = None
    try:
      entry, _ = kv.lookup(prompt, whole=eng.model.max_rewind is not None)
      n = eng.reusable(prompt, entry.tokens.tolist()) if entry is not None else 0
      if entry is not None and n >= start + MIN_DISK_GAIN and (rows := kv.load(entry)) is not None:
        eng.load_kv_rows(entry.tokens[:n].tolist(), rows)
        start = eng.reusable(prompt)
    except Exception as e:  # a bad saved prefix (rows that do not fit this cache, ...) costs its reuse, never the request
      if entry is not None: kv.discard(entry, f"{type(e).__name__}: {e}", delete=True)
      else: log.warning("kv cache: lookup failed: %s: %s", type(e).__name__, e)
      start = eng.reusable(prompt)  # load_kv_rows empties the cache before writing: nothing half-written is reused
    return start

  def _generate(self, job: Job):
    eng, prompt = self.runner, job.prompt
    start = self._reuse(prompt)
    job.emit(Started(start))
    reason, last = "length", None
    speculates = self.drafter is not None and job.params.greedy and job.logprobs is None  # greedy: the tokens plain decoding gives
    if speculates: gen = (Step(t) for t in speculate(eng, self.drafter, prompt, job.max_tokens, self.speculative, job.params, job.stop_ids, start))
    else: gen = eng.steps(prompt, job.max_tokens, job.params, job.stop_ids, start_pos=start, logprobs=job.logprobs)
    try:
      for step in gen:
        job.generated += 1; last = step.token
        job.emit(step)
        if job.cancelled: reason = "cancelled"; break  # not resuming the generator: no further token is computed
    finally: gen.close()
    if speculates:
      for key in self.drafts: self.drafts[key] += getattr(eng.stats, key)
    if reason != "cancelled" and last in job.stop_ids: reason = "stop"
    self._ended(job, reason)
    kv = self.kvstore
    if kv is not None and (keep := self._to_save(eng.cached, prompt)) and kv.wants(keep): kv.save(keep, eng.kv_rows(len(keep)))
