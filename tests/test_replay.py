"""tg_ds4.jit.Jit on the CPU: the fast CPU replay (backend/cpu/replay.py) runs exactly what tinygrad's executor runs. Logits bitwise equal at every
position (the position is symbolic), the same GlobalCounters per step, the same generated tokens."""
import pathlib

import numpy as np
import pytest
from tinygrad import GlobalCounters

from tg_ds4.runner import Runner
from tg_ds4.backend.cpu.replay import FastCPUReplay
from tg_ds4.sampling import SamplingParams

FIX = pathlib.Path(__file__).parent / "fixtures"
FILES = [FIX / "deepseek2/ds3/ds3-Q4_0.gguf", FIX / "deepseek4/flash/flash-MXFP4.gguf"]

def steps(path, fast: bool, monkeypatch, n: int = 40):
  monkeypatch.setenv("TG_DS4_FAST_REPLAY", "1" if fast else "0")
  m, out = Runner.load(path, max_ctx=64), []
  for i in range(n):
    GlobalCounters.reset()
    logits = m.decode((7 * i) % 50 + 1, i).numpy()
    out.append((logits, GlobalCounters.kernel_count, GlobalCounters.global_mem))
  assert (type(m._jits["decode"].captured) is FastCPUReplay) == fast
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
  from tg_ds4.backend.cpu.replay import _address, _is_input
  m = Runner.load(path, max_ctx=64)
  m.decode(3, 0)
  args = [b for call in m._jits["decode"].captured.linear.src if call.src[0].op is Ops.PROGRAM
          for i in call.src[0].arg.globals if not _is_input(b := get_call_arg_uops(call)[i])]
  fast = [b for b in args if (b.src[0] if b.op is Ops.BITCAST else b).op is Ops.SHRINK]
  assert len(fast) > 50 and all(_address(b, "CPU") == b.buffer.ensure_allocated().get_buf("CPU").va_addr for b in args)
