"""Limits on connections that uvicorn's HTTP/1.1 protocol lacks, against silent and slow clients:

- a deadline for each request's head (request line and headers), counted from the connection's start or the end of the
  previous response; bytes trickling in do not extend it (uvicorn's keep-alive timer restarts on every byte). A request
  whose head is in has the body's own time limit (`body.BodyLimits.timeout`).
- a cap on open connections, kept below the process's file-descriptor limit: at the cap, the connection that has waited
  longest without a request in progress is closed to make room (if every one is busy, the new one is), so silent sockets
  can neither starve real clients nor drive accept() into EMFILE. Under a flood asyncio accepts up to `backlog` sockets
  on every loop turn, and a batch's descriptors are freed only turns later (its transports are made in a task a turn
  after the accept, their connection_made closes the victims, and a closed transport releases its socket a turn after
  close()), so the cap leaves room for IN_FLIGHT such batches besides the descriptors already open, and the listen
  backlog is small (connections waiting in the kernel's queue cost no descriptor of ours).

This subclasses uvicorn's `H11Protocol` (0.3x-0.5x: `connections`, `cycle`, `on_response_complete`, `transport`), the
one place that touches uvicorn's internals; a uvicorn without them fails at start-up, not under load."""
from __future__ import annotations

import logging, os, resource, time

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("tg_ds4.server")
BACKLOG = 32     # listen queue, and so the most sockets asyncio accepts at once
IN_FLIGHT = 4    # accepted batches whose descriptors may be open beyond the cap (2 with a backlog of 64 hit EMFILE under load)
FD_RESERVE = 32  # descriptors kept free for what the server opens later (its event loop, KV cache files, the compiler's pipes)

def _open_fds() -> int:
  try: return len(os.listdir("/proc/self/fd"))
  except OSError: return 64

def connection_cap(wanted: int, backlog: int = BACKLOG) -> int:
  """`wanted`, lowered to what the descriptor limit leaves (raised to its hard limit first, as servers do)."""
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  if soft != hard:
    try: resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16), hard))
    except (ValueError, OSError): pass
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
  room = soft - _open_fds() - IN_FLIGHT * backlog - FD_RESERVE if soft != resource.RLIM_INFINITY else wanted
  if wanted > room:
    log.warning("at most %d connections: the file-descriptor limit is %d", max(room, 8), soft)
    return max(room, 8)
  return wanted

class RateLimited(logging.Filter):
  """Lets a record through at most once per `every` seconds per message (asyncio logs a traceback per failed accept)."""
  def __init__(self, every: float = 10.0):
    super().__init__()
    self.every, self.last = every, {}
  def filter(self, record: logging.LogRecord) -> bool:
    now, key = time.monotonic(), record.msg
    if now - self.last.get(key, float("-inf")) < self.every: return False
    self.last[key] = now
    return True

WARN_EVERY = 10.0  # seconds between two log lines about the cap: a flood of connections must not become a flood of logs

def limited_protocol(head_timeout: float, max_connections: int) -> type[H11Protocol]:
  warned = [float("-inf")]
  class Limited(H11Protocol):
    def connection_made(self, transport):
      super().connection_made(transport)
      self._head, self._idle_since = None, self.loop.time()
      self._arm()
      if len(self.connections) > max_connections: self._make_room()

    def _waiting(self) -> bool: return self.cycle is None or self.cycle.response_complete  # no request in progress

    def _arm(self):
      self._disarm()
      self._idle_since, self._head = self.loop.time(), self.loop.call_later(head_timeout, self._head_expired)

    def _disarm(self):
      if self._head is not None: self._head.cancel(); self._head = None

    def _head_expired(self):
      self._head = None
      if self._waiting() and not self.transport.is_closing(): self.transport.close()

    def _make_room(self):
      idle = [c for c in self.connections if c is not self and isinstance(c, Limited) and c._waiting() and not c.transport.is_closing()]
      victim = min(idle, key=lambda c: c._idle_since) if idle else self
      victim.transport.close()
      if self.loop.time() - warned[0] >= WARN_EVERY:
        warned[0] = self.loop.time()
        log.warning("connection cap %d reached: closing %s connections", max_connections, "idle" if victim is not self else "new")

    def data_received(self, data: bytes):
      super().data_received(data)
      if not self._waiting(): self._disarm()  # a request's head is in

    def on_response_complete(self):
      super().on_response_complete()
      if not self.transport.is_closing(): self._arm()  # the next request's head has its own deadline

    def connection_lost(self, exc):
      self._disarm()
      super().connection_lost(exc)
  return Limited
