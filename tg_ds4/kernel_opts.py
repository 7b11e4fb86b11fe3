"""One change to tinygrad's hand-coded kernel heuristic, for CPU reductions that already keep lane accumulators.

`quant.linear` writes a GEMV so that each output row keeps `LANES` independent accumulators (the unrolled last reduce
axis), which the C compiler turns into vector multiply-adds along the row's contiguous bytes. tinygrad's heuristic then
also upcasts the output rows by 4 (x is broadcast along them), giving 4 x 16 accumulators: clang's SLP vectorizer then
vectorizes across the 4 rows instead, with one byte insert per element (measured: a Q8_0 GEMV at 2.9 GB/s on one
core, the same kernel without the row upcast at 13.8 GB/s; Q4_1, Q5_0, Q4_K and Q6_K 1.5-3.6x faster). So on CPU
renderers, when the kernel keeps at least `LANES` accumulators from its unrolled reduce alone, the heuristic's
upcasts along axes where the weight (the largest buffer) moves are dropped and its other choices (the unroll, the
split over cores, an upcast over tokens that reuses each weight) kept. Upcasting output axes never changes
the order in which an output is summed, so results are bitwise the same. Kernels tuned by BEAM are not touched."""
from tinygrad.codegen.opt import KernelOptError, OptOps, heuristic
from tinygrad.codegen.opt.postrange import Scheduler
from tinygrad.helpers import prod
from tinygrad.uop.ops import AxisType
from tinygrad.engine import worker

LANES = 16
_hand_coded, _init_tinygrad_worker = heuristic.hand_coded_optimizations, worker._init_worker

def lanes_first(k: Scheduler) -> Scheduler:
  out = _hand_coded(k)
  if not getattr(k.ren, "has_threads", False) or not any(o.op is OptOps.UPCAST for o in out.applied_opts): return out
  alt = k.copy()
  weight = max(alt.bufs, key=lambda b: getattr(b.src[0].dtype, "size", 0))  # the operand that streams from memory
  try:
    for o in out.applied_opts:
      # an upcast along which the weight stays put (several tokens) reuses each decoded weight: kept
      if o.op is not OptOps.UPCAST or alt.rngs[alt.real_axis(o.op, o.axis)] not in weight.src[1].get_idx().backward_slice: alt.apply_opt(o)
  except KernelOptError: return out
  return alt if prod(alt.full_shape[a] for a in alt.axes_of(AxisType.UNROLL)) >= LANES else out

def _init_worker():
  _init_tinygrad_worker()
  install()

def install():
  """Idempotent. tinygrad looks the heuristic up in its module for each kernel, so this takes effect for new kernels,
  also in tinygrad's compile workers: they are spawned processes, started with this module's initializer."""
  heuristic.hand_coded_optimizations = lanes_first
  worker._init_worker = _init_worker
