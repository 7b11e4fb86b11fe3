"""tg_ds4.runtime.jit.Jit on the CPU: the fast CPU replay (backend/cpu/replay.py) runs exactly what tinygrad's executor runs.
Logits bitwise equal at every position (the position is symbolic), the same GlobalCounters per step, the same generated tokens."""
import pathlib

import numpy as np
import pytest
from tinygrad import GlobalCounters

from tg_ds4.backend.cpu.replay import FastCPUReplay
from tg_ds4.runtime.runner import Runner
from tg_ds4.runtime.sampling import SamplingParams

FIX = pathlib.Path(__file__).parent / "fixtures"
FILES = [FIX / "deepseek2/ds3/ds3-Q4_0.gguf", FIX / "deepseek4/flash/flash-MXFP4.gguf"]

def steps(path, fast: bool, monkeypatch, n: int = 40):
  monkeypatch.setenv("TG_DS4_FAST_REPLAY", "1" if fast else "0")
  m, out = Runner.load(path, max_ctx=64), []
  for i in range(n):
    GlobalCounters.reset()
    logits = m.decode((7 * i) % 50 + 1, i).numpy()
    out.append((logits, GlobalCounters.kernel_count, GlobalCounters.global_mem))
  assert (type(m._jits["greedy"].captured) is FastCPUReplay) == fast
  return out

@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_fast_replay_equals_tinygrad(path, monkeypatch):
  slow, fast = steps(path, False, monkeypatch), steps(path, True, monkeypatch)
  for i, ((a, ka, ma), (b, kb, mb)) in enumerate(zip(slow, fast)):
    np.testing.assert_array_equal(a, b, err_msg=f"position {i}")
    # position 0 is tinygrad's uncaptured first run, which can reuse process-wide tables the first model built
    assert i == 0 or (ka, ma) == (kb, mb), f"position {i}: counters {ka, ma} != {kb, mb}"

def test_engine_generates_the_same(monkeypatch):
  path, toks = FILES[0], []
  for fast in (False, True):
    monkeypatch.setenv("TG_DS4_FAST_REPLAY", "1" if fast else "0")
    e = Runner.load(path, max_ctx=64)
    toks.append(list(e.generate([1, 5, 9, 13], 24)) + list(e.generate([2, 4], 8, SamplingParams(temperature=0.8, seed=3))))
  assert toks[0] == toks[1]

@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_argument_addresses_equal_tinygrads(path):
  """The replay computes the memory plan's views' addresses itself (no view Buffers built): each equals tinygrad's."""
  from tinygrad.engine.realize import get_call_arg_uops
  from tinygrad.uop.ops import Ops
  from tg_ds4.backend.cpu.replay import _extent, _is_input
  m = Runner.load(path, max_ctx=64)
  m.decode(3, 0)
  args = [b for call in m._jits["greedy"].captured.linear.src if call.src[0].op is Ops.PROGRAM
          for i in call.src[0].arg.globals if not _is_input(b := get_call_arg_uops(call)[i])]
  fast = [b for b in args if (b.src[0] if b.op is Ops.BITCAST else b).op is Ops.SHRINK]
  assert len(fast) > 50
  for b in args:
    buf = b.buffer.ensure_allocated()
    assert _extent(b, "CPU") == (buf.get_buf("CPU").va_addr, buf.nbytes)

def test_waves():
  """Consecutive unsplit kernels join a wave unless one writes bytes another reads or writes; a split kernel never
  joins one; a JIT input is the same buffer only under the same key."""
  from tg_ds4.backend.cpu.replay import _waves
  inp = (object(), "CPU")
  k = lambda r, w: ([(a, n) for a, n in r], [(a, n) for a, n in w])
  touched = [k([(0, 8)], [(100, 8)]), k([(0, 8)], [(108, 8)]),   # both read 0..8, write apart: a wave
             k([(104, 8)], [(200, 8)]),                           # reads what the first wrote (100..108 meets 104..112)
             k([(300, 4)], [(96, 8)]),                            # writes 96..104, beside the third's read 104..112: joins it
             k([(0, 4)], [(200, 4)]),                             # writes what the third writes
             ([(inp, None)], [(400, 4)]), ([(inp, None)], [(404, 4)]), ([], [(inp, None)]),  # reads, reads, writes the input
             k([], [(500, 4)]), k([], [(504, 4)])]                 # touch nothing of the input writer's: join it
  parts = [1] * 10
  assert _waves(touched, parts) == [2, 1, 2, 1, 3, 1, 1, 3, 1, 1]
  assert _waves(touched, parts[:8] + [2, 1]) == [2, 1, 2, 1, 3, 1, 1, 1, 1, 1]  # a split kernel stands alone

def test_batched_step_equals_tinygrad(monkeypatch):
  """A batched step's per-row attention kernels run as waves on several threads: its results equal tinygrad's executor's
  bitwise, step after step."""
  from tg_ds4.backend.cpu.replay import _waves
  seen = []
  def spy(touched, parts):
    seen.append(w := _waves(touched, parts))
    return w
  monkeypatch.setattr("tg_ds4.backend.cpu.replay._waves", spy)
  out = []
  for fast in (False, True):
    monkeypatch.setenv("TG_DS4_FAST_REPLAY", "1" if fast else "0")
    m = Runner.load(FILES[0], max_ctx=64, parallel=3)
    out.append([m.batch_step([5 + i, 9, 13 + 2 * i], [0, 1, 2], [i, 2 * i, 3 * i], logprobs=5) for i in range(12)])
  assert any(w > 1 for ws in seen for w in ws), "no waves: the test would not exercise them"
  for i, (a, b) in enumerate(zip(*out)): np.testing.assert_array_equal(a, b, err_msg=f"step {i}")
