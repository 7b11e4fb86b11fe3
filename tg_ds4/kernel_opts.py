"""Two changes to tinygrad's hand-coded kernel heuristic on CPU renderers, for the two matmul shapes of inference.

GEMV (one token): `quant.linear` writes it so that each output row keeps `LANES` independent accumulators (the
unrolled last reduce axis), which the C compiler turns into vector multiply-adds along the row's contiguous bytes.
tinygrad's heuristic then also upcasts the output rows by 4 (x is broadcast along them), giving 4 x 16 accumulators,
and clang's SLP vectorizer vectorizes across the 4 rows instead, with one byte insert per element (measured: a Q8_0
GEMV at 2.9 GB/s on one core, without the row upcast 13.8 GB/s; Q4_1, Q5_0, Q4_K and Q6_K 1.5-3.6x faster). So when a
kernel keeps at least `LANES` accumulators from its unrolled reduce alone, the heuristic's upcasts along axes where
the weight (the largest buffer) moves are dropped; its other choices (the unroll, the split over cores, an upcast over
tokens, which reuses each weight) are kept.

GEMM (a prefill chunk): `layers.Linear` dequantizes the weight once into a float32 `[in, out]` buffer. For a kernel
contracting such a weight (contiguous along its one output axis) with tokens along another output axis, the heuristic
builds dot products along the reduce axis (~20-36 GFLOP/s on 2 cores for qwen2.5's ffn). Instead each iteration here
holds a group of tokens x 16 outputs (a vector per token, one weight load for a multiply-add per token). The group
is sized to the vector registers, as tinygrad's CPU code holds the accumulators in 4-float vectors: 8 tokens where
there are 32 (AVX-512, NEON), ~64 GFLOP/s on 2 AVX-512 cores for qwen2.5's and smollm2's chunk GEMMs (4 tokens:
34-57); 4 tokens where there are 16 (AVX2): 8 x 16 spills, 4 x 16 is ~1.5x faster (ffn_up of qwen2.5, 2 Zen cores:
median 17-23 -> 24-26 GFLOP/s, interleaved runs).

Upcasts never change the order in which an output is summed, and an unrolled reduce is rendered as one left-to-right
accumulator chain (`acc + a + b`), so results are bitwise the same. Kernels tuned by BEAM are not touched."""
import pathlib, platform

from tinygrad.codegen.opt import KernelOptError, Opt, OptOps, heuristic
from tinygrad.codegen.opt.postrange import Scheduler
from tinygrad.dtype import dtypes
from tinygrad.engine import worker
from tinygrad.helpers import prod
from tinygrad.uop.ops import AxisType, Ops, UOp

LANES = 16

def vector_registers() -> int:
  """SIMD registers of this CPU (the C compiler targets -march=native): 32 with AVX-512 or on arm64, else 16."""
  if platform.machine().lower() in ("arm64", "aarch64"): return 32
  try: flags = pathlib.Path("/proc/cpuinfo").read_text()
  except OSError: return 16
  return 32 if " avx512f" in flags else 16

GEMM_VEC, GEMM_TOKENS = 16, 8 if vector_registers() >= 32 else 4
_hand_coded, _init_tinygrad_worker = heuristic.hand_coded_optimizations, worker._init_worker

def _weight(k: Scheduler) -> UOp:  # the operand that streams from memory: the largest buffer
  return max(k.bufs, key=lambda b: b.src[0].max_numel() * b.src[0].dtype.itemsize)

def _lanes_first(k: Scheduler, out: Scheduler) -> Scheduler:
  if not any(o.op is OptOps.UPCAST for o in out.applied_opts): return out
  alt, weight = k.copy(), _weight(k)
  try:
    for o in out.applied_opts:
      if o.op is not OptOps.UPCAST or alt.rngs[alt.real_axis(o.op, o.axis)] not in weight.src[1].get_idx().backward_slice: alt.apply_opt(o)
  except KernelOptError: return out
  return alt if prod(alt.full_shape[a] for a in alt.axes_of(AxisType.UNROLL)) >= LANES else out

def _threads(k: Scheduler, axis: int) -> list[Opt]:
  n = max((n for n in range(1, (k.ren.global_max or (1,))[0] + 1) if k.full_shape[axis] % n == 0), default=1)
  return [Opt(OptOps.THREAD, axis, n)] if n > 1 else []

def _gemm(k: Scheduler) -> Scheduler | None:
  """The GEMM opts for a float32 weight contiguous along its one output axis, tokens along the other; None otherwise."""
  weight = _weight(k)
  if len(k.unrollable_dims) != 1 or weight.src[0].dtype != dtypes.float32: return None
  idx = weight.src[1].get_idx()
  outs = [a for a in k.upcastable_dims if isinstance(k.full_shape[a], int)]
  o = [a for a in outs if k.rngs[a] in idx.backward_slice]
  t = [a for a in outs if k.rngs[a] not in idx.backward_slice]
  if len(o) != 1 or len(t) != 1 or not any(c is k.rngs[o[0]] for c in idx.split_uop(Ops.ADD)): return None  # stride 1 along o
  (o,), (t,) = o, t
  if k.full_shape[o] % GEMM_VEC or k.full_shape[t] % GEMM_TOKENS: return None
  alt = k.copy()
  try:
    # tokens first: the accumulators are then laid out token-major, and clang vectorizes them along the outputs
    for opt in [Opt(OptOps.UPCAST, t, GEMM_TOKENS), Opt(OptOps.UPCAST, o, GEMM_VEC)]: alt.apply_opt(opt)
    for opt in _threads(alt, o): alt.apply_opt(opt)
  except KernelOptError: return None
  return alt

def _stride1(b: UOp, k: Scheduler) -> list[int]:
  return [a for a in range(len(k.rngs)) if any(c is k.rngs[a] for c in b.src[1].get_idx().split_uop(Ops.ADD))]

def _transposing_unpack(k: Scheduler) -> Scheduler | None:
  """Unpacking a weight into a float32 buffer transposed (`[in, out]`, for the GEMM): the heuristic sweeps all rows
  per few values, reading one byte per row each time. 16 output rows by a whole run of the packed bytes per
  iteration reads every byte once and writes 64-byte runs (a 9728x896 Q5_0 weight: 6.5 -> 3.6 ms on 2 cores)."""
  packed = [b for b in k.bufs if b.src[0].dtype.itemsize == 1]
  if k.unrollable_dims or not packed or not isinstance(k.full_shape[0], int): return None
  lanes = sorted({a for b in packed for a in _stride1(b, k)})
  outs = [a for b in k.bufs if b.src[0].dtype == dtypes.float32 for a in _stride1(b, k) if a not in lanes]
  if len(lanes) != 1 or len(outs) != 1 or k.full_shape[outs[0]] % GEMM_VEC or k.full_shape[lanes[0]] > 32: return None
  alt = k.copy()
  try:
    for opt in [Opt(OptOps.UPCAST, outs[0], GEMM_VEC), Opt(OptOps.UPCAST, lanes[0], 0)] + _threads(k, 0): alt.apply_opt(opt)
  except KernelOptError: return None
  return alt

def cpu_heuristic(k: Scheduler) -> Scheduler:
  if not getattr(k.ren, "has_threads", False): return _hand_coded(k)
  return _gemm(k) or _transposing_unpack(k) or _lanes_first(k, _hand_coded(k))

def _init_worker():
  _init_tinygrad_worker()
  install()

def install():
  """Idempotent. tinygrad looks the heuristic up in its module for each kernel, so this takes effect for new kernels,
  also in tinygrad's compile workers: they are spawned processes, started with this module's initializer."""
  heuristic.hand_coded_optimizations = cpu_heuristic
  worker._init_worker = _init_worker
