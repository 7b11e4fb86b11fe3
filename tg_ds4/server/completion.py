"""One request's generation as the event loop sees it: submit a Job to the worker (429 when the queue is full), then turn
its token events into text pieces (stop strings and tool-call markup held back), ending in a Finish with the usage.
Leaving the iteration early, for whatever reason (client gone, stop string), cancels the job."""
from __future__ import annotations

import asyncio, contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request

from tg_ds4.runtime.runner import Step
from tg_ds4.runtime.sampling import SamplingParams
from tg_ds4.server.errors import ApiError
from tg_ds4.server.served import Served
from tg_ds4.server.textstream import TextStream
from tg_ds4.server.toolcalls import START_MARKERS
from tg_ds4.server.worker import Done, Failed, Job, QueueFull, Started


@dataclass
class Usage:
  prompt_tokens: int
  completion_tokens: int = 0
  cached_tokens: int = 0

@dataclass
class Piece:
  text: str
  steps: list[Step] = field(default_factory=list)  # the tokens this text came from (for logprobs)

@dataclass
class Finish:
  reason: str                    # "stop" or "length"
  stop_sequence: str | None      # the stop string that ended the text
  tool_text: str | None          # text from the first tool-call marker on, to parse
  usage: Usage

class Completion:
  def __init__(self, served: Served, prompt: list[int], max_tokens: int | None, params: SamplingParams, stop: list[str],
               logprobs: int | None = None, tools: bool = False):
    self.served, self.usage = served, Usage(len(prompt))
    self.job = Job(prompt, served.room(prompt, max_tokens), params, frozenset(served.tok.stop_ids), logprobs)
    self.text = TextStream(served.tok, stop, START_MARKERS if tools else ())

  def submit(self) -> Completion:
    self.job.loop = asyncio.get_running_loop()
    try: self.served.worker.submit(self.job)
    except QueueFull:
      ra = self.served.worker.retry_after()
      raise ApiError(429, f"the request queue is full; retry in about {ra}s", code="queue_full", headers={"Retry-After": str(ra)}) from None
    return self

  async def events(self) -> AsyncIterator[Started | Piece | Finish]:
    job, ts, pending = self.job, self.text, []
    try:
      while True:
        ev = await job.events.get()
        if isinstance(ev, Started):
          self.usage.cached_tokens = ev.cached_tokens
          yield ev
        elif isinstance(ev, Step):
          self.usage.completion_tokens += 1
          if ev.token in job.stop_ids: continue  # end of turn: no text; Done follows
          text, stopped = ts.feed(ev.token)
          pending.append(ev)
          if text or stopped: yield Piece(text, pending); pending = []
          if stopped:
            yield Finish("stop", ts.stopped_by, ts.captured, self.usage)
            return
        elif isinstance(ev, Done):
          if (tail := ts.flush()) or pending: yield Piece(tail, pending)
          yield Finish("length" if ev.reason == "length" else "stop", None, ts.captured, self.usage)
          return
        elif isinstance(ev, Failed): raise ApiError(500, f"generation failed (job {job.id}; the server log has the details)")
    finally: job.cancel()  # done, stopped early, or the client left: nothing more is wanted

  async def collect(self) -> tuple[str, list[Step], Finish]:
    """The whole answer (non-streaming)."""
    text, steps = [], []
    async for ev in self.events():
      if isinstance(ev, Piece): text.append(ev.text); steps.extend(ev.steps)
      elif isinstance(ev, Finish): return "".join(text), steps, ev
    raise ApiError(500, "generation ended without a result")

@contextlib.asynccontextmanager
async def cancel_on_disconnect(request: Request, job: Job):
  """For non-streaming answers: watch the connection while the answer is computed; a client that leaves cancels."""
  async def watch():
    while (await request.receive())["type"] != "http.disconnect": pass
    job.cancel()
  task = asyncio.create_task(watch())
  try: yield
  finally: task.cancel()
