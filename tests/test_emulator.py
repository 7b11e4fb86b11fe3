"""backend/emulator.py runs DEV=PYTHON's kernels for the whole grid at once: every kernel here runs on tinygrad's stock
emulator (the definition of the uops' semantics) on copies of its buffers and on ours, and each buffer must come out
byte-identical. The kernels cover what the model kernels use: shared memory and barriers (grouped reductions),
upcast GEMMs, gated loads (padding), symbolic sizes, integer division and shifts on negative numbers, casts both ways,
bitcasts, transcendentals, nan and inf, scatter-style stores and loops."""
import numpy as np
import pytest
from tinygrad import Tensor, Variable, dtypes
from tg_ds4.backend import compat, emulator

pytestmark = pytest.mark.skipif(not compat.fast_emulator_on(), reason="the lockstep emulator is off on this tinygrad")

@pytest.fixture
def compared(monkeypatch):
  """Every PYTHON kernel run twice, stock then lockstep, on equal inputs; the list of (uop count, launch, equal)."""
  emulator.install("PYTHON")
  runs: list[tuple[int, tuple, bool]] = []
  fast = emulator.Program.__call__
  def both(self, *bufs, **kw):
    if not self.lockstep: return compat.PythonProgram.__call__(self, *bufs, **kw)
    copies = [memoryview(bytearray(b.cast("B"))) for b in bufs]
    compat.PythonProgram.__call__(self, *copies, **kw)
    ret = fast(self, *bufs, **kw)
    runs.append((len(self.uops), (kw.get("global_size"), kw.get("local_size")),
                 all(bytes(c) == bytes(b.cast("B")) for c, b in zip(copies, bufs))))
    return ret
  monkeypatch.setattr(emulator.Program, "__call__", both)
  return runs

def _data(shape, seed, special=False) -> np.ndarray:
  a = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 3
  if special: a.reshape(-1)[:4] = [np.nan, np.inf, -np.inf, -0.0]
  return a

def test_float_kernels_match_the_stock_emulator_bytewise(compared):
  a, b = Tensor(_data((24, 40), 0, special=True), device="PYTHON"), Tensor(_data((24, 40), 1), device="PYTHON")
  outs = [(a * b + 1).relu(), a.maximum(b), a.sum(axis=1), a.max(axis=0), Tensor(_data((4, 4096), 2), device="PYTHON").sum(axis=1),
          Tensor(_data((33, 96), 3), device="PYTHON") @ Tensor(_data((96, 40), 4), device="PYTHON"),
          b.exp(), b.abs().log(), b.abs().sqrt(), b.sin(), b.reciprocal(), b.softmax(-1), a.pad(((1, 2), (3, 0)), value=-5.0),
          b.cumsum(1), b.argmax(1), b.half().float() * 3, b.cast(dtypes.int32), b.bitcast(dtypes.int32)]
  got = Tensor.realize(*outs)
  assert [o.numpy() for o in got]
  assert len(compared) >= len(outs) and all(eq for _, _, eq in compared), [r for r in compared if not r[2]]
  assert any(local != (1, 1, 1) for _, (_, local), _ in compared), "no kernel used a workgroup of more than one thread"

def test_integer_kernels_match_the_stock_emulator_bytewise(compared):
  x = Tensor(np.arange(-50, 50, dtype=np.int32).reshape(10, 10), device="PYTHON")
  y = Tensor(np.array([3, -7, 5, -2, 9, 4, -1, 6, 11, -13], dtype=np.int32), device="PYTHON")
  u = Tensor(np.arange(250, 256, dtype=np.uint8), device="PYTHON")
  outs = [x // y, x % y, x << 3, x >> 1, x ^ 0x55, (x < 0).where(x, -x), u + 9, u.cast(dtypes.float32) / 7, (x.float() * 0.37).cast(dtypes.int8),
          x.sum(axis=0), x.max(axis=1)]
  Tensor.realize(*outs)
  assert len(compared) >= len(outs) and all(eq for _, _, eq in compared), [r for r in compared if not r[2]]

def test_symbolic_sizes_match_the_stock_emulator_bytewise(compared):
  a = Tensor(_data((8, 32), 5), device="PYTHON")
  v = Variable("v", 1, 32)
  for n in (3, 17):
    a[:, :v.bind(n)].sum(axis=1).realize()
  assert compared and all(eq for _, _, eq in compared), [r for r in compared if not r[2]]

def test_an_out_of_bounds_access_raises_as_on_the_stock_emulator(compared):
  seen = []
  stock = emulator.Program.__call__
  def keep(self, *bufs, **kw):
    seen.append((self, bufs, kw))
    return stock(self, *bufs, **kw)
  emulator.Program.__call__ = keep
  try: (Tensor(_data((64,), 6), device="PYTHON") + 1).realize()
  finally: emulator.Program.__call__ = stock
  prog, bufs, kw = seen[-1]
  short = [memoryview(bytearray(b.nbytes // 2)) for b in bufs]
  with pytest.raises(IndexError): compat.PythonProgram.__call__(prog, *short, **kw)
  with pytest.raises(IndexError): stock(prog, *[memoryview(bytearray(b.nbytes // 2)) for b in bufs], **kw)

def test_a_loop_whose_bound_differs_between_threads_runs_on_the_stock_emulator():
  from tg_ds4.backend.compat import Ops, UOp
  buf = UOp(Ops.PARAM, dtypes.int32, arg=None)
  load = UOp(Ops.LOAD, dtypes.int32, src=(buf,))
  with pytest.raises(emulator.Unsupported): emulator.check([buf, load, UOp(Ops.RANGE, dtypes.int32, src=(load,), arg=0)])
  four = UOp.const(4, dtypes.int32)
  emulator.check([four, UOp(Ops.RANGE, dtypes.int32, src=(four,), arg=0)])
