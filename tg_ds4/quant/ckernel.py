"""C statements as tinygrad kernels (`Tensor.custom_kernel`): quant/intdot.py's integer block dots and quant/cgemm.py's
float GEMM are C that tinygrad's renderer cannot express (clang's vector builtins, accumulators held as vectors), each
statement inside a (threaded) range tinygrad schedules and orders like any other kernel."""
from __future__ import annotations

from tinygrad import Device, Tensor, dtypes

from tg_ds4.backend.compat import Ops, UOp

def format_string(src: str, names: list[str]) -> str:
  """C source -> an Ops.CUSTOM format string: braces escaped, `@NAME@` -> `{i}` (the i-th source)."""
  s = src.replace("{", "{{").replace("}", "}}").replace("@R@", "(@R@)")
  for i, n in enumerate(names): s = s.replace(f"@{n}@", "{%d}" % i)
  return s

def statement_kernel(body: str, params: tuple[UOp, ...], written: dict[int, UOp], r: UOp, ranges: tuple[UOp, ...], info,
                     scalars: tuple[UOp, ...] = ()) -> UOp:
  """The kernel of the C statement `body` over `params` inside range `r` (one of `ranges`), which tinygrad orders
  correctly. tinygrad knows which buffers a kernel writes and reads from its STOREs and LOADs (ProgramInfo.outs and
  .ins, by which the native replay orders kernels into waves), and a C statement has neither: each buffer it reads gets
  a load of its first element among the statement's sources (cast to void in it), and each buffer it writes (`written`:
  param -> an element the statement writes in this iteration) a store of 0 to that element just before the statement,
  which the statement then overwrites. `scalars` (call's kernel-side integers) follow the buffers among the sources,
  before `r`."""
  reads = tuple(p[0].load(dtype=p.dtype) for i, p in enumerate(params) if i not in written)
  first = tuple(params[i][e].store(UOp.const(0, params[i].dtype)) for i, e in written.items())
  body += "".join(" (void)({%d});" % (len(params) + len(scalars) + 1 + j) for j in range(len(reads)))  # used, so rendered and counted
  stmt = UOp(Ops.CUSTOM, dtypes.void, src=(*params, *scalars, r, *reads, *first), arg=body)
  return stmt.end(*ranges).sink(arg=info).rtag(1)

def call(kernel, srcs: list, scalars: list) -> list:
  """`Tensor.custom_kernel(*srcs, fxn=kernel)` whose kernel also takes integer `scalars`: each an int (a constant in the
  kernel) or a bound variable (a captured step's symbolic start position or slot: a parameter of the kernel, its value
  given at each run). `kernel(*buffers, *scalars)` gets the buffers' placeholders, then the scalars' kernel-side forms."""
  inner = [UOp.const(s, dtypes.int) if isinstance(s, int) else UOp.variable(s.unbind()[0].expr, s.vmin, s.vmax, s.dtype, param=True)
           for s in scalars]
  body = kernel(*[UOp.placeholder_like(t.uop, slot=i) for i, t in enumerate(srcs)], *inner)
  done = body.call(*[t.uop for t in srcs], *[s for s in scalars if not isinstance(s, int)])
  return [Tensor(t.uop.after(done)) for t in srcs]

def bound_variable(x) -> bool:
  """Whether `x` can be a scalar of `call`: an int, or a variable bound to a value (not an expression of one)."""
  return isinstance(x, int) or (isinstance(x, UOp) and x.is_bound_var)

def uneven_threads(device: str, n: int) -> tuple[int, int]:
  """(threads, statements per thread) covering `n` statements with as many threads as the renderer allows, the last
  thread's share short where they do not divide evenly: statements past `n` must do nothing."""
  g = min((Device[device].renderer.global_max or (1,))[0], n)
  return g, -(-n // g)

def threads(device: str, n: int) -> int:
  """The most threads, up to the renderer's limit, that split `n` statements evenly."""
  g = (Device[device].renderer.global_max or (1,))[0]
  return max(t for t in range(1, g + 1) if n % t == 0)
