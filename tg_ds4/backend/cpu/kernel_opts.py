"""Two changes to tinygrad's hand-coded kernel heuristic on CPU renderers, for the two matmul shapes of inference.

GEMV (one token): quant/formats.py's `linear` writes it so that each output row keeps `LANES` independent accumulators
(the unrolled last reduce axis), which the C compiler turns into vector multiply-adds along the row's contiguous bytes.
tinygrad's heuristic then also upcasts the output rows by 4 (x is broadcast along them), giving 4 x 16 accumulators,
and clang's SLP vectorizer vectorizes across the 4 rows instead, with one byte insert per element where a row's run of
bytes would be one vector load (every packed format measured, Q8_0, Q4_1, Q5_0, Q4_K and Q6_K, lost by it). So when a
kernel keeps at least `LANES` accumulators from its unrolled reduce alone, the heuristic's upcasts along axes where
the weight (the largest buffer) moves are dropped; its other choices (the unroll, the split over cores, an upcast over
tokens, which reuses each weight) are kept, and the block's small axes inside the lanes are unrolled as well
(`_unroll_lanes`).

GEMM (a prefill chunk): nn/layers.py's `Linear` dequantizes the weight once into a float32 `[in, out]` buffer. For a
kernel contracting such a weight (contiguous along its one output axis) with tokens along another output axis, the
heuristic builds dot products along the reduce axis. Instead each iteration here holds a group of tokens x outputs (a
vector per token, one weight load for a multiply-add per token), the accumulators filling about half the vector
registers: 8 tokens x 16 outputs where there are 32 (AVX-512, NEON; on AVX-512, 8 tokens beat 4 on qwen2.5's and
smollm2's chunk GEMMs, each weight load serving twice the tokens), 4 x 16 where there are 16 256-bit ones (AVX2: two
ymm of outputs per token, so each multiply-add needs half a broadcast where 8 x 8 needed one).
tinygrad coalesces float accesses into at most 4 floats, from which clang builds 128-bit multiply-adds; on CPUs with
256-bit vectors `_wide_access` joins adjacent ones into 8, and the accumulators live in ymm registers.

Upcasts never change the order in which an output is summed, and an unrolled reduce is rendered as one left-to-right
accumulator chain (`acc + a + b`), so results are bitwise the same. Kernels tuned by BEAM are not touched."""
import collections, functools, logging, os, pathlib, platform
from dataclasses import dataclass

from tinygrad import dtypes

from tg_ds4.backend.cpu import compiler
from tg_ds4.backend.gpu import kernel_opts as gpu_kernel_opts
from tg_ds4.backend.gpu.kernel_opts import NESTED, weight_operand
from tg_ds4.backend.compat import AddrSpace, AxisType, ClangRenderer, KernelOptError, Opt, OptOps, Ops, PatternMatcher, Scheduler, UOp, UPat, \
  codegen, graph_rewrite, heuristic, no_tf32_on_null_cuda, prod, remove_all_tags, strip_parens, worker

LANES = 16
# a packed format whose lane axis is shorter than LANES (IQ2_XXS: a grid row of 8) still gains from dropping the row
# upcast: 8 accumulators per row fill a 256-bit vector (as measured on V4's IQ2_XXS experts)
PACKED_MIN_LANES = 8
GEMV_SMALL_AXIS, GEMV_MAX_UNROLL = 4, 32  # layout axes up to this size are unrolled in a GEMV, up to this many products
GEMV_ROWS = 4  # rows of x a packed GEMV holds in registers at once: 4 x LANES accumulators, half of AVX2's 16 vector registers

@functools.cache
def _cpu_flags() -> str:
  try: return pathlib.Path("/proc/cpuinfo").read_text()
  except OSError: return ""

@dataclass(frozen=True)
class VectorUnit:
  """What the heuristic needs to know of this CPU's SIMD unit (the C compiler targets -march=native)."""
  name: str
  registers: int  # 32 with AVX-512 or on arm64, else 16
  floats: int     # float32 lanes the C compiler uses by default: 8 with AVX2/AVX-512, else 4

  @property
  def gemm(self) -> tuple[int, int]:
    """(tokens, outputs) of a GEMM iteration: the accumulators fill half the vector registers; the rest hold the weight
    row, the broadcast token values and the addresses. More tokens per weight pass mean fewer passes over the weight."""
    return (8, 16) if self.registers >= 32 else (4, 16)

  @property
  def panel(self) -> int:
    """Outputs per panel of a prefill GEMM's unpacked weight (quant/formats.py's panel_gemm): a GEMM iteration's outputs, or on AVX2
    one ymm of them, two panels an iteration (16-float panels slowed the transposing unpack, and changed how the
    chunk's MLA query concatenation, which reads a panel GEMM's output, is split)."""
    return 8 if self.floats == 8 and self.registers < 32 else self.gemm[1]

AVX512, AVX2, NEON, SSE = VectorUnit("avx512", 32, 8), VectorUnit("avx2", 16, 8), VectorUnit("neon", 32, 4), VectorUnit("sse", 16, 4)

def detect() -> VectorUnit:
  if platform.machine().lower() in ("arm64", "aarch64"): return NEON
  flags = _cpu_flags()
  return AVX512 if " avx512f" in flags else AVX2 if " avx2" in flags and platform.machine().lower() in ("x86_64", "amd64") else SSE

CPU = detect()  # read at each use, so a test can force another CPU kind
UNPACK_ROWS = 16
_hand_coded, _init_tinygrad_worker = heuristic.hand_coded_optimizations, worker._init_worker
_tinygrad_coalescing = codegen.memory_coalescing
_clang_extra = ClangRenderer.extra_matcher
_clang_strings = ClangRenderer.string_rewrite

def _ints(k: Scheduler, axes) -> bool: return all(isinstance(k.full_shape[a], int) for a in axes)

def _lanes_first(k: Scheduler, out: Scheduler) -> Scheduler:
  if not any(o.op is OptOps.UPCAST for o in out.applied_opts): return out
  alt, weight = k.copy(), weight_operand(k)
  try:
    for o in out.applied_opts:
      if o.op is not OptOps.UPCAST or alt.rngs[alt.real_axis(o.op, o.axis)] not in weight.src[1].get_idx().backward_slice: alt.apply_opt(o)
  except KernelOptError: return out
  lanes = prod(alt.full_shape[a] for a in alt.axes_of(AxisType.UNROLL))
  return alt if lanes >= LANES or (lanes >= PACKED_MIN_LANES and weight.src[0].dtype.itemsize == 1) else out

def _unroll_lanes(k: Scheduler) -> Scheduler:
  """A GEMV's small layout axes unrolled inside the lanes (a Q4_1 block's two nibbles): the heuristic unrolls only the
  lane axis and loops over the nibble with a variable shift. Unrolled, each iteration is straight-line code over
  both nibbles with constant shifts, with no loop counter or shift amount to compute. The sum order is unchanged."""
  if prod(k.full_shape[a] for a in k.axes_of(AxisType.UNROLL)) < LANES: return k
  alt = k.copy()
  while alt.unrollable_dims and isinstance(n := alt.full_shape[alt.unrollable_dims[-1]], int) and n <= GEMV_SMALL_AXIS and \
      prod(alt.full_shape[a] for a in alt.axes_of(AxisType.UNROLL)) * n <= GEMV_MAX_UNROLL:
    try: alt.apply_opt(Opt(OptOps.UNROLL, len(alt.unrollable_dims) - 1, 0))
    except KernelOptError: return k
  # a block's values that share a lane, summed before the block's scale (quant/formats.py's affine `linear`), are a reduce
  # nested in the blocks' loop: looped, their 16 partial sums go through memory each block instead of staying in registers
  for i in reversed(range(len(alt.unrollable_dims))):
    ax = alt.unrollable_dims[i]
    if isinstance(n := alt.full_shape[ax], int) and n <= GEMV_SMALL_AXIS and _nested_reduce(alt, ax) and \
        prod(alt.full_shape[a] for a in alt.axes_of(AxisType.UNROLL)) * n <= GEMV_MAX_UNROLL:
      try: alt.apply_opt(Opt(OptOps.UNROLL, i, 0))
      except KernelOptError: return k
  return alt

def _nested_reduce(k: Scheduler, axis: int) -> bool:
  """Whether `axis` is summed by a reduce inside another reduce's loop."""
  r = k.rngs[axis]
  return any(u.op is Ops.REDUCE and r in u.src[1:] and any(o.arg[-1] in NESTED for o in u.ranges) for u in k.ast.backward_slice)

def _threads(k: Scheduler, axis: int) -> list[Opt]:
  if not isinstance(size := k.full_shape[axis], int): return []
  n = max((n for n in range(1, (k.ren.global_max or (1,))[0] + 1) if size % n == 0), default=1)
  return [Opt(OptOps.THREAD, axis, n)] if n > 1 else []

def _gemm(k: Scheduler) -> Scheduler | None:
  """The GEMM opts for a float32 weight contiguous along its one output axis, tokens along the other; None otherwise.
  A batch axis (one matrix per attention head: MLA's absorb weights over a chunk) indexes the weight and the tokens'
  input alike and stays a loop around the GEMM. The weight is the largest input; of two as large, either (attn_v_b's
  latent input is as big as its weight). The reduce may have a symbolic size (attention's probabilities times the
  cached values, over the positions so far)."""
  if len(k.axes_of(AxisType.GROUP_REDUCE, AxisType.REDUCE)) != 1: return None
  stores = {u.src[0] for u in k.ast.toposort() if u.op is Ops.STORE}
  inputs = [b for b in k.bufs if b not in stores]
  most = max((b.src[0].max_numel() for b in inputs), default=0)
  for weight in [b for b in inputs if b.src[0].dtype == dtypes.float32 and b.src[0].max_numel() == most]:
    if (alt := _gemm_on(k, weight, [b for b in inputs if b is not weight])) is not None: return alt
  return None

def _gemm_on(k: Scheduler, weight: UOp, others: list[UOp]) -> Scheduler | None:
  idx = weight.src[1].get_idx()
  outs = [a for a in k.upcastable_dims if isinstance(k.full_shape[a], int)]
  ws = [a for a in outs if k.rngs[a] in idx.backward_slice]
  t = [a for a in outs if k.rngs[a] not in idx.backward_slice]
  o = [a for a in ws if any(c is k.rngs[a] for c in idx.split_uop(Ops.ADD))]  # the weight's stride-1 output axis
  # (the other operand of the product is the input indexed by the reduce axis too; a residual added after is not)
  reduce = k.rngs[k.axes_of(AxisType.GROUP_REDUCE, AxisType.REDUCE)[0]]
  xs = [b.src[1].get_idx().backward_slice for b in others if reduce in b.src[1].get_idx().backward_slice]
  batch = [a for a in ws if a not in o and any(k.rngs[a] in x for x in xs)]
  # a `[in, out]` weight has that one output axis; a panel copy (`[out / n, in, n]`, quant/formats.py's panel_gemm) a second, the
  # panel, which is then the axis split over the cores
  if len(t) != 1 or len(o) != 1 or len(ws) - len(batch) > 2: return None
  (o,), (t,), (tokens, vec) = o, t, CPU.gemm
  panel = next((a for a in ws if a != o and a not in batch), None)
  # a panel narrower than an iteration's outputs (AVX2: panels of 8, 16 outputs) gives it that many adjacent panels
  n = vec if panel is None else k.full_shape[o]
  if vec % n or k.full_shape[o] % n or k.full_shape[t] % tokens or (panel is not None and k.full_shape[panel] % (vec // n)): return None
  alt = k.copy()
  try:
    # tokens first: the accumulators are then laid out token-major, and clang vectorizes them along the outputs
    opts = [Opt(OptOps.UPCAST, t, tokens)] + ([Opt(OptOps.UPCAST, panel, vec // n)] if vec > n else []) + [Opt(OptOps.UPCAST, o, n)]
    for opt in opts: alt.apply_opt(opt)
    # panels outermost: a panel then stays in cache while every token passes it; with the tokens outermost (the order
    # of a GEMM whose output is stored token-major) each group of tokens streams the whole weight again
    if panel is not None and t < panel: panel = _swap_loops(alt, t, panel)
    for opt in _threads(alt, o if panel is None else panel): alt.apply_opt(opt)
  except KernelOptError: return None
  return alt

def _swap_loops(k: Scheduler, a: int, b: int) -> int:
  """OptOps.SWAP for loop axes (tinygrad allows it for GPU launch axes only): the two ranges trade their places in the
  loop nest, and so their axis numbers; returns where axis `b` now is."""
  ra, rb = k.rngs[a], k.rngs[b]
  k.ast = graph_rewrite(k.ast.substitute({ra: ra.replace(arg=(*rb.arg[:-1], ra.arg[-1]), tag=1),
                                          rb: rb.replace(arg=(*ra.arg[:-1], rb.arg[-1]), tag=1)}), remove_all_tags)
  return a

def _stride1(b: UOp, k: Scheduler) -> list[int]:
  return [a for a in range(len(k.rngs)) if any(c is k.rngs[a] for c in b.src[1].get_idx().split_uop(Ops.ADD))]

def _transposing_unpack(k: Scheduler) -> Scheduler | None:
  """Unpacking a weight into a float32 buffer transposed (`[in, out]`, for the GEMM): the heuristic sweeps all rows
  per few values, reading one byte per row each time. 16 output rows by a whole run of the packed bytes per
  iteration reads every byte once and writes 64-byte runs."""
  packed = [b for b in k.bufs if b.src[0].dtype.itemsize == 1]
  # (a kernel may have no axes at all, a scalar one; or symbolic sizes, from a captured step's position)
  if k.unrollable_dims or not packed or not k.full_shape or not _ints(k, range(len(k.full_shape))): return None
  lanes = sorted({a for b in packed for a in _stride1(b, k)})
  outs = [a for b in k.bufs if b.src[0].dtype == dtypes.float32 for a in _stride1(b, k) if a not in lanes]
  # (a panel copy's output axis is a whole panel: 8 or 16 rows)
  if len(lanes) != 1 or len(outs) != 1 or (rows := min(UNPACK_ROWS, k.full_shape[outs[0]])) < 8 or k.full_shape[outs[0]] % rows or \
      k.full_shape[lanes[0]] > 32: return None
  alt = k.copy()
  try:
    for opt in [Opt(OptOps.UPCAST, outs[0], rows), Opt(OptOps.UPCAST, lanes[0], 0)] + _threads(k, 0): alt.apply_opt(opt)
  except KernelOptError: return None
  return alt

def _rows_first(k: Scheduler) -> Scheduler:
  """A packed GEMV over a few rows of x (a batched decode step, nn/cache_rows.py): the rows' axis upcast whole before the
  heuristic's own choices, so each unpacked weight value feeds every row from registers and the split over the cores
  goes to the weight's rows. Left to itself the heuristic upcasts only axes of 3 or 4 and splits the first axis it can
  over the cores: 2 rows of smollm2's gate|up then ran one row per core, each core unpacking the whole weight, where
  with the rows upcast each core unpacks only its share of it once for all rows. Kernels without such an axis (every
  one-token kernel) are untouched."""
  if k.reduceop is None or not k.unrollable_dims or (weight := weight_operand(k)).src[0].dtype.itemsize != 1: return k
  idx = weight.src[1].get_idx().backward_slice
  rows = [a for a in k.upcastable_dims if k.rngs[a] not in idx and isinstance(n := k.full_shape[a], int) and 1 < n <= GEMV_ROWS]
  if len(rows) != 1: return k
  alt = k.copy()
  try: alt.apply_opt(Opt(OptOps.UPCAST, rows[0], 0))
  except KernelOptError: return k
  return alt

QUERY_ROWS = 4

def _query_rows(k: Scheduler) -> Scheduler:
  """Lane dot products of several query rows against one float32 operand that does not move with them (a chunk's
  attention scores against the cached keys, quant/formats.py's dot_lanes): QUERY_ROWS rows upcast, so each loaded
  run of keys serves that many queries and their accumulator chains interleave. Left alone, each score is one chain
  of vector multiply-adds, each waiting on the one before, and the keys are read again for every query row."""
  if k.reduceop is None or prod(k.full_shape[a] for a in k.axes_of(AxisType.UNROLL)) < PACKED_MIN_LANES: return k
  stores = {u.src[0] for u in k.ast.toposort() if u.op is Ops.STORE}
  keys = max((b for b in k.bufs if b not in stores), key=lambda b: b.src[0].max_numel() * b.src[0].dtype.itemsize, default=None)
  if keys is None or keys.src[0].dtype != dtypes.float32 or k.axes_of(AxisType.UPCAST): return k
  idx = keys.src[1].get_idx().backward_slice
  rows = [a for a in k.upcastable_dims if k.rngs[a] not in idx and isinstance(n := k.full_shape[a], int) and n % QUERY_ROWS == 0]
  if not rows or QUERY_ROWS < 2: return k
  alt = k.copy()
  try: alt.apply_opt(Opt(OptOps.UPCAST, rows[-1], QUERY_ROWS))
  except KernelOptError: return k
  return alt

def rules(k: Scheduler) -> Scheduler:
  """Our choices for a CPU kernel of any shape (tinygrad's heuristic where no rule applies)."""
  return _gemm(k) or _transposing_unpack(k) or _query_rows(_unroll_lanes(_lanes_first(k, _hand_coded(_rows_first(k)))))

def cpu_heuristic(k: Scheduler) -> Scheduler:
  """`rules` on CPU renderers, backend/gpu/kernel_opts.py's packed GEMVs on the others. Should a rule still fail on a
  kernel shape nobody foresaw, that kernel gets tinygrad's own choices and one warning instead of failing the step that
  contains it (a model that cannot sample is worse than one slower kernel); the tests call `rules` itself, so they see
  any such failure."""
  try:
    if not getattr(k.ren, "has_threads", False):
      k = gpu_kernel_opts.broadcast_rows(k)
      return gpu_kernel_opts.packed_gemv(k.copy()) or gpu_kernel_opts.wide_reduce(k.copy()) or _hand_coded(k)
    return rules(k.copy())
  except Exception as e:  # noqa: BLE001
    _warn_once(f"kernel_opts: {type(e).__name__}: {e} on a kernel of shape {tuple(k.full_shape)}; tinygrad's heuristic used for it")
    return _hand_coded(k)

@functools.cache
def _warn_once(msg: str): logging.getLogger("tg_ds4").warning(msg)

def _init_worker():
  _init_tinygrad_worker()
  no_tf32_on_null_cuda()  # a worker lowering for NULL:CUDA lowers as a GPU would (the parent's renderer is rebuilt here)
  install()

def _wide_access(sink: UOp) -> UOp:
  """Two adjacent 4-float loads or stores -> one of 8 floats. tinygrad coalesces float accesses into at most 4 on
  every device, and clang then builds 128-bit multiply-adds even where the CPU has 256-bit ones; given 8-float
  stores of the chunk GEMM's outputs and 8-float loads of its weight row, it vectorizes the accumulators in ymm
  registers. Offsets must divide by 8 as buffers are 32-byte aligned (tinygrad allocates whole pages and plans its
  arenas in 256-byte blocks; io/gguf.py copies a misaligned mapped tensor)."""
  found: dict[tuple, UOp] = {}
  users: collections.defaultdict[UOp, list[UOp]] = collections.defaultdict(list)
  for u in sink.toposort():
    for s in u.src:
      if s.op is Ops.LOAD: users[s].append(u)
    if u.op not in (Ops.LOAD, Ops.STORE) or (sh := u.src[0]).op is not Ops.SHRINK or sh.src[0].dtype != dtypes.float: continue
    if sh.src[2].op is not Ops.CONST or sh.src[2].arg != 4 or (u.op is Ops.STORE and u.src[1].op is not Ops.STACK): continue
    idx, valid = sh.src[1].get_idx(), sh.src[1].get_valid()
    if idx.op is Ops.ADD and idx.src[1].op is Ops.CONST: root, off = idx.src[0], idx.src[1].arg
    elif idx.op is Ops.CONST and isinstance(idx.arg, int): root, off = None, idx.arg
    else: root, off = idx, 0
    found[(u.op, sh.src[0], root, valid, off)] = u
  repl: dict[UOp, UOp] = {}
  for (op, buf, root, valid, off), lo in found.items():
    if lo in repl or (hi := found.get((op, buf, root, valid, off + 4))) is None or hi in repl: continue
    start = UOp.const(off) if root is None else root + off if off else root
    if start.divides(8) is None: continue
    wide_idx = UOp(Ops.SHRINK, src=(buf, start.valid(valid) if valid is not None else start, UOp.const(8)))
    if op is Ops.STORE: repl[lo] = repl[hi] = wide_idx.store(UOp.stack(*lo.src[1].src, *hi.src[1].src))
    elif all(x.op is Ops.INDEX and x.src[1].op is Ops.CONST for x in users[lo] + users[hi]):
      wide = wide_idx.load()
      repl.update({x: wide.index(x.src[1].arg + half) for ld, half in ((lo, 0), (hi, 4)) for x in users[ld]})
      repl[lo] = repl[hi] = wide  # taken (the loads themselves are replaced through their users)
  for ld in [k for k in repl if k.op is Ops.LOAD]: del repl[ld]
  return sink.substitute(repl, name="wide accesses") if repl else sink

def _reduce_key(t: UOp) -> tuple[int, ...]:
  if t.op is Ops.CONST: return (2,)
  ids = [u.arg[0] for u in t.toposort() if u.op is Ops.RANGE and u.arg[-1] is AxisType.REDUCE]
  return (1, max(ids)) if ids else (0,)

def _reduce_terms_last(x: UOp) -> UOp | None:
  """An int address `a + r*s + b + c` with `r` a reduce loop and `c` a constant -> `a + b + r*s + c`. clang's SLP vectorizer joins the loads of
  `addr+1`, `addr+2`, ... into one vector load only if it can prove them consecutive after sign extension, which LLVM's
  reassociation of a loop-invariant term past the loop's own one breaks: the Q8_0 bytes of V4's grouped output LoRA
  were then loaded one `vpinsrb` at a time, where the same GEMV ungrouped loads them as vectors. Terms keep their order otherwise,
  the inner loop's last, so nothing is reassociated."""
  if x.dtype not in (dtypes.int, dtypes.long) or x.src[0].op is not Ops.ADD: return None
  terms = list(x.split_uop(Ops.ADD))
  order = sorted(terms, key=_reduce_key)
  if order == terms: return None
  return functools.reduce(lambda a, b: a + b, order)

_ADDRESSES = PatternMatcher([(UPat(Ops.ADD, name="x"), _reduce_terms_last)])
CLANG_EXTRA = _clang_extra + _ADDRESSES  # one object, so that backend/programs.py can tell it is ours

def _accumulator(u: UOp) -> bool:
  """Whether `u` loads a reduce's accumulator (a register buffer)."""
  if u.op is not Ops.LOAD or u.src[0].op is not Ops.INDEX: return False
  b = u.src[0].src[0]
  while b.op is Ops.AFTER: b = b.src[0]
  return b.op is Ops.BUFFER and getattr(b.arg, "addrspace", None) is AddrSpace.REG

def _float_in_order(ctx, x: UOp) -> str | None:
  """A float add or multiply rendered as the graph orders it. tinygrad's C renderer drops the parentheses of an operand
  that is the same associative op, on either side: `x * (d * q)`, with `d * q` inlined, became `x * d * q`, which C
  evaluates as `(x * d) * q`. Whether `d * q` is inlined depends on how many uses it has: one row's GEMV inlined a
  weight value that a batched step's rows share, so the same row's products differed by an ulp batched and alone. Only
  the left operand's parentheses go, so C's left-to-right evaluation is the graph's; except where an unrolled reduce
  adds its values to its accumulator, `acc + (a + b)`, rendered `acc + a + b` as tinygrad does: the order of the same
  reduce looped, so the heuristic's unroll never changes a sum."""
  if not dtypes.is_float(x.dtype) or (x.op is Ops.ADD and _accumulator(x.src[0])): return None
  a, b = (ctx[v] for v in x.src)
  return ctx.code_for_op[x.op](strip_parens(a) if x.src[0].op is x.op else a, b, x.dtype)

FLOAT_IN_ORDER = os.environ.get("TG_DS4_FLOAT_IN_ORDER", "1") != "0"
CLANG_STRINGS = PatternMatcher([(UPat((Ops.ADD, Ops.MUL), name="x"), _float_in_order)]) + _clang_strings

def _memory_coalescing(sink: UOp, ren) -> UOp:
  out = _tinygrad_coalescing(sink, ren)
  return _wide_access(out) if getattr(ren, "has_threads", False) and CPU.floats == 8 else out

def install():
  """Idempotent. tinygrad looks the heuristic up in its module for each kernel, so this takes effect for new kernels,
  also in tinygrad's compile workers: they are spawned processes, started with this module's initializer. A pool that
  already runs (something was lowered before the model was loaded) is shut down first: its workers run the stock
  heuristic, and one it respawned later (tinygrad recycles a worker after 16 tasks) would fail to pickle the stock
  initializer, whose name then names ours, killing the pool's worker thread: the next compile waited forever."""
  if heuristic.hand_coded_optimizations is not cpu_heuristic: worker.terminate_worker_pool()
  heuristic.hand_coded_optimizations = cpu_heuristic
  compiler.install()
  codegen.memory_coalescing = _memory_coalescing
  worker._init_worker = _init_worker
  ClangRenderer.extra_matcher = CLANG_EXTRA
  if FLOAT_IN_ORDER: ClangRenderer.string_rewrite = CLANG_STRINGS
