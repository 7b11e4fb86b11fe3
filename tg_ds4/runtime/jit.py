"""`Jit`: tinygrad's TinyJit, with captures saved to and loaded from the step cache, and on the CPU replayed natively
(backend.replay: backend/cpu/replay.py). On any other device a capture is replayed by tinygrad as captured."""
from __future__ import annotations

import logging, time

from tg_ds4 import backend
from tg_ds4.backend.compat import CapturedJit, JitError, _TinyJit
from tg_ds4.runtime.stepcache import StepCache

log = logging.getLogger("tg_ds4")

class Jit(_TinyJit):
  """TinyJit whose capture the device's backend may replay its own way (same kernels, same order, same results).

  With a step cache and a step name, a capture saved by an earlier process is loaded instead of capturing, and a new
  capture is saved. It captures on its first call (TinyJit runs a first call uncaptured, then captures the second: two
  schedules for one step, and a step run once, like a short prompt's prefill chunk, never captured at all)."""
  holds_model_state = False  # its capture refers to the model's buffers; nn/layers.py's named_tensors names them from the model
  def __init__(self, fxn, cache: StepCache | None = None, name: str | None = None, device: str | None = None):
    super().__init__(fxn)
    self.cache, self.name, self.device, self.cnt = cache, name, device, 1
    self.loaded, self._ready = False, None  # _ready: the capture already saved and handed to the backend

  def __call__(self, *args, **kwargs):
    t = time.perf_counter() if self._ready is None else None  # (the first call only: no clock on the per-token path)
    if self.captured is None and self.cache is not None and (c := self.cache.load(self.name)) is not None:
      self.captured = self._ready = backend.replay(c, self.device)
      self.cnt, self.loaded = 2, True
    try: ret = super().__call__(*args, **kwargs)
    except JitError:
      if not self.loaded or self.cnt != 2: raise
      log.warning("step cache: %s does not fit this call; capturing it again", self.name)  # inputs of another shape or dtype
      self.captured, self.cnt, self.loaded = None, 1, False
      ret = super().__call__(*args, **kwargs)
    # once per capture: where the backend keeps tinygrad's replay (not the CPU, or TG_DS4_FAST_REPLAY=0) the capture
    # stays a CapturedJit, and a type test here saved the step to disk again on every call
    if (c := self.captured) is not None and c is not self._ready:
      if type(c) is CapturedJit and self.cache is not None and not self.loaded: self.cache.save(self.name, c)
      self.captured = self._ready = backend.replay(c, self.device)
    if t is not None and self._ready is not None:  # a server's log shows which request paid for a compile
      log.info("step %s %s in %.1fs", self.name, "loaded from the step cache" if self.loaded else "captured", time.perf_counter() - t)
    return ret
