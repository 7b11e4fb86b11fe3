"""DEV=PYTHON's kernels run on numpy arrays that hold every thread of the launch at once.

tinygrad's PYTHON device emulates GPU-style execution: it interprets a kernel's uops one workgroup after another, each
uop once per thread of the workgroup, in Python. That is the definition of the uops' semantics, and slow: a decode step
of the deepseek4 fixture takes minutes. This program runs the same uops in the same order once per launch, each one on
an array with a row per thread of the whole grid (workgroup-major, as the stock emulator visits them), with the stock
emulator's arithmetic: every ALU result is computed in float64 (or int64) and rounded to its dtype, as tinygrad's
`exec_alu` rounds the Python float it computes; loads and stores check bounds and raise the same IndexError; shared
(LOCAL) memory is one block per workgroup, registers one block per thread; stores under an IF are masked and the last
thread to store to an address wins, as the stock emulator's thread order makes it.

Running all workgroups in lockstep is the stock emulator's model as long as no loop's trip count or exit condition
differs between threads (the stock emulator takes thread 0's for its whole workgroup) and no workgroup reads what
another writes in the same launch (a race on any GPU). A kernel whose loop bound or exit condition depends on a thread
or workgroup index or a loaded value, a tensor core (WMMA), a foreign call, an image or an fp8 value runs on the stock
emulator. `TG_DS4_FAST_EMULATOR=0` (backend/compat.py) runs every kernel there."""
import math, time

import numpy as np
from tinygrad import dtypes

from tg_ds4.backend import compat
from tg_ds4.backend.compat import AddrSpace, GroupOp, Ops, UOp

class Unsupported(Exception): pass

def _np(dt) -> np.dtype:
  """numpy's dtype for a scalar tinygrad dtype's values; bfloat16 values are held in float32."""
  if dt == dtypes.bfloat16: return np.dtype(np.float32)
  if dt in dtypes.fp8s: raise Unsupported(f"{dt}")
  return np.dtype(compat._to_np_dtype(dt))

def _storage(dt) -> np.dtype:
  return np.dtype(np.uint16) if dt == dtypes.bfloat16 else _np(dt)

def _wide(dt) -> np.dtype:
  """The dtype an ALU computes in: Python's float or int, as tinygrad's exec_alu does, before rounding to `dt`."""
  if dtypes.is_float(dt): return np.dtype(np.float64)
  if dt == dtypes.bool: return np.dtype(np.bool_)
  return np.dtype(np.uint64) if dt == dtypes.uint64 else np.dtype(np.int64)

def _bf16_round(x: np.ndarray) -> np.ndarray:
  """float_to_bf16: round to float32, then to bfloat16's 8 mantissa bits, nearest-even; inf and nan unchanged."""
  f = np.asarray(x, np.float64).astype(np.float32)
  u = f.view(np.uint32).astype(np.uint64)
  r = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
  return np.where(np.isfinite(f), r, f)

def _to(x, dt) -> np.ndarray:
  """Round a wide (float64/int64/bool) result to dtype `dt`, as tinygrad's `truncate` does: floats to nearest, integers
  wrapped to their width."""
  x = np.asarray(x)
  if dt == dtypes.bfloat16: return _bf16_round(x)
  want = _np(dt)
  if want == np.bool_: return x.astype(np.bool_)
  if want.kind == "f": return x.astype(np.float64).astype(want)
  if x.dtype.kind == "f": x = np.trunc(x).astype(np.uint64 if want == np.uint64 else np.int64)  # int(x): toward zero
  return x.astype(want)  # two's complement wrap, as ctypes' c_int32(x).value

def _cdiv(x, y):
  q = np.abs(x) // np.where(y == 0, 1, np.abs(y))
  return np.where(y == 0, 0, np.where((x < 0) != (y < 0), -q, q))

def _floordiv(x, y): return np.where(y == 0, 0, x // np.where(y == 0, 1, y))

ALU = {
  Ops.LOG2: lambda x: np.log2(x), Ops.EXP2: lambda x: np.power(2.0, x), Ops.SQRT: lambda x: np.sqrt(x),
  Ops.RECIPROCAL: lambda x: 1.0 / x, Ops.SIN: lambda x: np.sin(x), Ops.TRUNC: lambda x: np.trunc(x),
  Ops.POW: lambda x, y: np.power(x, y), Ops.NEG: lambda x: -x, Ops.ADD: lambda x, y: x + y, Ops.SUB: lambda x, y: x - y,
  Ops.MUL: lambda x, y: x * y, Ops.CMPNE: lambda x, y: x != y, Ops.CMPLT: lambda x, y: x < y, Ops.CMPEQ: lambda x, y: x == y,
  Ops.XOR: lambda x, y: x ^ y, Ops.OR: lambda x, y: x | y, Ops.AND: lambda x, y: x & y,
  Ops.SHR: lambda x, y: x >> y, Ops.SHL: lambda x, y: x << y,
  Ops.MAX: lambda x, y: np.where(y > x, y, x),  # Python's max(x, y): x unless y is larger (nan included)
  Ops.CDIV: _cdiv, Ops.CMOD: lambda x, y: x - _cdiv(x, y) * y,
  Ops.FLOORDIV: _floordiv, Ops.FLOORMOD: lambda x, y: x - _floordiv(x, y) * y,
  Ops.MULACC: lambda x, y, z: x * y + z, Ops.WHERE: lambda c, y, z: np.where(c, y, z)}

class _Ptr:
  """A pointer per thread: a byte array and each thread's byte offset into it (an int when all threads share it)."""
  __slots__ = ("mem", "off", "views")
  def __init__(self, mem: np.ndarray, off, views: dict):
    self.mem, self.off, self.views = mem, off, views
  def view(self, dt: np.dtype) -> np.ndarray:
    if (v := self.views.get(dt)) is None:
      self.views[dt] = v = self.mem[:len(self.mem) - len(self.mem) % dt.itemsize].view(dt)
    return v

def _uniform_sources(uops: list[UOp]) -> set[UOp]:
  """The uops whose value is the same in every thread of a launch: no thread or workgroup index, no load, no register."""
  varying: set[UOp] = set()
  for u in uops:
    if u.op in (Ops.SPECIAL, Ops.LOAD, Ops.WMMA, Ops.CALL) or any(s in varying for s in u.src): varying.add(u)
  return {u for u in uops if u not in varying}

def check(uops: list[UOp]) -> None:
  """Raise Unsupported for a kernel this program cannot run in lockstep with the stock emulator's results."""
  uniform = _uniform_sources(uops)
  for u in uops:
    if u.op in (Ops.WMMA, Ops.CALL): raise Unsupported(f"{u.op}")
    if u.op is Ops.CONST and u.is_invalid: raise Unsupported("Invalid constant")
    if u.op is Ops.SPECIAL and u.arg[0] not in "gl": raise Unsupported(f"SPECIAL {u.arg}")
    if u.op is Ops.RANGE and u.dtype != dtypes.void and u.src[0] not in uniform: raise Unsupported("loop bound differs between threads")
    if u.op is Ops.END and len(u.src) == 3 and u.src[2] not in uniform: raise Unsupported("loop exit differs between threads")
    if u.op in (Ops.INDEX, Ops.SHRINK) and u.src[0].addrspace != AddrSpace.ALU and compat.is_image_shape(u.src[0]._shape):
      raise Unsupported("image")
    if u.dtype != dtypes.void and u.dtype in dtypes.fp8s: raise Unsupported(f"{u.dtype}")
    if u.op is Ops.BITCAST and dtypes.bfloat16 in (u.dtype, u.src[0].dtype): raise Unsupported("bfloat16 bitcast")

class Program(compat.PythonProgram):
  """tinygrad's PythonProgram, its uops run for the whole grid at once where check() allows, else by the stock loop."""
  def __init__(self, dev, obj):
    super().__init__(dev, obj)
    self.operands = {u: tuple(v for v in u.src if v.dtype is not dtypes.void) for u in self.uops}  # the sources with a value
    try: check(self.uops); self.lockstep = True
    except Unsupported: self.lockstep = False

  def __call__(self, *bufs, global_size=(1, 1, 1), local_size=(1, 1, 1), vals=(), wait=False, **kw):
    if not self.lockstep: return super().__call__(*bufs, global_size=global_size, local_size=local_size, vals=vals, wait=wait, **kw)
    st = time.perf_counter()
    with np.errstate(all="ignore"): self._run(bufs, tuple(global_size), tuple(local_size), tuple(vals))
    return time.perf_counter() - st

  def _run(self, bufs, global_size, local_size, vals):
    uops, index = self.uops, self.uop_to_index
    nwg, warp = math.prod(global_size), math.prod(local_size)
    n = nwg * warp
    # thread t of the launch is thread t % warp of workgroup t // warp; both counted with dimension 0 fastest
    thread, group = np.arange(n, dtype=np.int64) % warp, np.arange(n, dtype=np.int64) // warp
    gidx = np.unravel_index(group, global_size[::-1])[::-1]
    lidx = np.unravel_index(thread, local_size[::-1])[::-1]
    values: dict[UOp, object] = {}
    pbufs, pvals = list(bufs), list(vals)
    masks: list[np.ndarray | None] = [None]
    i = 0
    while i < len(uops):
      u = uops[i]
      op = u.op
      if op is Ops.END:
        if len(u.src) == 3: i = index[u.src[1]] if bool(np.asarray(values[u.src[2]]).flat[0]) else i + 1
        else: i = index[u.src[1]]
        continue
      if op is Ops.IF:
        cond = np.broadcast_to(values[u.src[0]], (n,))
        masks.append(cond if masks[-1] is None else masks[-1] & cond)
        i += 1
        continue
      if op is Ops.ENDIF:
        masks.pop()
        i += 1
        continue
      if op in (Ops.BARRIER, Ops.SINK, Ops.NOOP, Ops.GROUP) or (op is Ops.RANGE and u.dtype == dtypes.void):
        i += 1  # every thread is at the same uop: a barrier holds by construction
        continue
      operands = self.operands[u]
      src = [values[v] for v in operands]
      if op is Ops.STORE:
        self._store(src[0], src[1], operands[1].dtype, masks[-1], n)
      elif op is Ops.AFTER or (op is Ops.BITCAST and u.addrspace in (AddrSpace.GLOBAL, AddrSpace.LOCAL)): values[u] = src[0]
      elif op is Ops.PARAM and u.addrspace is AddrSpace.ALU: values[u] = np.int64(pvals.pop(0))
      elif op in (Ops.PARAM, Ops.BUFFER):
        size = u.max_numel() * u.dtype.itemsize
        if op is Ops.PARAM: values[u] = _Ptr(np.frombuffer(pbufs.pop(0), np.uint8), 0, {})
        elif u.addrspace == AddrSpace.REG: values[u] = _Ptr(np.zeros(n * size, np.uint8), np.arange(n, dtype=np.int64) * size, {})
        else: values[u] = _Ptr(np.zeros(nwg * size, np.uint8), group * size, {})  # shared memory: a block per workgroup
      elif op is Ops.SPECIAL: values[u] = (gidx if u.arg[0] == "g" else lidx)[int(u.arg[-1])]
      elif op is Ops.CONST: values[u] = np.array(u.val, _np(u.dtype))
      elif op in (Ops.INDEX, Ops.SHRINK):
        if u.src[0].addrspace == AddrSpace.ALU:  # a register array indexed per thread
          elems = np.stack([np.broadcast_to(e, (n,)) for e in src[0]])
          values[u] = elems[np.broadcast_to(src[1], (n,)), np.arange(n)]
        else:
          p = src[0]
          values[u] = _Ptr(p.mem, p.off + np.asarray(src[1]).astype(np.int64) * u.src[0].dtype.itemsize, p.views)
      elif op is Ops.RANGE:
        values[u] = values[u] + 1 if u in values else np.int64(0)
        if values[u] == np.asarray(src[0]).flat[0]:
          del values[u]
          i = self.loop_ends[u] + 1
          continue
      elif op is Ops.STACK: values[u] = src
      elif op is Ops.BITCAST: values[u] = np.asarray(src[0]).astype(_np(u.src[0].dtype)).view(_np(u.dtype))
      elif op is Ops.CAST: values[u] = _to(np.asarray(src[0]).astype(_wide(u.src[0].dtype)), u.dtype)
      elif op is Ops.LOAD: values[u] = self._load(u, src)
      elif op in GroupOp.ALU:
        wide = [np.asarray(x).astype(_wide(s.dtype), copy=False) for x, s in zip(src, operands)]
        values[u] = _to(ALU[op](*wide), u.dtype)
      else: raise RuntimeError(f"emulator: unhandled {op}")
      i += 1

  @staticmethod
  def _gather(p: _Ptr, j: int, dt, gate) -> np.ndarray:
    view, isz = p.view(_storage(dt)), dt.itemsize
    off = p.off + j * isz
    if np.any(np.asarray(off) % isz): raise RuntimeError("emulator: misaligned load")
    idx = np.asarray(off) // isz
    live = idx if gate is None else np.broadcast_to(idx, np.broadcast_shapes(np.shape(idx), np.shape(gate)))[np.asarray(gate, bool)]
    if live.size and (live.min() < 0 or live.max() >= len(view)):
      raise IndexError(f"load out of bounds, size is {len(view)} and access is {int(live.max() if live.max() >= len(view) else live.min())}")
    got = view[np.clip(idx, 0, len(view) - 1)] if gate is not None else view[idx]
    if dt == dtypes.bfloat16: got = (got.astype(np.uint32) << 16).view(np.float32)
    return got

  def _load(self, u: UOp, src: list):
    ptr, alt, gate = src[0], (src[1] if len(src) >= 3 else None), (src[2] if len(src) >= 3 else None)
    dt, count = u.dtype, u.max_numel()
    out = []
    for j in range(count):
      got = self._gather(ptr, j, dt, gate)
      if gate is not None: got = np.where(gate, got, alt[j] if isinstance(alt, list) else alt).astype(got.dtype)
      out.append(got)
    return out if count > 1 else out[0]

  @staticmethod
  def _store(p: _Ptr, val, dt, mask, n) -> None:
    elems = val if isinstance(val, list) else [val]
    view, isz = p.view(_storage(dt)), dt.itemsize
    for j, v in enumerate(elems):
      off = np.broadcast_to(p.off + j * isz, (n,))
      v = np.broadcast_to(np.asarray(v), (n,))
      if mask is not None: off, v = off[mask], v[mask]
      if np.any(off % isz): raise RuntimeError("emulator: misaligned store")
      idx = off // isz
      if idx.size and (idx.min() < 0 or idx.max() >= len(view)):
        raise IndexError(f"store out of bounds, size is {len(view)}, access is {int(idx.max() if idx.max() >= len(view) else idx.min())}")
      if dt == dtypes.bfloat16: v = (_bf16_round(v).view(np.uint32) >> 16).astype(np.uint16)
      view[idx] = v  # numpy assigns in order: the last thread to store to an address wins, as in the stock emulator

def install(device: str) -> None:
  """Run `device`'s (a PYTHON device's) kernels with Program. Idempotent; nothing unless compat says it is on."""
  if not compat.fast_emulator_on(): return
  from tinygrad import Device
  d = Device[device]
  if d.runtime_t is compat.PythonProgram: d.runtime_t = Program
