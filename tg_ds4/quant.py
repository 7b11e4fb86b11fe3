"""GGML block formats as lazy tinygrad expressions, and the fused quantized linear / expert gather built on them.

This is the only module that knows block layouts. Each format is a function from packed bytes
(uint8 `[..., n_blocks, block_bytes]`) to values (float32 `[..., n_blocks, block_elems]`) written with plain Tensor
ops, so the scheduler fuses the unpacking into whatever consumes it (a matmul, a gather, a norm) and a kernel reads
only the packed bytes. Layouts follow ggml-common.h; every function is checked against `gguf.quants.dequantize`.

Unpacking rule that keeps the fused kernels honest: load each packed byte once, then fan it out along a new axis
with shifts by `arange` constants (`_unpack`), instead of slicing the same bytes twice for low and high bits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType
from tinygrad.helpers import prod

# ---------------------------------------------------------------- byte-field helpers

def _f16(b: Tensor, off: int) -> Tensor:
  """fp16 field at byte `off` of each block -> float32 `[..., nb, 1]`."""
  return b[..., off:off+2].bitcast(dtypes.float16).cast(dtypes.float32)

def _unpack(b: Tensor, bits: int) -> Tensor:
  """uint8 `[..., n]` -> `[..., 8//bits, n]`: plane i holds bits [i*bits, (i+1)*bits) of every byte."""
  k = 8 // bits
  shifts = (Tensor.arange(k, dtype=dtypes.uint8) * bits).reshape(k, 1)
  return (b.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)

# ---------------------------------------------------------------- formats

def _native(dtype: DType) -> Callable[[Tensor], Tensor]:
  return lambda b: b.bitcast(dtype)

def _bf16(b: Tensor) -> Tensor:
  # bf16 is the top half of an f32: widen the raw bits and shift, exact and independent of device bf16 support
  return (b.bitcast(dtypes.uint16).cast(dtypes.uint32) << 16).bitcast(dtypes.float32)

def _q4_0(b: Tensor) -> Tensor:
  q = _unpack(b[..., 2:], 4).flatten(-2).cast(dtypes.int8) - 8
  return _f16(b, 0) * q.cast(dtypes.float32)

def _q4_1(b: Tensor) -> Tensor:
  q = _unpack(b[..., 4:], 4).flatten(-2).cast(dtypes.float32)
  return _f16(b, 0) * q + _f16(b, 2)

def _q5(b: Tensor, qh_off: int) -> Tensor:
  """Q5_0/Q5_1: 4 low bits in nibbles, the 5th bit of element j is bit j of the 32-bit qh field."""
  ql = _unpack(b[..., qh_off+4:], 4).flatten(-2)                        # [..., nb, 32]
  qh = _unpack(b[..., qh_off:qh_off+4], 1).transpose(-1, -2).flatten(-2)  # bit j of little-endian u32 -> element j
  return (ql | (qh << 4)).cast(dtypes.float32)

def _q5_0(b: Tensor) -> Tensor: return _f16(b, 0) * (_q5(b, 2) - 16)
def _q5_1(b: Tensor) -> Tensor: return _f16(b, 0) * _q5(b, 4) + _f16(b, 2)

def _q8_0(b: Tensor) -> Tensor: return b[..., 2:].bitcast(dtypes.int8).cast(dtypes.float32) * _f16(b, 0)

# ---------------------------------------------------------------- type table

@dataclass(frozen=True)
class QuantType:
  name: str
  id: int
  block: int        # elements per block
  nbytes: int       # bytes per block
  unpack: Callable[[Tensor], Tensor]

  @property
  def quantized(self) -> bool: return self.block > 1

QTYPES: dict[int, QuantType] = {t.id: t for t in [
  QuantType("F32", 0, 1, 4, _native(dtypes.float32)),
  QuantType("F16", 1, 1, 2, _native(dtypes.float16)),
  QuantType("Q4_0", 2, 32, 18, _q4_0),
  QuantType("Q4_1", 3, 32, 20, _q4_1),
  QuantType("Q5_0", 6, 32, 22, _q5_0),
  QuantType("Q5_1", 7, 32, 24, _q5_1),
  QuantType("Q8_0", 8, 32, 34, _q8_0),
  QuantType("I8", 24, 1, 1, _native(dtypes.int8)),
  QuantType("I16", 25, 1, 2, _native(dtypes.int16)),
  QuantType("I32", 26, 1, 4, _native(dtypes.int32)),
  QuantType("I64", 27, 1, 8, _native(dtypes.int64)),
  QuantType("F64", 28, 1, 8, _native(dtypes.float64)),
  QuantType("BF16", 30, 1, 2, _bf16),
]}
QTYPE_BY_NAME = {t.name: t for t in QTYPES.values()}

def dequantize(blocks: Tensor, qtype: QuantType | int | str) -> Tensor:
  """Packed uint8 `[..., n_blocks, block_bytes]` -> values `[..., n_blocks * block_elems]` (lazy)."""
  qt = qtype if isinstance(qtype, QuantType) else QTYPES[qtype] if isinstance(qtype, int) else QTYPE_BY_NAME[qtype]
  return qt.unpack(blocks).flatten(-2)

# ---------------------------------------------------------------- packed tensors

class QTensor:
  """A GGUF tensor that stays packed: `blocks` is uint8 `[*shape[:-1], shape[-1] // block, block_bytes]`.

  `shape` is the logical (tinygrad-order) shape. Indexing the leading axes (expert ids, token ids) gives a QTensor
  whose `dequant()` unpacks the parent and then indexes: a one-hot gather over packed bytes is a reduce read by
  several field slices, which tinygrad realizes as its own kernel, while a gather of the unpacked values folds into
  indexed loads of only the selected rows. `blocks` of an indexed QTensor is the (lazy) byte gather."""
  def __init__(self, blocks: Tensor, qtype: QuantType, shape: tuple[int, ...], _parent: tuple[QTensor, Any] | None = None):
    assert blocks.shape == (*shape[:-1], shape[-1] // qtype.block, qtype.nbytes), (blocks.shape, shape, qtype)
    self.blocks, self.qtype, self.shape, self._parent = blocks, qtype, tuple(shape), _parent

  def __repr__(self): return f"QTensor({self.qtype.name}, shape={self.shape}, device={self.device})"
  @property
  def device(self): return self.blocks.device
  @property
  def nbytes(self) -> int: return prod(self.blocks.shape)
  @property
  def ndim(self) -> int: return len(self.shape)

  def dequant(self, dtype: DType | None = None) -> Tensor:
    if self._parent is not None: return self._parent[0].dequant(dtype)[self._parent[1]]
    x = dequantize(self.blocks, self.qtype)
    return x if dtype is None or x.dtype == dtype else x.cast(dtype)

  def __getitem__(self, idx) -> QTensor:
    """Index leading axes only (the packed last axis cannot be sliced mid-block)."""
    blocks = self.blocks[idx]
    return QTensor(blocks, self.qtype, (*blocks.shape[:-2], self.shape[-1]), (self, idx))

  def to(self, device: str) -> QTensor:
    if self._parent is None: return QTensor(self.blocks.to(device), self.qtype, self.shape)
    idx = self._parent[1]
    mv = lambda i: i.to(device) if isinstance(i, Tensor) else i
    return self._parent[0].to(device)[tuple(mv(i) for i in idx) if isinstance(idx, tuple) else mv(idx)]

Weight = Tensor | QTensor

def as_tensor(w: Weight, dtype: DType | None = dtypes.float32) -> Tensor:
  if isinstance(w, QTensor): return w.dequant(dtype)
  return w if dtype is None or w.dtype == dtype else w.cast(dtype)

def linear(x: Tensor, w: Weight, bias: Weight | None = None, dtype: DType = dtypes.float32) -> Tensor:
  """`x @ w.T (+ bias)` with `w` `[out, in]` (or `[E, out, in]` after an expert gather, then x is `[E, ..., in]`).
  The dequantization is part of the same lazy graph, so a GEMV is one kernel that reads only packed bytes."""
  y = x.cast(dtype) @ as_tensor(w, dtype).transpose(-1, -2)
  return y if bias is None else y + as_tensor(bias, dtype)
