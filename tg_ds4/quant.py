"""GGML block formats as lazy tinygrad expressions, and the fused quantized linear / expert gather built on them.

This is the only module that knows block layouts. Each format is a function from packed bytes
(uint8 `[..., n_blocks, block_bytes]`) to values (float32 `[..., n_blocks, block_elems]`) written with plain Tensor
ops, so the scheduler fuses the unpacking into whatever consumes it (a matmul, a gather, a norm) and a kernel reads
only the packed bytes. Layouts follow ggml-common.h; every function is checked against `gguf.quants.dequantize`.

Unpacking rule that keeps the fused kernels honest: load each packed byte once, then fan it out along a new axis
with shifts by `arange` constants (`_unpack`), instead of slicing the same bytes twice for low and high bits.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType
from tinygrad.helpers import prod

# ---------------------------------------------------------------- byte-field helpers

def _f16(b: Tensor, off: int) -> Tensor:
  """fp16 field at byte `off` of each block -> float32 `[..., nb, 1]`."""
  return b[..., off:off+2].bitcast(dtypes.float16).cast(dtypes.float32)

def _c(vals, dtype: DType = dtypes.uint8) -> Tensor:
  """Device-free constant vector: folds into the kernel as immediates, no buffer and no arange reduce."""
  return Tensor.const(tuple(vals), dtype)

def _unpack(b: Tensor, bits: int) -> Tensor:
  """uint8 `[..., n]` -> `[..., 8//bits, n]`: plane i holds bits [i*bits, (i+1)*bits) of every byte."""
  k = 8 // bits
  return (b.unsqueeze(-2) >> _c(range(0, 8, bits)).reshape(k, 1)) & ((1 << bits) - 1)

def _lay(x: Tensor, src: str, dst: str, **n: int) -> Tensor:
  """View the last axis of `x` as named axes `src` (major to minor, sizes `n`) and arrange them in `dst` order,
  with size 1 for the `dst` axes the field does not depend on (they broadcast)."""
  s, d, lead = src.split(), dst.split(), x.shape[:-1]
  x = x.reshape(*lead, *(n[a] for a in s)).permute(*range(len(lead)), *(len(lead) + s.index(a) for a in d if a in s))
  return x.reshape(*lead, *(n[a] if a in s else 1 for a in d))

# ---------------------------------------------------------------- load order
# tinygrad's estimate (and the real loop nest) counts a load once per iteration of every loop enclosing it, up to
# the innermost loop its address depends on; loops it does not depend on are only free when they are inside all the
# loops it does. The heuristic unrolls the last reduce axis (and the one before when both are <= 3). So a format whose
# bit planes sit between its byte axes in element order (Q6_K: ql plane inside the qh plane) re-reads bytes. Those
# formats produce values in a load order instead: byte axes outer, fan-out axes inner. `linear` permutes x to match
# (free: x is tiny and cached) and `dequantize` permutes the values back.

@dataclass(frozen=True)
class Layout:
  to_load: Callable[[Tensor], Tensor]    # element order `[..., nb, block]` -> load order `[..., nb, *S]`
  to_elems: Callable[[Tensor], Tensor]   # load order -> element order

def _perm(elems: str, order: str, **n: int) -> Layout:
  e, o = elems.split(), order.split()
  def to_elems(v: Tensor) -> Tensor:
    lead = v.ndim - len(o)
    return v.permute(*range(lead), *(lead + o.index(a) for a in e)).flatten(-len(o))
  return Layout(lambda x: _lay(x, elems, order, **n), to_elems)

# ---------------------------------------------------------------- lookup tables (from gguf-py, not pasted here)

def _tables() -> dict[str, np.ndarray]:
  from gguf.quants import IQ2_XXS, IQ4_NL, MXFP4
  IQ2_XXS.init_grid()
  assert IQ2_XXS.grid is not None
  return {"iq2xxs_grid": IQ2_XXS.grid.reshape(256, 8).astype(np.uint8),  # entries are 0x08, 0x19, 0x2b: exact in uint8
          "ksigns": np.frombuffer(IQ2_XXS.ksigns, dtype=np.uint8).copy(),
          "iq4nl": np.array(IQ4_NL.kvalues, dtype=np.int8), "mxfp4": np.array(MXFP4.kvalues, dtype=np.int8)}
_TABLES = _tables()

@functools.cache
def _table(name: str, device: str) -> Tensor:
  # realized once per device, so a kernel that indexes it only adds the (tiny, capped) table read
  return Tensor(_TABLES[name], device=device).realize()

def _lookup(name: str, codes: Tensor) -> Tensor:
  """table[codes] for integer `codes`; the one-hot gather folds into one indexed load per code."""
  return _table(name, codes.device)[codes]

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

# Q5_0/Q5_1: element p*16 + ih*8 + il; low nibble p of qs[ih*8+il], 5th bit = bit il of qh byte p*2+ih
Q5_N, Q5_ORDER = dict(p=2, ih=2, il=8), "ih p il"
def _q5(b: Tensor, qh_off: int) -> Tensor:
  L = lambda x, src: _lay(x, src, Q5_ORDER, **Q5_N)
  ql = (L(b[..., qh_off+4:], "ih il") >> L(_c((0, 4)), "p")) & 0xF
  qh = (L(b[..., qh_off:qh_off+4], "p ih") >> L(_c(range(8)), "il")) & 1
  return (ql | (qh << 4)).cast(dtypes.float32)

def _q5_0(b: Tensor) -> Tensor: return _f16(b, 0).unsqueeze(-1).unsqueeze(-1) * (_q5(b, 2) - 16)
def _q5_1(b: Tensor) -> Tensor:
  d, m = (_f16(b, o).unsqueeze(-1).unsqueeze(-1) for o in (0, 2))
  return d * _q5(b, 4) + m

def _q8_0(b: Tensor) -> Tensor: return b[..., 2:].bitcast(dtypes.int8).cast(dtypes.float32) * _f16(b, 0)

def _fp(b: Tensor, off: int, ndim: int) -> Tensor:
  """fp16 field shaped to broadcast against `ndim` load-order axes."""
  return _f16(b, off).reshape(*b.shape[:-1], *(1,) * ndim)

# Q2_K: scales[16] qs[64] d dmin. element h*128 + s*32 + lh*16 + ll: 2-bit plane s of qs[h*32+lh*16+ll], scale h*8+s*2+lh
Q2K_N, Q2K_ORDER = dict(h=2, s=4, lh=2, ll=16), "h lh s ll"
def _q2_k(b: Tensor) -> Tensor:
  L = lambda x, src: _lay(x, src, Q2K_ORDER, **Q2K_N)
  sc = L(b[..., :16], "h s lh")
  q = ((L(b[..., 16:80], "h lh ll") >> L(_c((0, 2, 4, 6)), "s")) & 3).cast(dtypes.float32)
  dl, ml = _fp(b, 80, 4) * (sc & 0xF).cast(dtypes.float32), _fp(b, 82, 4) * (sc >> 4).cast(dtypes.float32)
  return dl * q - ml

# Q3_K: hmask[32] qs[64] scales[12] d. element h*128 + s*32 + l with s = s1*2+s0, l = lh*16+ll:
#  2 low bits = plane s of qs[h*32+l], high bit (inverted: set means no -4) = bit h*4+s of hmask[l],
#  6-bit scale k = h*8+s*2+lh: low nibble h of scales[k%8], 2 high bits (h*2+s1) of scales[8+k%4]
Q3K_N, Q3K_ORDER = dict(h=2, s1=2, s0=2, lh=2, ll=16), "lh ll h s1 s0"
def _q3_k(b: Tensor) -> Tensor:
  L = lambda x, src: _lay(x, src, Q3K_ORDER, **Q3K_N)
  ql = (L(b[..., 32:96], "h lh ll") >> L(_c((0, 2, 4, 6)), "s1 s0")) & 3
  qh = (L(b[..., :32], "lh ll") >> L(_c(range(8)), "h s1 s0")) & 1
  q = (ql.cast(dtypes.int8) - ((qh ^ 1) << 2).cast(dtypes.int8)).cast(dtypes.float32)
  lo = (L(b[..., 96:104], "s1 s0 lh") >> L(_c((0, 4)), "h")) & 0xF
  hi = (L(b[..., 104:108], "s0 lh") >> L(_c((0, 2, 4, 6)), "h s1")) & 3
  sc = ((lo | (hi << 4)).cast(dtypes.int8) - 32).cast(dtypes.float32)
  return (_fp(b, 108, 5) * sc) * q

# Q4_K/Q5_K: d dmin scales[12] [qh[32]] qs[128]. element g*64 + p*32 + l with g = g1*2+g0: nibble p of qs[g*32+l],
#  5th bit = bit g*2+p of qh[l]; sub-block k = g1*4 + j (j = g0*2+p) takes 6-bit scale/min from bytes j, 4+j, 8+j
K45_N, K45_ORDER = dict(g1=2, g0=2, p=2, l=32), "l g1 g0 p"
def _k45(b: Tensor, qs_off: int) -> Tensor:
  L = lambda x, src: _lay(x, src, K45_ORDER, **K45_N)
  A, B, C = (L(b[..., o:o+4], "g0 p") for o in (4, 8, 12))
  hi = L(_c((False, True), dtypes.bool), "g1")  # sub-blocks 4..7 keep their low 4 bits in C and top 2 in A/B
  sc, mn = hi.where((C & 0xF) | ((A >> 6) << 4), A & 63), hi.where((C >> 4) | ((B >> 6) << 4), B & 63)
  q = (L(b[..., qs_off:qs_off+128], "g1 g0 l") >> L(_c((0, 4)), "p")) & 0xF
  if qs_off == 48: q = q | (((L(b[..., 16:48], "l") >> L(_c(range(8)), "g1 g0 p")) & 1) << 4)
  return (_fp(b, 0, 4) * sc.cast(dtypes.float32)) * q.cast(dtypes.float32) - _fp(b, 2, 4) * mn.cast(dtypes.float32)

def _q4_k(b: Tensor) -> Tensor: return _k45(b, 16)
def _q5_k(b: Tensor) -> Tensor: return _k45(b, 48)

# Q6_K: ql[128] qh[64] scales[16] d. element h*128 + q*32 + l with q = q1*2+q0, l = lh*16+ll:
#  low nibble q1 of ql[h*64+q0*32+l], 2 high bits = plane q of qh[h*32+l], int8 scale h*8+q*2+lh
Q6K_N, Q6K_ORDER = dict(h=2, q1=2, q0=2, lh=2, ll=16), "h lh ll q1 q0"
def _q6_k(b: Tensor) -> Tensor:
  L = lambda x, src: _lay(x, src, Q6K_ORDER, **Q6K_N)
  ql = (L(b[..., :128], "h q0 lh ll") >> L(_c((0, 4)), "q1")) & 0xF
  qh = (L(b[..., 128:192], "h lh ll") >> L(_c((0, 2, 4, 6)), "q1 q0")) & 3
  q = ((ql | (qh << 4)).cast(dtypes.int8) - 32).cast(dtypes.float32)
  sc = L(b[..., 192:208].bitcast(dtypes.int8), "h q1 q0 lh").cast(dtypes.float32)
  return (_fp(b, 208, 5) * sc) * q

# IQ2_XXS: d, then 8 sub-blocks of (4 grid-index bytes, u32 w). element ib*32 + k*8 + j = ±grid[idx k][j] * d*(0.5+w>>28)/4,
#  sign j from ksigns[(w >> 7k) & 127]
def _iq2_xxs(b: Tensor) -> Tensor:
  qs = b[..., 2:].reshape(*b.shape[:-1], 8, 8)
  w = qs[..., 4:].bitcast(dtypes.uint32)                                              # [..., nb, 8, 1]
  grid = _lookup("iq2xxs_grid", qs[..., :4]).cast(dtypes.float32)                    # [..., nb, 8, 4, 8]
  sign = (_lookup("ksigns", (w >> _c((0, 7, 14, 21), dtypes.uint32)) & 127).unsqueeze(-1) >> _c(range(8))) & 1
  db = _f16(b, 0).unsqueeze(-1) * ((w >> 28).cast(dtypes.float32) + 0.5) * 0.25     # [..., nb, 8, 1]
  v = db.unsqueeze(-1) * grid
  return (sign == 1).where(-v, v).flatten(-3)

# IQ4_XS: d, scales_h u16, scales_l[4], qs[128]. element ib*32 + p*16 + i = d*scale(ib) * iq4nl[nibble p of qs[ib*16+i]],
#  ib = ib1*2+ib0; 6-bit scale: nibble ib0 of scales_l[ib1], 2 high bits ib of scales_h, minus 32
IQ4_N, IQ4_ORDER = dict(ib1=4, ib0=2, p=2, i=16), "ib1 ib0 p i"
def _iq4_xs(b: Tensor) -> Tensor:
  L = lambda x, src: _lay(x, src, IQ4_ORDER, **IQ4_N)
  lo = (L(b[..., 4:8], "ib1") >> L(_c((0, 4)), "ib0")) & 0xF
  hi = ((L(b[..., 2:4].bitcast(dtypes.uint16), "") >> L(_c(range(0, 16, 2), dtypes.uint16), "ib1 ib0")) & 3).cast(dtypes.uint8)
  sc = ((lo | (hi << 4)).cast(dtypes.int8) - 32).cast(dtypes.float32)
  q = _lookup("iq4nl", (L(b[..., 8:], "ib1 ib0 i") >> L(_c((0, 4)), "p")) & 0xF).cast(dtypes.float32)
  return ((_fp(b, 0, 4) * sc) * q).flatten(-4)

# TQ1_0: qs[48] qh[4] d. qs[0:32] gives elements n*32+m, qs[32:48] 160+n*16+m, qh 240+n*4+m: trit n of byte m is
#  ((byte * 3^n mod 256) * 3 >> 8) - 1. qs and qh are adjacent, so the load order is [52 bytes, 5 trits]; the 4 qh
#  bytes carry only 4 trits, the fifth lane is junk that meets a zero of x (linear) or is dropped (dequantize).
def _tq1_0(b: Tensor) -> Tensor:
  t = (b[..., :52].cast(dtypes.uint16).unsqueeze(-1) * _c((1, 3, 9, 27, 81), dtypes.uint16)) & 0xFF
  q = ((t * 3) >> 8).cast(dtypes.int8) - 1
  return _f16(b, 52).unsqueeze(-1) * q.cast(dtypes.float32)

def _tq1_load(x: Tensor) -> Tensor:
  seg = lambda lo, n, m: x[..., lo:lo+n*m].reshape(*x.shape[:-1], n, m).transpose(-1, -2)
  return seg(0, 5, 32).cat(seg(160, 5, 16), seg(240, 4, 4).pad(((0, 0),) * (x.ndim - 1) + ((0, 0), (0, 1))), dim=-2)

def _tq1_elems(v: Tensor) -> Tensor:
  seg = lambda lo, hi, n: v[..., lo:hi, :n].transpose(-1, -2).flatten(-2)
  return seg(0, 32, 5).cat(seg(32, 48, 5), seg(48, 52, 4), dim=-1)

# TQ2_0: qs[64] d. element h*128 + s*32 + l = d * (2-bit plane s of qs[h*32+l] - 1)
def _tq2_0(b: Tensor) -> Tensor:
  q = (_lay(b[..., :64], "h l", "h s l", h=2, s=4, l=32) >> _lay(_c((0, 2, 4, 6)), "s", "h s l", h=2, s=4, l=32)) & 3
  return _f16(b, 64) * (q.cast(dtypes.int8) - 1).cast(dtypes.float32).flatten(-3)

# MXFP4: e8m0 scale e, qs[16]. element p*16 + i = half of 2^(e-127) * mxfp4[nibble p of qs[i]]
def _mxfp4(b: Tensor) -> Tensor:
  e = b[..., :1].cast(dtypes.uint32)
  d = (e < 2).where(_c((0x00200000,), dtypes.uint32) << e, (e - 1) << 23).bitcast(dtypes.float32)  # e = 0, 1 are subnormal
  return d * _lookup("mxfp4", _unpack(b[..., 1:], 4).flatten(-2)).cast(dtypes.float32)

# ---------------------------------------------------------------- type table

@dataclass(frozen=True)
class QuantType:
  name: str
  id: int
  block: int        # elements per block
  nbytes: int       # bytes per block
  raw: Callable[[Tensor], Tensor]   # packed `[..., nb, nbytes]` -> values in load order (`[..., nb, block]` if no layout)
  layout: Layout | None = None

  @property
  def quantized(self) -> bool: return self.block > 1

  def unpack(self, b: Tensor) -> Tensor:
    """packed uint8 `[..., nb, nbytes]` -> float values `[..., nb, block]` in element order."""
    v = self.raw(b)
    return v if self.layout is None else self.layout.to_elems(v)

QTYPES: dict[int, QuantType] = {t.id: t for t in [
  QuantType("F32", 0, 1, 4, _native(dtypes.float32)),
  QuantType("F16", 1, 1, 2, _native(dtypes.float16)),
  QuantType("Q4_0", 2, 32, 18, _q4_0),
  QuantType("Q4_1", 3, 32, 20, _q4_1),
  QuantType("Q5_0", 6, 32, 22, _q5_0, _perm("p ih il", Q5_ORDER, **Q5_N)),
  QuantType("Q5_1", 7, 32, 24, _q5_1, _perm("p ih il", Q5_ORDER, **Q5_N)),
  QuantType("Q8_0", 8, 32, 34, _q8_0),
  QuantType("Q2_K", 10, 256, 84, _q2_k, _perm("h s lh ll", Q2K_ORDER, **Q2K_N)),
  QuantType("Q3_K", 11, 256, 110, _q3_k, _perm("h s1 s0 lh ll", Q3K_ORDER, **Q3K_N)),
  QuantType("Q4_K", 12, 256, 144, _q4_k, _perm("g1 g0 p l", K45_ORDER, **K45_N)),
  QuantType("Q5_K", 13, 256, 176, _q5_k, _perm("g1 g0 p l", K45_ORDER, **K45_N)),
  QuantType("Q6_K", 14, 256, 210, _q6_k, _perm("h q1 q0 lh ll", Q6K_ORDER, **Q6K_N)),
  QuantType("IQ2_XXS", 16, 256, 66, _iq2_xxs),
  QuantType("IQ4_XS", 23, 256, 136, _iq4_xs),
  QuantType("I8", 24, 1, 1, _native(dtypes.int8)),
  QuantType("I16", 25, 1, 2, _native(dtypes.int16)),
  QuantType("I32", 26, 1, 4, _native(dtypes.int32)),
  QuantType("I64", 27, 1, 8, _native(dtypes.int64)),
  QuantType("F64", 28, 1, 8, _native(dtypes.float64)),
  QuantType("BF16", 30, 1, 2, _bf16),
  QuantType("TQ1_0", 34, 256, 54, _tq1_0, Layout(_tq1_load, _tq1_elems)),
  QuantType("TQ2_0", 35, 256, 66, _tq2_0),
  QuantType("MXFP4", 39, 32, 17, _mxfp4),
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

  def loaded(self, dtype: DType | None = None) -> Tensor:
    """Values in the format's load order, `[*shape[:-1], nb, *S]` (see `Layout`); for contractions over the last axis."""
    if self._parent is not None: return self._parent[0].loaded(dtype)[self._parent[1]]
    x = self.qtype.raw(self.blocks)
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
  The dequantization is part of the same lazy graph, so a GEMV is one kernel that reads only packed bytes. Formats
  with a `Layout` are contracted in their load order, with x permuted to match."""
  if isinstance(w, QTensor) and (lay := w.qtype.layout) is not None:
    v = w.loaded(dtype)
    k = v.ndim - w.ndim + 1  # nb + load-order axes
    xl = lay.to_load(x.cast(dtype).reshape(*x.shape[:-1], w.shape[-1] // w.qtype.block, w.qtype.block)).flatten(-k)
    y = xl @ v.flatten(-k).transpose(-1, -2)
  else: y = x.cast(dtype) @ as_tensor(w, dtype).transpose(-1, -2)
  return y if bias is None else y + as_tensor(bias, dtype)
