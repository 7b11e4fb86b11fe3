"""Host and device memory without the scheduler: reading a CPU buffer in place, copying an array onto a device as one
buffer, writing a large buffer in bounded pieces, and zero buffers that cost no kernel. A model load makes dozens of
these; going through tinygrad's graph for each would schedule and lower a kernel every time."""
from __future__ import annotations

import ctypes, functools, mmap, sys, weakref
from collections.abc import Callable

import numpy as np
from tinygrad import Tensor, UOp

from tg_ds4.backend.compat import Buffer, BufferSpec, Ops, _from_np_dtype, _to_np_dtype, copy_in, copy_out, prod

def host_copy(t: Tensor) -> np.ndarray | None:
  """A tensor that is all of a realized buffer (reshaped at most), on any device, as a numpy copy, read without lowering
  a kernel (a warm start lowers nothing): on the CPU in place, elsewhere by the allocator's own copy (compat.copy_out);
  None for anything else (a view, a lazy value). tinygrad's own read (`numpy()`, `item()`) goes through a copy
  program, Python work per call (~200 us) that a decode loop would pay again each time the sampled token is read back."""
  if (a := host_view(t)) is not None: return a.copy()
  if (u := _whole_buffer(t)) is None: return None
  return np.frombuffer(copy_out(u.buffer), _to_np_dtype(t.dtype)).reshape(t.shape)

def _whole_buffer(t: Tensor) -> UOp | None:
  u = t.uop
  while u.op is Ops.RESHAPE: u = u.src[0]
  return u if u.op is Ops.BUFFER and u.is_realized and u.buffer.nbytes == t.nbytes() else None

def host_view(t: Tensor) -> np.ndarray | None:
  """As `host_copy`, but the buffer's memory itself, read-only, no copy (a mapped file's pages are read as it is read)."""
  if (u := _whole_buffer(t)) is None or not str(t.device).startswith("CPU"): return None
  a = np.frombuffer(u.buffer.as_memoryview(allow_zero_copy=True), _to_np_dtype(t.dtype)).reshape(t.shape)
  a.flags.writeable = False
  return a

def host_array(t: Tensor) -> np.ndarray:
  """`t.numpy()`, read in place where `host_copy` can."""
  return a if (a := host_copy(t)) is not None else t.numpy()

def host_tensor(a: np.ndarray, device: str) -> Tensor:
  """`a` as a realized tensor on `device` by one buffer copy: no graph is scheduled or lowered (`Tensor(a).realize()`
  schedules and lowers one each time, and a load makes dozens)."""
  a = np.ascontiguousarray(a)
  buf = Buffer(device, a.size, _from_np_dtype(a.dtype)).ensure_allocated()
  copy_in(buf, memoryview(a.reshape(-1)).cast("B"))
  return Tensor(UOp.from_buffer(buf)).reshape(a.shape)

def host_owned(a: np.ndarray, device: str) -> Tensor:
  """`a` (C-contiguous) as a realized tensor over its own memory on the CPU device, kept alive as long as the buffer
  (elsewhere `host_tensor`'s copy). tinygrad's CPU buffers are shared anonymous mappings, whose pages a copy of a large
  weight faults in 4 KB at a time; numpy's private memory takes transparent huge pages where the system gives them."""
  if not str(device).startswith("CPU") or not a.flags.c_contiguous: return host_tensor(a, device)
  t = Tensor.from_blob(a.ctypes.data, a.shape, dtype=_from_np_dtype(a.dtype), device=device)
  weakref.finalize(t.uop.buffer, lambda _: None, a)  # the array lives as long as any view of the buffer
  return t

_MADV_HUGEPAGE, _MADV_POPULATE_WRITE = 14, 23  # Linux; an older kernel refuses POPULATE_WRITE (EINVAL) and faults as it writes

def host_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
  """An uninitialized array for `host_owned`, its pages in memory before it is written (transparent huge pages where the
  system gives them on request): a large array written page by page otherwise takes a fault every 4 KB."""
  a = np.empty(shape, dtype)
  if a.nbytes >= 1 << 21 and sys.platform == "linux":
    start = a.ctypes.data - a.ctypes.data % mmap.PAGESIZE
    for advice in (_MADV_HUGEPAGE, _MADV_POPULATE_WRITE):
      _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(a.ctypes.data + a.nbytes - start), advice)
  return a

@functools.cache
def _libc(): return ctypes.CDLL(None, use_errno=True)

UPLOAD_PIECE = 64 << 20  # host bytes per copy onto a device: a load never holds a host copy of a whole weight or cache

def device_buffer(device: str, size: int, dtype, fill: Callable[[memoryview, int], None] | None = None) -> Buffer:
  """A realized buffer of `size` elements on `device`, written in pieces of at most UPLOAD_PIECE bytes through one host
  staging buffer: `fill(piece, offset)` writes the bytes from byte `offset` into `piece`; without it, zeros. Loading
  onto a GPU thus holds the device copy and one piece on the host, not a second copy of the file (tinygrad's own
  disk-to-device copy maps the whole file and touches every page of it)."""
  buf, nbytes = Buffer(device, size, dtype).ensure_allocated(), size * dtype.itemsize
  step = UPLOAD_PIECE // dtype.itemsize * dtype.itemsize
  stage = np.zeros(min(nbytes, step), np.uint8)
  for off in range(0, nbytes, step):
    piece = memoryview(stage)[:min(step, nbytes - off)]
    if fill is not None: fill(piece, off)
    dst = buf if len(piece) == nbytes else buf.view(len(piece) // dtype.itemsize, dtype, off).ensure_allocated()
    dst.copy_from(Buffer("PYTHON", len(piece) // dtype.itemsize, dtype, opaque=piece.cast("B")))
  return buf

def zeros(shape: tuple[int, ...], dtype, device: str) -> Tensor:
  """A realized zero tensor (a cache) without a kernel. On the CPU a `zero` buffer is fresh anonymous memory, zero by the
  OS (tinygrad never hands it out of its reuse cache), and its pages stay unmapped until written: a cache's unused
  context costs no memory. Elsewhere zeros copied in bounded pieces (device_buffer)."""
  if not str(device).startswith("CPU"): return Tensor(UOp.from_buffer(device_buffer(device, prod(shape), dtype))).reshape(shape)
  buf = Buffer(device, prod(shape), dtype, options=BufferSpec(zero=True)).ensure_allocated()
  return Tensor(UOp.from_buffer(buf)).reshape(shape)
