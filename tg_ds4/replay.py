"""`Jit`: tinygrad's TinyJit with a faster replay on the CPU device.

tinygrad 0.14's CPU device has no graph executor, so a replayed TinyJit walks its captured calls in Python and, for
every kernel, resolves buffers, symbolic sizes and statistics again: ~23 us per kernel, ~9 ms of a 400-kernel decode
step. After capture, `Jit` replays the same compiled functions with the same arguments from a prepared list: buffer
addresses resolved once, only the symbolic values (the position) and the JIT's own input buffers per call. A call that
is not a plain CPU kernel goes through tinygrad's executor as before, and so does everything under DEBUG >= 2 or
PROFILE (per-kernel timing). GlobalCounters are kept as tinygrad keeps them. `TG_DS4_FAST_REPLAY=0` turns it off."""
from __future__ import annotations

import ctypes, os
from dataclasses import dataclass

from tinygrad.engine.jit import CapturedJit, _copy_input, _TinyJit
from tinygrad.engine.realize import ExecContext, _resolve, estimate_uop, get_call_arg_uops, get_runtime, pm_exec, track_stats
from tinygrad.helpers import DEBUG, PROFILE, GlobalCounters, perf_counter_us, to_tuple
from tinygrad.runtime.ops_cpu import CPUProgram
from tinygrad.uop.ops import Ops, UOp, sym_infer

def _is_input(b: UOp) -> bool: return b.op is Ops.PARAM or any(_is_input(s) for s in b.src if b.op in (Ops.MSELECT, Ops.SHRINK, Ops.MSTACK))

@dataclass
class _Kernel:
  fxn: object
  device: str
  args: list                       # c_uint64 buffer addresses, None where the buffer is a JIT input
  inputs: list[tuple[int, UOp]]    # (position in args, argument uop) resolved against each call's inputs
  info: object                     # ProgramInfo: symbolic values and launch size
  core: int | None                 # argument slot of the thread id, when the kernel is split over threads
  ops: object
  mem: object

class FastCPUReplay(CapturedJit):
  def _plan(self) -> list[_Kernel | UOp]:
    plan: list[_Kernel | UOp] = []
    for call in self.linear.src:
      ast, devs = call.src[0], to_tuple(call.src[1].device)
      rt = get_runtime(devs[0], ast) if ast.op is Ops.PROGRAM and len(devs) == 1 and devs[0].startswith("CPU") else None
      if not isinstance(rt, CPUProgram) or rt.lvp:
        plan.append(call)
        continue
      arg_uops, args, inputs = get_call_arg_uops(call), [], []
      for pos, i in enumerate(ast.arg.globals):
        if _is_input(b := arg_uops[i]): args.append(None); inputs.append((pos, b))
        else: args.append(ctypes.c_uint64(b.buffer.ensure_allocated().get_buf(devs[0]).va_addr))
      est = estimate_uop(call)
      plan.append(_Kernel(rt.fxn, devs[0], args, inputs, ast.arg, rt.runtimevars.get("core_id"), est.ops, est.mem))
    return plan

  def __call__(self, input_uops: list[UOp], var_vals: dict[str, int]):
    if DEBUG >= 2 or PROFILE: return super().__call__(input_uops, var_vals)
    concrete = tuple(_copy_input(u) if u in self._written_uops else u for u in input_uops)
    if (plan := self.__dict__.get("_plan_cache")) is None: plan = self.__dict__["_plan_cache"] = self._plan()
    ctx, ops, mem, n = None, 0, 0, 0
    for k in plan:
      if not isinstance(k, _Kernel):  # anything else: tinygrad's own executor, with its statistics
        ctx = ctx or ExecContext(var_vals, concrete, True, True)
        track_stats(ctx, k, perf_counter_us(), pm_exec.rewrite(k, ctx))
        continue
      args = list(k.args)
      for pos, b in k.inputs: args[pos] = ctypes.c_uint64(_resolve(b, concrete).buffer.ensure_allocated().get_buf(k.device).va_addr)
      args += [None if v is None else ctypes.c_uint64(v) for v in k.info.vals(var_vals)]
      for tid in range(int(sym_infer(k.info.global_size[0], var_vals))):  # as CPUProgram: once per thread id
        if k.core is not None: args[k.core] = ctypes.c_uint64(tid)
        k.fxn(*args)
      n, ops, mem = n + 1, ops + sym_infer(k.ops, var_vals), mem + sym_infer(k.mem, var_vals)
    GlobalCounters.kernel_count += n
    GlobalCounters.global_ops += ops
    GlobalCounters.global_mem += mem
    return self.ret

class Jit(_TinyJit):
  """TinyJit whose capture is replayed by FastCPUReplay (same kernels, same order, same results)."""
  def __call__(self, *args, **kwargs):
    ret = super().__call__(*args, **kwargs)
    if type(c := self.captured) is CapturedJit and os.environ.get("TG_DS4_FAST_REPLAY", "1") != "0":
      self.captured = FastCPUReplay(c.ret, c._linear, c.expected_names, c.expected_input_info)
    return ret
