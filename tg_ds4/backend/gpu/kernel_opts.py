"""tinygrad's kernel heuristic on GPU renderers, for the one shape it gets badly wrong there: a GEMV over packed
weights (a quantized matmul for one token).

tinygrad's matvec opts (a few threads split each row's reduce, rows grouped into workgroups) apply only when both
operands of the multiply are plain loads. A packed weight's unpacking hides that pattern, so the heuristic treats the
kernel as an elementwise one: each thread walks whole rows alone, its neighbours reading other rows a row's bytes
apart, and small masked axes are upcast whole. For the gathered expert GEMVs (the masked axis is the 6 selected
experts) that gave 384 accumulators a thread and 11 workgroups of 32 threads for the whole GPU.

Here such a kernel gets up to `THREADS` threads per row on the axis of its outer reduce (tinygrad groups only a reduce
that is not nested in another), their partial sums meeting in shared memory, and `WORKGROUP` threads per workgroup
over several rows. In quant/formats.py's GPU form of a format with 32-value blocks the outer reduce is over the blocks:
each thread takes whole blocks (as many threads as divide the row's blocks, up to 32), its block's values unrolled
(`UNROLL` at most), so it issues a block's loads at once and unpacks each byte once. In the CPU's lane form the outer
reduce is along a block's bytes: adjacent threads read adjacent bytes, each unpacking one byte of every block. Only
GEMVs: a kernel whose output axes all move the weight and whose largest byte buffer is its packed weight, or a batched
step's GEMV, whose token axis (at most `ROWS` rows) is upcast first, so each thread unpacks a weight byte once for every
row (left to tinygrad, each thread walked whole rows as above). Everything else
keeps tinygrad's choices. (Measured on an H200: README, GPU.)

A reduction with few outputs over a long axis (a norm's sum of squares, MLA's 512-wide latent norm, deepseek4's
hyper-connection mixes over 4 streams x 4096 values, a router's logits) is given up to `REDUCE_THREADS` threads per
output (`wide_reduce`: 64 under 2048 values, 128 up to 4096, 256 beyond, as the loads each thread waits on balance the
partials one thread then adds up): tinygrad
gives it 16, each then waiting on its 1/16 of the row one load at a time (a 2048-wide norm: 128 dependent loads on 16
threads, 10-20 us on an H200 where a launch takes 2-3).

One more rule for every reducing kernel on these renderers (`broadcast_rows`): a small output axis that no reduction
reads (deepseek4's hyper-connection streams, each the same GEMV's output plus its own mix of the old streams) is
upcast before anything else, so each thread computes the reduction once for all of the axis. Left a launch axis, each
stream's threads ran the whole GEMV again: 4x the work and the weight reads for one output."""
from __future__ import annotations

from tg_ds4.backend.compat import AxisType, KernelOptError, Ops, Opt, OptOps, Scheduler, prod

THREADS, WORKGROUP = 32, 128  # threads per row at most (the grouped axis must divide by it), threads per workgroup
BROADCAST = 8                 # a broadcast output axis (or several) at most this long is upcast whole (`broadcast_rows`)
REDUCE_THREADS = 256          # threads sharing one output of a wide reduction (`wide_reduce`)
WIDE = 512                    # a reduction this long or longer, with few outputs, is a wide one
UNROLL = 32                   # values of a block a thread unpacks at once (Q4_0's 2 x 16 nibbles)
ROWS = 8                      # a token axis this long is a batched step's rows (runtime/runner.py's BATCHES); longer, a prefill chunk
NESTED = (AxisType.REDUCE, AxisType.UNROLL, AxisType.GROUP_REDUCE)

def weight_operand(k: Scheduler):  # the operand that streams from memory: the largest buffer (both heuristics)
  return max(k.bufs, key=lambda b: b.src[0].max_numel() * b.src[0].dtype.itemsize)

def _divisor(n: int, most: int) -> int:
  """The largest power of two <= most dividing n, else n's largest divisor <= most."""
  return next((d for d in (32, 16, 8, 4, 2) if d <= most and n % d == 0), None) or max(d for d in range(1, most + 1) if n % d == 0)

def broadcast_rows(k: Scheduler) -> Scheduler:
  """`k` with its small output axes that no reduction reads upcast (see the module docstring); `k` itself when there are
  none or the upcast does not apply."""
  if not getattr(k.ren, "has_local", False) or getattr(k.ren, "has_threads", False): return k
  reduces = [u for u in k.ast.backward_slice if u.op is Ops.REDUCE]
  if not reduces: return k
  read = set().union(*(u.backward_slice for u in reduces))
  axes = [a for a in k.axes_of(AxisType.GLOBAL) if isinstance(k.full_shape[a], int) and k.rngs[a] not in read]
  if not axes or prod(k.full_shape[a] for a in axes) > BROADCAST: return k
  alt = k.copy()
  try:
    for r in [k.rngs[a] for a in axes]: alt.apply_opt(Opt(OptOps.UPCAST, alt.rngs.index(r), 0))
  except KernelOptError: return k
  return alt

def packed_gemv(k: Scheduler) -> Scheduler | None:
  """The opts for a packed-weight GEMV on a GPU renderer; None for any other kernel."""
  ren = k.ren
  if getattr(ren, "has_threads", False) or not ren.has_local or not ren.has_shared: return None
  if k.reduceop is None or k.reduceop.arg[0] is not Ops.ADD or not k.full_shape: return None
  if not all(isinstance(s, int) for s in k.full_shape): return None
  # the packed weight: the largest buffer of bytes (a larger float table can be fused in and read one row: V4's
  # hash-routed layers read the token's row of the embedding)
  if not (packed := [b for b in k.bufs if b.src[0].dtype.itemsize == 1]): return None
  weight = max(packed, key=lambda b: b.src[0].max_numel())
  outs, seen = k.axes_of(AxisType.GLOBAL), weight.src[1].get_idx().backward_slice
  if tokens := [k.rngs[a] for a in outs if k.rngs[a] not in seen]:  # axes that do not move the weight: rows of x
    if len(tokens) == len(outs) or prod(r.vmax + 1 for r in tokens) > ROWS: return None  # a prefill chunk
    k = k.copy()
    try:
      for r in tokens: k.apply_opt(Opt(OptOps.UPCAST, k.rngs.index(r), 0))
    except KernelOptError: return None
    outs = k.axes_of(AxisType.GLOBAL)
  red = k.axes_of(AxisType.REDUCE)
  if not outs or not red: return None
  # tinygrad groups only a reduce not nested in another: the outer one of a packed dot (the inner sums a block's values)
  outer = [u for u in k.ast.backward_slice if u.op is Ops.REDUCE and not any(r.arg[-1] in NESTED for r in u.ranges)]
  # (a second one, such as the routed experts' weighted sum fused into the shared expert's down GEMV, stays a loop)
  axes = [k.rngs.index(r) for u in outer for r in u.src[1:] if r in k.rngs]
  if len(axes) > 1: axes = [a for a in axes if k.rngs[a] in seen]
  if len(axes) != 1 or axes[0] not in red: return None
  alt = k.copy()
  # a block axis (the outer sum of quant/formats.py's GPU form): the values of a thread's block unrolled, so that each
  # thread issues its block's loads at once rather than one loop iteration after another
  inner = [r for u in k.ast.backward_slice if u.op is Ops.REDUCE and u not in outer for r in u.src[1:] if r in k.rngs]
  blocks = bool(inner) and k.rngs[axes[0]] not in inner and prod(r.vmax + 1 for r in inner) <= UNROLL
  try:
    n = alt.full_shape[axes[0]]
    # blocks: the most threads that divide them (a 10944-wide row's 342 blocks: 19 threads, not 2); bytes: a power of two
    g = max(d for d in range(1, THREADS + 1) if n % d == 0) if blocks else _divisor(n, THREADS)
    if g > 1: alt.apply_opt(Opt(OptOps.GROUP, red.index(axes[0]), g))
    for rid in [r.arg[0] for r in inner] if blocks else []:  # found by range id: an opt moves the axes it leaves
      alt.apply_opt(Opt(OptOps.UNROLL, alt.unrollable_dims.index(next(i for i, r in enumerate(alt.rngs) if r.arg[0] == rid)), 0))
    rows = max(outs, key=lambda a: alt.full_shape[a])
    if (l := _divisor(alt.full_shape[rows], max(1, WORKGROUP // g))) > 1: alt.apply_opt(Opt(OptOps.LOCAL, rows, l))
  except KernelOptError: return None
  return alt

def wide_reduce(k: Scheduler) -> Scheduler | None:
  """The opts for a reduction with few outputs over a long axis (see the module docstring): a reduce axis split over
  up to REDUCE_THREADS threads (GROUPTOP; the first that tinygrad can group, the one a nested reduction does not sit
  in), its partial sums then added up by one thread from shared memory; None for any other kernel (then tinygrad's
  heuristic)."""
  ren = k.ren
  if getattr(ren, "has_threads", False) or not ren.has_local or not ren.has_shared or k.reduceop is None: return None
  if not all(isinstance(s, int) for s in k.full_shape): return None
  red = k.axes_of(AxisType.REDUCE)
  n = prod(k.full_shape[a] for a in red)
  if not red or prod(k.full_shape[a] for a in k.axes_of(AxisType.GLOBAL)) > 2048 or n < WIDE: return None
  # threads per output: the loads each thread waits on (length / g) against the partials one thread adds up (g)
  most = REDUCE_THREADS if n > 4096 else REDUCE_THREADS // 2 if n >= 2048 else REDUCE_THREADS // 4
  for i, a in enumerate(red):
    if (g := next((d for d in (256, 128, 64, 32) if d <= most and k.full_shape[a] % d == 0), 0)) == 0: continue
    alt = k.copy()
    try: alt.apply_opt(Opt(OptOps.GROUPTOP, i, g))
    except KernelOptError: continue
    return alt
  return None
