"""Request bodies read under limits and parsed off the event loop: a byte cap (413) and a time limit for the whole body
(408); then, in a worker thread, a linear-time nesting-depth check (400), JSON parsing and field validation. So no body
can stall /health or other requests' token streams, or reach the JSON parser's recursion limit.

Memory: parsed JSON, its validated objects and the prompt rendered from them take ~30x the text (a 5 MB body of 150k
messages: +180 MB), so only `parsing` requests are between their body and their prompt ids at once: `read_request` is a
context held until the prompt is built (the others wait their turn, milliseconds for ordinary requests). Receiving holds
the raw bytes: bodies up to SMALL_BODY with a Content-Length are read freely (the connection cap bounds them), larger or
chunked ones take one of `receiving` slots, so slow senders of big bodies never hold up the parsing of small ones."""
from __future__ import annotations

import asyncio, contextlib, json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from tg_ds4.server.errors import ApiError
from tg_ds4.server.schemas import Strict, validate

CLOSE = {"Connection": "close"}  # the rest of an unread body would be taken for the next request
SMALL_BODY = 64 << 10

@dataclass(frozen=True)
class BodyLimits:
  max_bytes: int = 8 << 20
  max_depth: int = 64
  timeout: float = 30.0  # seconds from the first read to the end of the body
  parsing: int = 2       # bodies parsed and validated at once
  receiving: int = 16    # bodies over SMALL_BODY (or of unknown length) received at once

class BodySlots:
  def __init__(self, limits: BodyLimits): self.parsing, self.receiving = asyncio.Semaphore(limits.parsing), asyncio.Semaphore(limits.receiving)

_DEPTH = np.zeros(256, np.int8)
_DEPTH[list(b"[{")], _DEPTH[list(b"]}")] = 1, -1
_QUOTE, _BACKSLASH = ord('"'), ord("\\")

def json_depth(raw: bytes, chunk: int = 1 << 20) -> int:
  """Maximum bracket nesting of a JSON text, brackets inside strings not counted. A quote ends or starts a string unless
  an odd run of backslashes precedes it. Vectorised over chunks (the quote parity, the open depth and a trailing run of
  backslashes carry over), so linear in time with bounded scratch memory, whatever the text."""
  a = np.frombuffer(raw, np.uint8)
  best = depth = run = inside = 0
  for s in range(0, len(a), chunk):
    c = a[s:s + chunk]
    i = np.arange(len(c), dtype=np.int64)
    # the last byte at or before each position that is not a backslash (a carried run sits at -run..-1)
    last = np.maximum.accumulate(np.where(c == _BACKSLASH, -run - 1, i))
    before = np.empty_like(i)  # backslashes right before each byte
    before[0], before[1:] = run, i[:-1] - last[:-1]
    quotes = np.cumsum((c == _QUOTE) & (before % 2 == 0), dtype=np.int64) + inside
    levels = np.cumsum(np.where(quotes % 2 == 1, 0, _DEPTH[c]), dtype=np.int64) + depth
    best, depth, run, inside = max(best, int(levels.max())), int(levels[-1]), int(len(c) - 1 - last[-1]), int(quotes[-1] % 2)
  return best

def _no_constants(name: str): raise ValueError(f"{name} is not valid JSON")

def parse(raw: bytes, max_depth: int, model: type[Strict]) -> Strict:
  """Bytes -> validated request (runs in a worker thread)."""
  if not raw.strip(): raise ApiError(400, "request body is empty; expected a JSON object")
  if (depth := json_depth(raw)) > max_depth: raise ApiError(400, f"JSON nested {depth} levels deep; the limit is {max_depth}")
  try: body = json.loads(raw, parse_constant=_no_constants)  # NaN/Infinity are not JSON
  except (ValueError, RecursionError) as e: raise ApiError(400, f"malformed JSON: {e}") from None
  if not isinstance(body, dict): raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
  return validate(model, body)

@contextlib.asynccontextmanager
async def read_request(request: Request, model: type[Strict]) -> AsyncIterator[Strict]:
  """The validated body, within a parsing slot held until the block ends (build the prompt inside it)."""
  limits: BodyLimits = request.app.state.body_limits
  if (cl := request.headers.get("content-length")) and cl.isdigit() and int(cl) > limits.max_bytes:
    raise ApiError(413, f"request body is {cl} bytes; the limit is {limits.max_bytes}", headers=CLOSE)
  slots: BodySlots = request.app.state.body_slots
  async with contextlib.nullcontext() if cl and cl.isdigit() and int(cl) <= SMALL_BODY else slots.receiving:
    chunks, n = [], 0
    try:
      async with asyncio.timeout(limits.timeout):
        async for chunk in request.stream():
          n += len(chunk)
          if n > limits.max_bytes: raise ApiError(413, f"request body exceeds the limit of {limits.max_bytes} bytes", headers=CLOSE)
          chunks.append(chunk)
    except TimeoutError: raise ApiError(408, f"request body not received within {limits.timeout:g}s", headers=CLOSE) from None
  async with slots.parsing: yield await run_in_threadpool(parse, b"".join(chunks), limits.max_depth, model)
