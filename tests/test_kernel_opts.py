"""tg_ds4.kernel_opts: what the CPU heuristic changes, checked on the kernels tinygrad builds for our matmuls (the
speed of each choice is measured in the module's docstring and the README, not here)."""
import numpy as np
import pytest
from tinygrad import Device, Tensor, dtypes
from tinygrad.codegen.opt import Opt, OptOps
from tinygrad.codegen.opt.postrange import Scheduler
import tinygrad.codegen as cg
from tinygrad.uop.ops import AxisType, Ops, graph_rewrite

from tg_ds4 import kernel_opts
from tg_ds4.quant import QTYPE_BY_NAME, QTensor, linear

pytestmark = pytest.mark.skipif(not getattr(Device[Device.DEFAULT].renderer, "has_threads", False), reason="CPU renderers only")

def schedulers(t: Tensor) -> list[Scheduler]:
  """The kernels of `t` as tinygrad's codegen hands them to the heuristic (the rewrites of `full_rewrite_to_sink` before
  `apply_opts`)."""
  lin, out = t.linear_with_vars()[0], []
  for c in lin.src:
    if c.op is Ops.CALL and c.src[0].op is Ops.SINK:
      sink = graph_rewrite(graph_rewrite(c.src[0], cg.multi_pm), cg.pm_mops, bottom_up=True)
      sink = graph_rewrite(sink, cg.pm_load_collapse)
      sink = graph_rewrite(sink, cg.pm_split_ranges + cg.pm_flatten_range, ctx={})
      sink = graph_rewrite(sink, cg.sym + cg.pm_flatten_range)
      sink = graph_rewrite(sink, cg.pm_flatten_range + cg.pm_simplify_ranges, ctx={})
      k = Scheduler(sink, Device[Device.DEFAULT].renderer)
      k.convert_loop_to_global()
      out.append(k)
  return out

def packed(name: str, rows: int, cols: int) -> QTensor:
  qt = QTYPE_BY_NAME[name]
  return QTensor(Tensor(np.zeros((rows, cols // qt.block, qt.nbytes), np.uint8)).realize(), qt, (rows, cols))

@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q4_K"])
def test_gemv_keeps_lanes_and_core_split_without_row_upcast(name):
  (k,) = schedulers(linear(Tensor.ones(1, 1, 1024).contiguous().realize(), packed(name, 4096, 1024)))
  theirs, ours = kernel_opts._hand_coded(k.copy()), kernel_opts.cpu_heuristic(k.copy())
  assert any(o.op is OptOps.UPCAST for o in theirs.applied_opts)  # what the change is about
  assert not any(o.op is OptOps.UPCAST for o in ours.applied_opts), ours.applied_opts
  kept = [o for o in theirs.applied_opts if o.op is not OptOps.UPCAST]
  assert ours.applied_opts[:len(kept)] == kept and all(o.op is OptOps.UNROLL for o in ours.applied_opts[len(kept):])
  assert np.prod([ours.full_shape[a] for a in ours.axes_of(AxisType.UNROLL)]) >= kernel_opts.LANES  # the lane accumulators

def test_gemv_unrolls_the_nibble_axis_with_the_same_sums(monkeypatch):
  rng, qt = np.random.default_rng(0), QTYPE_BY_NAME["Q4_1"]
  blocks = rng.integers(0, 256, (512, 1024 // 32, qt.nbytes), dtype=np.uint8)
  blocks[..., :4] = (rng.standard_normal((512, 32, 2)) * 0.01).astype(np.float16).view(np.uint8)  # finite d and m
  x = Tensor(rng.standard_normal((1, 1, 1024)).astype(np.float32)).realize()
  w = lambda rows: QTensor(Tensor(blocks[:rows].copy()).realize(), qt, (rows, 1024))
  (k,) = schedulers(linear(x, w(512)))
  ours = kernel_opts.cpu_heuristic(k.copy())
  assert np.prod([ours.full_shape[a] for a in ours.axes_of(AxisType.UNROLL)]) == 32  # 16 lanes x both nibbles
  unrolled = linear(x, w(512)).numpy()
  monkeypatch.setattr(kernel_opts, "_unroll_lanes", lambda k: k)
  looped = linear(x, w(256)).numpy()  # another shape, so a kernel compiled without the unroll
  np.testing.assert_array_equal(unrolled[..., :256], looped)  # the same sums in the same order, bit for bit
  np.testing.assert_allclose(unrolled[0, 0], w(512).dequant().numpy() @ x.numpy()[0, 0], rtol=1e-4, atol=1e-4)

def test_prefill_gemm_on_transposed_weight():
  wt = Tensor.ones(1024, 4096).contiguous().realize()   # [in, out], as layers.Linear stores an unpacked weight
  (k,) = schedulers(Tensor.ones(1, 32, 1024).contiguous().realize() @ wt)
  ours = kernel_opts.cpu_heuristic(k.copy())
  assert ours.applied_opts[:2] == [Opt(OptOps.UPCAST, 0, kernel_opts.GEMM_TOKENS), Opt(OptOps.UPCAST, 1, kernel_opts.GEMM_VEC)], ours.applied_opts
  assert any(o.op is OptOps.THREAD for o in ours.applied_opts) == (Device[Device.DEFAULT].renderer.global_max[0] > 1)

def test_transposing_unpack_reads_each_block_once():
  (k,) = schedulers(packed("Q5_0", 4096, 896).dequant(dtypes.float32).T.contiguous())  # qwen2.5 widths
  ours = kernel_opts.cpu_heuristic(k.copy())
  assert ours.applied_opts[0].op is OptOps.UPCAST and ours.applied_opts[0].arg == kernel_opts.UNPACK_ROWS, ours.applied_opts
  assert ours.applied_opts[1].op is OptOps.UPCAST and ours.applied_opts[1].arg == 0  # the whole byte run of a block

def test_other_kernels_unchanged():
  w = Tensor.ones(256, 64).contiguous().realize()  # [out, in]: contiguous along the reduce axis, neither GEMM_OPTS nor lanes
  (k,) = schedulers(Tensor.ones(32, 64).contiguous().realize() @ w.T)
  assert kernel_opts.cpu_heuristic(k.copy()).applied_opts == kernel_opts._hand_coded(k.copy()).applied_opts

def _sources(t: Tensor) -> str:
  """The C source of `t`'s kernels, rendered now (with the currently installed heuristic and rewrites)."""
  progs = [cg.do_to_program(c.src[0], Device[Device.DEFAULT].renderer) for c in t.linear_with_vars()[0].src
           if c.op is Ops.CALL and c.src[0].op is Ops.SINK]
  return "\n".join(s.arg for p in progs for s in p.src if s.op is Ops.SOURCE)

@pytest.mark.skipif(kernel_opts.vector_floats() != 8, reason="CPUs with 256-bit vectors")
def test_gemm_weight_rows_and_outputs_in_8_float_accesses(monkeypatch):
  rng = np.random.default_rng(0)
  x, wt = rng.standard_normal((1, 32, 256)).astype(np.float32), rng.standard_normal((256, 512)).astype(np.float32)
  gemm = lambda: Tensor(x).realize() @ Tensor(wt).realize()
  src = _sources(gemm())
  loads, stores = src.count("= (*((float8*)"), src.count("*((float8*)((data0")
  assert loads >= kernel_opts.GEMM_VEC // 8 and stores >= kernel_opts.GEMM_TOKENS * kernel_opts.GEMM_VEC // 8, src
  np.testing.assert_allclose(gemm().numpy(), x @ wt, rtol=1e-4, atol=1e-4)
  monkeypatch.setattr(kernel_opts, "vector_floats", lambda: 4)  # tinygrad's own coalescing: at most 4 floats
  assert "float8" not in _sources(gemm())
