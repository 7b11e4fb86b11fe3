"""Subprocess jobs that tests marked `background(job)` wait for (conftest starts them when collection ends and runs
those tests last). The suite alone keeps ~1.25 of the 2 cores busy, so single-threaded jobs of minutes (tinygrad's
PYTHON device emulating a GPU, lowering every fixture for a renderer) overlap it instead of adding to it. Each queue
runs its jobs one after another; every queue stops with the session (`stop_all`: -x, ctrl-c): a running process is
killed and none starts after it."""
from __future__ import annotations

import subprocess, threading
from typing import Any, Callable

class Jobs:
  def __init__(self, cleanup: Callable[[], None] = lambda: None):
    self.cleanup = cleanup  # at the session's end, after every process is stopped
    self._started: dict[str, tuple[threading.Event, dict[str, Any]]] = {}
    self._todo: list[tuple[str, Callable[[Jobs], Any]]] = []
    self._running: list[subprocess.Popen] = []
    self._lock, self._wake, self._stopping = threading.Lock(), threading.Condition(), False
    _QUEUES.append(self)

  def start(self, name: str, job: Callable[[Jobs], Any]) -> None:
    """Queue `job(self)` (it starts its processes with `self.popen`) unless `name` was queued already."""
    with self._wake:
      if name in self._started: return
      if not self._started: threading.Thread(target=self._run, daemon=True).start()
      self._started[name] = (threading.Event(), {})
      self._todo.append((name, job))
      self._wake.notify()

  def popen(self, *args, **kwargs) -> subprocess.Popen:
    with self._lock:
      if self._stopping: raise RuntimeError("the session ended first")
      self._running.append(proc := subprocess.Popen(*args, **kwargs))
      return proc

  def result(self, name: str, timeout: float = 3600) -> Any:
    """What the job returned (its exception re-raised)."""
    done, res = self._started[name]
    assert done.wait(timeout), f"background job {name} still running after {timeout} s"
    if "error" in res: raise res["error"]
    return res["value"]

  def stop(self) -> None:
    with self._lock:
      self._stopping = True
      for proc in self._running:
        if proc.poll() is None: proc.kill()
    self.cleanup()

  def _run(self) -> None:
    while True:
      with self._wake:
        while not self._todo: self._wake.wait()
        name, job = self._todo.pop(0)
      done, res = self._started[name]
      try:
        if self._stopping: raise RuntimeError("the session ended first")
        res["value"] = job(self)
      except BaseException as e:  # noqa: BLE001  (result() re-raises it in the test)
        res["error"] = e
      finally: done.set()

_QUEUES: list[Jobs] = []

def stop_all() -> None:
  for q in _QUEUES: q.stop()
