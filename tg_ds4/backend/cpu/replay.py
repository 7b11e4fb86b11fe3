"""A captured step's native, multi-core replay on the CPU device (`fast`, used by runtime/jit.py's Jit for CPU models).

tinygrad 0.14's CPU device has no graph executor: a replayed TinyJit walks its captured calls in Python, resolving
buffers, symbolic sizes and statistics for every kernel (Python work repeated for each of a decode step's hundreds of
kernels, every step), and it calls the parts of a kernel that tinygrad split over cores (the THREAD opt, one call per
`core_id`) one after another, so a step uses one core. After capture, `Jit` hands runs of plain CPU kernels to
`cpu_runner.c`: the same compiled functions with the same arguments, buffer addresses resolved once, the parts of a
split kernel shared by one thread per core. Per call only the JIT's input buffers and the symbolic values (the
position) are looked up. Anything that is not a plain CPU kernel goes through tinygrad's executor as before, and so
does everything under DEBUG >= 2 or PROFILE (per-kernel timing). GlobalCounters are kept as tinygrad keeps them.
`TG_DS4_FAST_REPLAY=0` turns it off; `TG_DS4_THREADS` sets the thread count (default: tinygrad's NUM_CPU_THREADS, the
parts a kernel is split into)."""
from __future__ import annotations

import collections, ctypes, functools, hashlib, os, pathlib, subprocess, tempfile
from dataclasses import dataclass

from tg_ds4.backend.compat import (DEBUG, MAX_ARGS, NUM_CPU_THREADS, PROFILE, CapturedJit, CPUProgram, ExecContext, GlobalCounters, Ops, UOp,
                           _copy_input, _resolve, estimate_uop, get_call_arg_uops, get_runtime, perf_counter_us, pm_exec, to_tuple,
                           track_stats)
from tg_ds4.backend.cache import cache_dir


def engine_threads() -> int:
  """Threads a replayed CPU step runs on (the roofline in `bench` and `profile` is measured with as many)."""
  return int(os.environ.get("TG_DS4_THREADS", NUM_CPU_THREADS.value))

class _Op(ctypes.Structure):  # op_t in cpu_runner.c
  _fields_ = [("fn", ctypes.c_void_p), ("nargs", ctypes.c_int32), ("parts", ctypes.c_int32), ("core_slot", ctypes.c_int32),
              ("wave", ctypes.c_int32), ("args", ctypes.c_uint64 * MAX_ARGS), ("slot", ctypes.c_int16 * MAX_ARGS)]

@functools.cache
def _runner():
  """cpu_runner.c built with clang (which tinygrad's CPU device needs anyway) into the cache, once per source version."""
  src = pathlib.Path(__file__).with_name("cpu_runner.c")
  so = cache_dir() / f"cpu_runner-{hashlib.sha256(src.read_bytes()).hexdigest()[:16]}.so"
  if not so.exists():
    so.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=so.parent) as d:  # build aside and rename: concurrent first runs never load half a file
      tmp = pathlib.Path(d) / so.name
      subprocess.run([os.environ.get("CC", "clang"), "-O2", "-shared", "-fPIC", "-pthread", "-o", str(tmp), str(src)], check=True,
                     capture_output=True)
      tmp.replace(so)
  fn = ctypes.CDLL(str(so)).tg_ds4_run
  fn.argtypes, fn.restype = [ctypes.POINTER(_Op), ctypes.c_int32, ctypes.POINTER(ctypes.c_uint64), ctypes.c_int32], ctypes.c_int32
  return fn

def _is_input(b: UOp) -> bool: return b.op is Ops.PARAM or any(_is_input(s) for s in b.src if b.op in (Ops.MSELECT, Ops.SHRINK, Ops.MSTACK))

def _extent(b: UOp, dev: str) -> tuple[int, int]:
  """A kernel argument's address and size in bytes. The memory plan's views (a BITCAST of a SHRINK of its byte arena,
  by constants) are the arena's address plus the offset; anything else goes through tinygrad (`UOp.buffer` builds
  each view with a graph rewrite, slow over a step's thousand arguments on its first call)."""
  v = b.src[0] if b.op is Ops.BITCAST else b
  if v.op is Ops.SHRINK and (base := v.src[0]).op is Ops.BUFFER and all(s.op is Ops.CONST and isinstance(s.arg, int) for s in v.src[1:3]):
    return base.buffer.ensure_allocated().get_buf(dev).va_addr + v.src[1].arg * base.dtype.itemsize, v.src[2].arg * base.dtype.itemsize
  buf = b.buffer.ensure_allocated()
  return buf.get_buf(dev).va_addr, buf.nbytes

def _waves(touched: list[tuple[list, list]], parts: list[int]) -> list[int]:
  """For each kernel, how many kernels from it on form a wave (cpu_runner.c): consecutive unsplit kernels none of which
  writes bytes another of them reads or writes, so they may run at once in any order. `touched`: per kernel, what it
  reads and what it writes, each a list of (address, size), or of a JIT input's key (size None: the same key is the
  same buffer). 1 for a kernel that starts no wave (and for the rest of a wave)."""
  def meet(a, b) -> bool:
    if a[1] is None or b[1] is None: return a[1] is None and b[1] is None and a[0][0] is b[0][0] and a[0][1] == b[0][1]
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]
  def clash(a, b) -> bool: return any(meet(w, o) for w in a[1] for o in b[0] + b[1]) or any(meet(w, o) for w in b[1] for o in a[0] + a[1])
  out, i = [1] * len(parts), 0
  while i < len(parts):
    j = i + 1
    if parts[i] == 1:
      while j < len(parts) and parts[j] == 1 and not any(clash(touched[j], touched[m]) for m in range(i, j)): j += 1
    out[i], i = j - i, j
  return out

@dataclass
class _Segment:
  """Consecutive plain CPU kernels, run by one call into cpu_runner."""
  ops: ctypes.Array
  slots: list[tuple[UOp, str] | str]  # what each per-call word is: a JIT input buffer (and device), or a symbolic value's name
  count: int
  ops_est: _Estimate      # for GlobalCounters
  mem_est: _Estimate

class _Estimate:
  """A sum of per-kernel estimates, some symbolic in the position, summed as a constant plus each distinct symbolic term
  times its count (layers repeat the same kernels, so few distinct terms): the naive sum of every kernel's term was
  slow to simplify on a step's first call. Built once; each call evaluates one compiled expression."""
  def __init__(self): self.const, self.terms, self.expr = 0, collections.Counter(), None
  def add(self, x):
    if isinstance(x, int): self.const += x
    else: self.terms[x] += 1
  def __call__(self, var_vals: dict[str, int]) -> int:
    if not self.terms: return self.const
    if self.expr is None: self.expr = functools.reduce(lambda a, b: a + b, (u * n for u, n in self.terms.items()))
    return self.const + int(self.expr.sym_infer(var_vals))

class FastCPUReplay(CapturedJit):
  def _plan(self) -> list[_Segment | UOp]:
    plan: list[_Segment | UOp] = []
    pending: list[tuple[UOp, CPUProgram, str]] = []
    def flush():
      if not pending: return
      slots: list[tuple[UOp, str] | str] = []
      def slot(key) -> int:
        if key not in slots: slots.append(key)
        return slots.index(key)
      ops, ops_est, mem_est, touched = (_Op * len(pending))(), _Estimate(), _Estimate(), []
      for op, (call, rt, dev) in zip(ops, pending):
        info, arg_uops = call.src[0].arg, get_call_arg_uops(call)
        extents = {i: ((b, dev), None) if _is_input(b := arg_uops[i]) else _extent(b, dev) for i in info.globals}
        touched.append(([extents[i] for i in info.ins if i in extents], [extents[i] for i in info.outs if i in extents]))
        # an int is a fixed word (a buffer address; 0 holds core_id's place), anything else the key of a per-call slot
        words: list = [extents[i][0] for i in info.globals]
        words += [0 if v.expr in info.runtimevars else v.expr for v in info.vars]
        op.fn, op.nargs, op.parts = rt.addr, len(words), int(info.global_size[0])
        op.core_slot = rt.runtimevars.get("core_id", -1)
        for i, w in enumerate(words):
          if isinstance(w, int): op.args[i], op.slot[i] = w, -1
          else: op.slot[i] = slot(w)
        est = estimate_uop(call)
        ops_est.add(est.ops); mem_est.add(est.mem)
      for op, wave in zip(ops, _waves(touched, [op.parts for op in ops])): op.wave = wave
      plan.append(_Segment(ops, slots, len(pending), ops_est, mem_est))
      pending.clear()
    for call in self.linear.src:
      ast, devs = call.src[0], to_tuple(call.src[1].device)
      rt = get_runtime(devs[0], ast) if ast.op is Ops.PROGRAM and len(devs) == 1 and devs[0].startswith("CPU") else None
      if isinstance(rt, CPUProgram) and not rt.lvp and isinstance(ast.arg.global_size[0], int) and \
         len(ast.arg.globals) + len(ast.arg.vars) <= MAX_ARGS:
        pending.append((call, rt, devs[0]))
      else:
        flush()
        plan.append(call)
    flush()
    return plan

  def __call__(self, input_uops: list[UOp], var_vals: dict[str, int]):
    if DEBUG >= 2 or PROFILE: return super().__call__(input_uops, var_vals)
    concrete = tuple(_copy_input(u) if u in self._written_uops else u for u in input_uops)
    if (plan := self.__dict__.get("_plan_cache")) is None: plan = self.__dict__["_plan_cache"] = self._plan()
    threads, ctx = engine_threads(), None
    for seg in plan:
      if not isinstance(seg, _Segment):  # anything else: tinygrad's own executor, with its statistics
        ctx = ctx or ExecContext(var_vals, concrete, True, True)
        track_stats(ctx, seg, perf_counter_us(), pm_exec.rewrite(seg, ctx))
        continue
      words = [var_vals[s] if isinstance(s, str) else _resolve(s[0], concrete).buffer.ensure_allocated().get_buf(s[1]).va_addr for s in seg.slots]
      _runner()(seg.ops, seg.count, (ctypes.c_uint64 * max(1, len(words)))(*words), threads)
      GlobalCounters.kernel_count += seg.count
      GlobalCounters.global_ops += seg.ops_est(var_vals)
      GlobalCounters.global_mem += seg.mem_est(var_vals)
    return self.ret

def _runner_available() -> bool:
  try: return _runner() is not None
  except (OSError, subprocess.CalledProcessError): return False

def fast(c: CapturedJit) -> CapturedJit:
  """`c` replayed natively, when the runner builds (clang); else `c`."""
  if type(c) is not CapturedJit or not _runner_available(): return c
  f = FastCPUReplay(c.ret, c._linear, c.expected_names, c.expected_input_info)
  if "_written_uops" in c.__dict__: f.__dict__["_written_uops"] = c.__dict__["_written_uops"]  # (saved with a cached step)
  return f
