"""GGML block formats as lazy tinygrad expressions, and the fused quantized linear / expert gather built on them.

This is the only module that knows block layouts. Each format is a function from the byte fields of packed blocks
(uint8 `[..., n_blocks, block_bytes]`) to values (float32 `[..., n_blocks, block_elems]`) written with plain Tensor
ops, so the scheduler fuses the unpacking into whatever consumes it (a matmul, a gather, a norm) and a kernel reads
only the packed bytes. Layouts follow ggml-common.h; every format is checked against `gguf.quants.dequantize`
(bit-exact: the float ops run in gguf-py's order).

Rules that keep the fused kernels honest (one kernel, each packed byte read once):
- Load each byte field once and fan it out with shifts by constant vectors along new axes, instead of slicing the same
  bytes twice for low and high bits.
- Produce values in a load order (`Layout`): tinygrad counts a load once per iteration of every loop enclosing it,
  up to the innermost loop its address depends on, unrolls only the last reduce axis (plus the one before when both
  are <= 3), and merges neighbouring axes that are contiguous in every index into one loop. So byte axes go outside and
  the fan-out axes they feed go inside. `linear` permutes x to match (x is small and cached), `dequant` permutes back.
- Gather experts per field, after broadcasting the field to the full block shape (`Packed`): a one-hot gather is a
  reduce, and the scheduler realizes a reduce that is read by two slices or broadcast afterwards, or one that reads
  a buffer (a lookup table) and is broadcast by the gather.
"""
from __future__ import annotations

import concurrent.futures, functools, os, weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from tinygrad import Tensor, UOp, dtypes

from tg_ds4.backend.buffers import host_empty, host_owned, host_tensor, host_view
from tg_ds4.backend.compat import DType, Ops, prod
from tg_ds4.quant import cgemm, intdot, settings
from tg_ds4.quant.activations import round_activations

# ---------------------------------------------------------------- layouts

def _c(vals, dtype: DType = dtypes.uint8) -> Tensor:
  """Device-free constant vector: folds into the kernel as immediates, no buffer and no arange reduce."""
  return Tensor.const(tuple(vals), dtype)

def _lay(x: Tensor, src: str, dst: list[str], n: dict[str, int]) -> Tensor:
  """View the last axis of `x` as named axes `src` (major to minor) and arrange them in `dst` order, with size 1 for
  the `dst` axes that `src` lacks (the field does not depend on them, they broadcast). `src=""` needs a last axis of 1."""
  s, lead = src.split(), x.shape[:-1]
  x = x.reshape(*lead, *(n[a] for a in s)).permute(*range(len(lead)), *(len(lead) + s.index(a) for a in dst if a in s))
  return x.reshape(*lead, *(n[a] if a in s else 1 for a in dst))

class Layout:
  """Named axes of a block. Values come out of a format in load `order`; `elems` is the order they have in the block.
  `lane` (default: the last axis of `order`) is the axis `linear` keeps as independent accumulators: its bytes and its
  x values are contiguous, so the per-lane multiply-adds vectorize."""
  def __init__(self, order: str, elems: str | None = None, lane: str | None = None, lanes: int | None = None, **n: int):
    self.order, self.elems, self.n = order.split(), (elems or order).split(), n
    self.lane, self.lanes = lane or self.order[-1], lanes
  @property
  def shape(self) -> tuple[int, ...]: return tuple(self.n[a] for a in self.order)
  @property
  def permuted(self) -> bool: return self.order != self.elems
  def lay(self, x: Tensor, src: str) -> Tensor: return _lay(x, src, self.order, self.n)
  def const(self, src: str, vals, dtype: DType = dtypes.uint8) -> Tensor: return self.lay(_c(vals, dtype), src)
  def to_load(self, x: Tensor) -> Tensor:
    """Element order `[..., nb, block]` -> load order `[..., nb, *shape]` (used on x in `linear`)."""
    return _lay(x, " ".join(self.elems), self.order, self.n)
  def to_elems(self, v: Tensor) -> Tensor:
    """Load order `[..., nb, *shape]` -> element order `[..., nb, block]`."""
    k = len(self.order)
    return v.permute(*range(v.ndim - k), *(v.ndim - k + self.order.index(a) for a in self.elems)).flatten(-k)

# ---------------------------------------------------------------- lookup tables (numbers from gguf-py, not pasted here)

def _tables() -> dict[str, np.ndarray]:
  from gguf.quants import IQ2_XXS, IQ4_NL, MXFP4
  IQ2_XXS.init_grid()
  assert IQ2_XXS.grid is not None
  # IQ2_XXS as float32 rows (grid entries 0x08, 0x19, 0x2b are exact; signs +-1 per bit of ksigns): a code's 8 values
  # are one vector load, no byte unpacking
  return {"iq2xxs_gridf": IQ2_XXS.grid.reshape(256, 8).astype(np.float32),
          "iq2_signs": 1 - 2 * ((np.frombuffer(IQ2_XXS.ksigns, dtype=np.uint8)[:, None] >> np.arange(8)) & 1).astype(np.float32),
          "iq4nl": np.array(IQ4_NL.kvalues, dtype=np.int8), "mxfp4": np.array(MXFP4.kvalues, dtype=np.int8)}
_TABLES = _tables()

@functools.cache
def _table(name: str, device: str) -> Tensor:
  # realized once per device, so a kernel indexing it only adds the tiny, capped table read
  return Tensor(_TABLES[name], device=device).realize()

def realize_tables(device: str) -> None:
  """Every lookup table on `device`, before any step is captured: a table first realized while a step is captured
  would have its copy captured into the step, and redone at every replay."""
  for name in _TABLES: _table(name, device)

# ---------------------------------------------------------------- packed blocks

_TYPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

def _typed(blocks: Tensor, dtype: DType) -> Tensor | None:
  """`blocks` (uint8 `[..., n, itemsize]`, a reshape of a whole realized buffer) as `dtype` values `[..., n, 1]` through a
  zero-copy view of that buffer, or None. A bitcast of bytes to a wider type is compiled as one load per byte joined by
  shifts and ors; the view gives the kernel a typed pointer, so the values load (and vectorize) as such."""
  u = blocks.uop
  while u.op is Ops.RESHAPE: u = u.src[0]
  if u.op is not Ops.BUFFER or (buf := u.buffer).size != prod(blocks.shape) or buf.offset % dtype.itemsize: return None
  views = _TYPED.setdefault(buf, {})
  if dtype not in views: views[dtype] = Tensor(UOp.from_buffer(buf.view(buf.size // dtype.itemsize, dtype, 0)))
  return views[dtype].reshape(*blocks.shape[:-1], 1)

class Packed:
  """Packed blocks `[*lead, nb, nbytes]` read as byte fields in a format's load order, with pending gathers `idx` of
  the leading axes (applied to each field once it is broadcast to the full block shape)."""
  def __init__(self, blocks: Tensor, lay: Layout, idx: tuple = ()):
    self.blocks, self.lay, self.idx = blocks, lay, idx

  def field(self, off: int, n: int, src: str = "", dtype: DType = dtypes.uint8, view: Callable[[Tensor], Tensor] | None = None,
            t: int = 0) -> Tensor:
    """Bytes [off, off+n) of each block (reshaped by `view`, bitcast to `dtype`) as named axes `src`, laid out in load
    order. `t` adds a trailing axis of that size for a table lookup (`lookup`). A whole block of one wider value (the
    native types) is read through a typed view of the buffer when there is one (`_typed`)."""
    if dtype.itemsize > 1 and off == 0 and n == dtype.itemsize == self.blocks.shape[-1] and view is None and \
       (x := _typed(self.blocks, dtype)) is not None: pass
    else:
      x = self.blocks[..., off:off+n]
      if view is not None: x = view(x)
      if dtype != dtypes.uint8: x = x.bitcast(dtype)
    x = self.lay.lay(x, src)
    # broadcast first: the scheduler realizes a computed value that a one-hot compare broadcasts, and a reduce (gather,
    # table lookup) that is broadcast afterwards
    if t: x = x.unsqueeze(-1)
    if t or self.idx: x = x.expand(*self.blocks.shape[:-1], *self.lay.shape, *((t,) if t else ()))
    for i in self.idx: x = x[i]
    return x

  def f16(self, off: int) -> Tensor: return self.field(off, 2, dtype=dtypes.float16).cast(dtypes.float32)

  def lookup(self, name: str, codes: Tensor, axis: str | None = None) -> Tensor:
    """table[codes] for `codes` `[..., T]` from a `field(..., t=T)`; a `[T, m]` table adds its row along `axis`. The
    one-hot reduce over T becomes one indexed load per code in codegen."""
    tab = _table(name, self.blocks.device)
    if tab.ndim == 2: tab = tab.transpose(0, 1).reshape(*(tab.shape[1] if a == axis else 1 for a in self.lay.order), tab.shape[0])
    return (codes == Tensor.arange(tab.shape[-1])).where(tab, 0).sum(-1, dtype=tab.dtype)

def _bits(t: Tensor) -> bool: return settings.current(t.device).caps.float_bits

def small_float(u: Tensor, c: float = 0.0) -> Tensor:
  """float32(u + c) for unsigned integer codes u < 2**23, through their bits (where Capabilities.float_bits): the float
  whose bits are 0x4B000000 | u is 2**23 + u exactly, so an or and an exact subtract take the place of a conversion."""
  return (u.cast(dtypes.uint32) | 0x4B000000).bitcast(dtypes.float32) - (2.0 ** 23 - c)

Affine = tuple[Tensor, Tensor, float]  # (d, q, c): value = d * (q + c), one d per block (QuantType.affine)

def _pick(i: Tensor, opts: list[Tensor]) -> Tensor:
  """opts[i] by selects: the loads of `opts` do not depend on the loop of `i`, so they stay outside it."""
  return functools.reduce(lambda acc, k: (i == k).where(opts[k], acc), range(1, len(opts)), opts[0])

# ---------------------------------------------------------------- formats (each returns values in its layout's load order)

def _native(nbytes: int, dtype: DType) -> Callable[[Packed], Tensor]: return lambda p: p.field(0, nbytes, dtype=dtype)

def _f16(p: Packed) -> Tensor:
  """F16 values. On the CPU as float32 built from the bits with integer ops (exact for every half, subnormals, inf and
  nan included): clang converts `__fp16` one scalar at a time, which kept V4's F16 compressor and router GEMVs scalar;
  the integer form vectorizes. Elsewhere the device's own half loads."""
  if not str(p.blocks.device).startswith("CPU"): return p.field(0, 2, dtype=dtypes.float16)
  h = p.field(0, 2, dtype=dtypes.uint16).cast(dtypes.uint32)
  em = (h & 0x7FFF) << 13                                # exponent and mantissa in float32's places, exponent bias 15
  f = (em.bitcast(dtypes.float32) * 2.0 ** 112).bitcast(dtypes.uint32)        # rebias by 2^(127-15); scales subnormals too
  f = (em >= 0x7C00 << 13).where(em | 0x7F800000, f)     # inf, nan: all-ones exponent
  return (f | ((h & 0x8000) << 16)).bitcast(dtypes.float32)

def _bf16(p: Packed) -> Tensor:
  # bf16 is the top half of an f32: widen the raw bits and shift, exact and independent of device bf16 support
  return (p.field(0, 2, dtype=dtypes.uint16).cast(dtypes.uint32) << 16).bitcast(dtypes.float32)

# Q4_0/Q4_1: d [m] qs[16]. element p*16 + i = nibble p of qs[i]
Q4 = Layout("p i", p=2, i=16)
def _nib(p: Packed, off: int) -> Tensor: return (p.field(off, 16, "i") >> p.lay.const("p", (0, 4))) & 0xF
def _q4_0(p: Packed) -> Tensor:
  return p.f16(0) * (small_float(n, -8) if _bits(n := _nib(p, 2)) else (n.cast(dtypes.int8) - 8).cast(dtypes.float32))
def _q4_1(p: Packed) -> Tensor: return p.f16(0) * (small_float(n) if _bits(n := _nib(p, 4)) else n.cast(dtypes.float32)) + p.f16(2)
def _q4_0_affine(p: Packed, b: Packed) -> Affine: return b.f16(0), _nib(p, 2).cast(dtypes.float32), -8.0

# Q5_0/Q5_1: d [m] qh(u32) qs[16]. element p*16 + l: nibble p of qs[l], 5th bit = bit p*16+l of qh
Q5 = Layout("p l", p=2, l=16)
def _q5(p: Packed, qh: int) -> Tensor:
  # the two parts meet in float (ql + 16 * hb, exact): joined as bytes (ql | hb << 4) the C compiler vectorised the GEMV
  # 4 lanes wide instead of 16
  ql = ((p.field(qh+4, 16, "l") >> p.lay.const("p", (0, 4))) & 0xF).cast(dtypes.float32)
  qh16 = p.field(qh, 4, dtype=dtypes.uint32) >> p.lay.const("p", (0, 16), dtypes.uint32)  # two shifts: a constant indexed
  hb = ((qh16 >> p.lay.const("l", range(16), dtypes.uint32)) & 1).cast(dtypes.float32)    # by a loop is a chain of selects
  return ql + hb * 16
def _q5_0(p: Packed) -> Tensor: return p.f16(0) * (_q5(p, 2) - 16)
def _q5_1(p: Packed) -> Tensor: return p.f16(0) * _q5(p, 4) + p.f16(2)

Q8 = Layout("i", i=32)
def _q8_0(p: Packed) -> Tensor:
  if _bits(p.blocks): return small_float(p.field(2, 32, "i") ^ 0x80, -128) * p.f16(0)  # int8 v as the byte v + 128
  return p.field(2, 32, "i", dtypes.int8).cast(dtypes.float32) * p.f16(0)
def _q8_0_affine(p: Packed, b: Packed) -> Affine: return b.f16(0), p.field(2, 32, "i", dtypes.int8).cast(dtypes.float32), 0.0

# Q2_K: scales[16] qs[64] d dmin. element h*128 + s*32 + lh*16 + ll: 2-bit plane s of qs[h*32+lh*16+ll], scale h*8+s*2+lh
Q2K = Layout("h lh s ll", "h s lh ll", h=2, s=4, lh=2, ll=16)
def _q2_k(p: Packed) -> Tensor:
  sc = p.field(0, 16, "h s lh")
  q = ((p.field(16, 64, "h lh ll") >> p.lay.const("s", (0, 2, 4, 6))) & 3).cast(dtypes.float32)
  return (p.f16(80) * (sc & 0xF).cast(dtypes.float32)) * q - p.f16(82) * (sc >> 4).cast(dtypes.float32)

# Q3_K: hmask[32] qs[64] scales[12] d. element h*128 + s*32 + lh*16 + ll (s = s1*2+s0, l = lh*16+ll):
#  2 low bits = plane s of qs[h*32+l], high bit (inverted: set means no -4) = bit h*4+s of hmask[l],
#  6-bit scale k = h*8+s*2+lh: nibble h of scales[s*2+lh], 2 high bits h*2+s1 of scales[8+s0*2+lh].
# lh and ll are kept apart in the load order: adjacent, they merge into one loop and the scales (which depend on lh
# only) are re-read in it. The scale bytes are picked by s from loads indexed by lh only, so they leave the h, s loops.
Q3K = Layout("lh h s1 s0 ll", "h s1 s0 lh ll", h=2, s1=2, s0=2, lh=2, ll=16)
def _q3_k(p: Packed) -> Tensor:
  c = p.lay.const
  ql = (p.field(32, 64, "h lh ll") >> c("s1 s0", (0, 2, 4, 6))) & 3
  qh = (p.field(0, 32, "lh ll") >> c("h s1 s0", range(8))) & 1
  q = (ql.cast(dtypes.int8) - ((qh ^ 1) << 2).cast(dtypes.int8)).cast(dtypes.float32)
  lo = (_pick(c("s1 s0", range(4)), [p.field(96+2*i, 2, "lh") for i in range(4)]) >> c("h", (0, 4))) & 0xF
  hi = (_pick(c("s0", range(2)), [p.field(104+2*i, 2, "lh") for i in range(2)]) >> c("h s1", (0, 2, 4, 6))) & 3
  sc = ((lo | (hi << 4)).cast(dtypes.int8) - 32).cast(dtypes.float32)
  return (p.f16(108) * sc) * q

# Q4_K/Q5_K: d dmin scales[12] [qh[32]] qs[128]. element g*64 + p*32 + l with g = g1*2+g0: nibble p of qs[g*32+l],
#  5th bit = bit g*2+p of qh[l]; sub-block g1*4 + j (j = g0*2+p) takes its 6-bit scale/min from bytes j, 4+j, 8+j
K45 = Layout("l g1 g0 p", "g1 g0 p l", lane="l", lanes=32, g1=2, g0=2, p=2, l=32)
def _k45(p: Packed, qs: int) -> Tensor:
  c = p.lay.const
  A, B, C = (p.field(o, 4, "g0 p") for o in (4, 8, 12))
  hi = c("g1", (False, True), dtypes.bool)  # sub-blocks 4..7 keep their low 4 bits in C and top 2 in A/B
  sc, mn = hi.where((C & 0xF) | ((A >> 6) << 4), A & 63), hi.where((C >> 4) | ((B >> 6) << 4), B & 63)
  q = (p.field(qs, 128, "g1 g0 l") >> c("p", (0, 4))) & 0xF
  if qs == 48: q = q | (((p.field(16, 32, "l") >> c("g1 g0 p", range(8))) & 1) << 4)
  return (p.f16(0) * sc.cast(dtypes.float32)) * q.cast(dtypes.float32) - p.f16(2) * mn.cast(dtypes.float32)
def _q4_k(p: Packed) -> Tensor: return _k45(p, 16)
def _q5_k(p: Packed) -> Tensor: return _k45(p, 48)

# Q6_K: ql[128] qh[64] scales[16] d. element h*128 + q*32 + lh*16 + ll (q = q1*2+q0):
#  low nibble q1 of ql[h*64+q0*32+l], 2 high bits = plane q of qh[h*32+l], int8 scale h*8+q*2+lh
Q6K = Layout("h lh q0 q1 ll", "h q1 q0 lh ll", h=2, q1=2, q0=2, lh=2, ll=16)
def _q6_k(p: Packed) -> Tensor:
  c = p.lay.const
  ql = (p.field(0, 128, "h q0 lh ll") >> c("q1", (0, 4))) & 0xF
  qh = (p.field(128, 64, "h lh ll") >> c("q1 q0", (0, 2, 4, 6))) & 3
  q = ((ql | (qh << 4)).cast(dtypes.int8) - 32).cast(dtypes.float32)
  return (p.f16(208) * p.field(192, 16, "h q1 q0 lh", dtypes.int8).cast(dtypes.float32)) * q

# IQ2_XXS: d, then 8 sub-blocks of (4 grid-index bytes, u32 w). element ib*32 + k*8 + j = ±grid[idx k][j] * d*(0.5+(w>>28))/4,
#  the sign of j is bit j of ksigns[(w >> 7k) & 127]
IQ2XXS = Layout("ib k j", ib=8, k=4, j=8)
def _iq2_xxs(p: Packed) -> Tensor:
  half = lambda h: lambda x: x.reshape(*x.shape[:-1], 8, 2, 4)[..., h, :].flatten(-2)
  grid = p.lookup("iq2xxs_gridf", p.field(2, 64, "ib k", view=half(0), t=256), "j")
  sidx = (p.field(2, 64, "ib", dtypes.uint32, half(1), t=128) >> p.lay.const("k", (0, 7, 14, 21), dtypes.uint32).unsqueeze(-1)) & 127
  w = p.field(2, 64, "ib", dtypes.uint32, half(1))
  return ((p.f16(0) * ((w >> 28).cast(dtypes.float32) + 0.5) * 0.25) * grid) * p.lookup("iq2_signs", sidx, "j")

# IQ4_XS: d, scales_h u16, scales_l[4], qs[128]. element ib*32 + p*16 + i = d*scale(ib) * iq4nl[nibble p of qs[ib*16+i]],
#  ib = ib1*2+ib0; 6-bit scale: nibble ib0 of scales_l[ib1], 2 high bits 2*ib of scales_h, minus 32
IQ4XS = Layout("ib1 ib0 p i", ib1=4, ib0=2, p=2, i=16)
def _iq4_xs(p: Packed) -> Tensor:
  c = p.lay.const
  lo = (p.field(4, 4, "ib1") >> c("ib0", (0, 4))) & 0xF
  hi = ((p.field(2, 2, dtype=dtypes.uint16) >> c("ib1 ib0", range(0, 16, 2), dtypes.uint16)) & 3).cast(dtypes.uint8)
  sc = ((lo | (hi << 4)).cast(dtypes.int8) - 32).cast(dtypes.float32)
  q = p.lookup("iq4nl", (p.field(8, 128, "ib1 ib0 i", t=16) >> c("p", (0, 4)).unsqueeze(-1)) & 0xF).cast(dtypes.float32)
  return (p.f16(0) * sc) * q

# TQ1_0: qs[48] qh[4] d. qs[0:32] gives elements n*32+m, qs[32:48] 160+n*16+m, qh 240+n*4+m: trit n of byte m is
#  ((byte * 3^n mod 256) * 3 >> 8) - 1. qs and qh are adjacent, so the load order is [52 bytes, 5 trits]; the 4 qh
#  bytes carry only 4 trits, their fifth lane is junk that meets a zero of x (linear) or is dropped (dequant).
class _TQ1Layout(Layout):
  def __init__(self): super().__init__("m n", lane="m", m=52, n=5)
  @property
  def permuted(self) -> bool: return True
  def to_load(self, x: Tensor) -> Tensor:
    seg = lambda lo, n, m: x[..., lo:lo+n*m].reshape(*x.shape[:-1], n, m).transpose(-1, -2)
    return seg(0, 5, 32).cat(seg(160, 5, 16), seg(240, 4, 4).pad(((0, 0),) * (x.ndim - 1) + ((0, 0), (0, 1))), dim=-2)
  def to_elems(self, v: Tensor) -> Tensor:
    seg = lambda lo, hi, n: v[..., lo:hi, :n].transpose(-1, -2).flatten(-2)
    return seg(0, 32, 5).cat(seg(32, 48, 5), seg(48, 52, 4), dim=-1)
def _tq1_0(p: Packed) -> Tensor:
  t = (p.field(0, 52, "m").cast(dtypes.uint16) * p.lay.const("n", (1, 3, 9, 27, 81), dtypes.uint16)) & 0xFF
  return p.f16(52) * (((t * 3) >> 8).cast(dtypes.int8) - 1).cast(dtypes.float32)

# TQ2_0: qs[64] d. element h*128 + s*32 + l = d * (2-bit plane s of qs[h*32+l] - 1)
TQ2 = Layout("h l s", "h s l", lane="l", h=2, s=4, l=32)
def _tq2_0(p: Packed) -> Tensor:
  q = (p.field(0, 64, "h l") >> p.lay.const("s", (0, 2, 4, 6))) & 3
  return p.f16(64) * (q.cast(dtypes.int8) - 1).cast(dtypes.float32)

# MXFP4: e8m0 exponent e, qs[16]. element p*16 + i = 2^(e-128) * mxfp4[nibble p of qs[i]] (table values are doubled)
def _mxfp4(p: Packed) -> Tensor:
  e = p.field(0, 1).cast(dtypes.uint32)
  d = (e < 2).where(_c((0x00200000,), dtypes.uint32) << e, (e - 1) << 23).bitcast(dtypes.float32)  # e = 0, 1 are subnormal
  return d * p.lookup("mxfp4", (p.field(1, 16, "i", t=16) >> p.lay.const("p", (0, 4)).unsqueeze(-1)) & 0xF).cast(dtypes.float32)

# Internal CPU formats (not in GGUF files; see `widen_k_quant`): a K-quant's values as int8 with their sub-block scale
# (and min) multiplied out to float32, which is exact (an fp16 times a 6- or 8-bit integer fits in float32's mantissa),
# so every value is computed by the same float ops as from the original. 1.25 bytes per weight.
# Q8_S16 (from Q6_K): scale f32, q[16] int8; value = scale * q
Q8S16 = Layout("i", i=16)
def _q8_s16(p: Packed) -> Tensor: return p.field(0, 4, dtype=dtypes.float32) * p.field(4, 16, "i", dtypes.int8).cast(dtypes.float32)
# Q8_M32 (from Q4_K): scale f32, min f32, q[32] uint8; value = scale * q - min
def _q8_m32(p: Packed) -> Tensor:
  return p.field(0, 4, dtype=dtypes.float32) * p.field(8, 32, "i").cast(dtypes.float32) - p.field(4, 4, dtype=dtypes.float32)

# ---------------------------------------------------------------- type table

@dataclass(frozen=True)
class QuantType:
  name: str
  id: int
  block: int        # elements per block
  nbytes: int       # bytes per block
  raw: Callable[[Packed], Tensor]   # fields -> values in load order `[..., nb, *layout.shape]`
  layout: Layout = Layout("i", i=1)
  # value = d * (q + c) with one d per block: (element fields, per-block fields) -> (d, q, c); the CPU's GEMV then
  # scales each block's partial sums once instead of every value (`linear`). Only where measured faster (Q4_0, Q8_0);
  # Q4_1, Q5_0 (bound by its fifth bits) and the widened Q4_K (its min a second per-block term) gained nothing
  affine: Callable[[Packed, Packed], Affine] | None = None

  @property
  def quantized(self) -> bool: return self.block > 1

  def unpack(self, b: Tensor) -> Tensor:
    """packed uint8 `[..., nb, nbytes]` -> values `[..., nb, block]` in element order."""
    return self.layout.to_elems(self.raw(Packed(b, self.layout)).expand(*b.shape[:-1], *self.layout.shape))

def _nat(name: str, id: int, dtype: DType) -> QuantType: return QuantType(name, id, 1, dtype.itemsize, _native(dtype.itemsize, dtype))

QTYPES: dict[int, QuantType] = {t.id: t for t in [
  _nat("F32", 0, dtypes.float32),
  QuantType("F16", 1, 1, 2, _f16),
  QuantType("Q4_0", 2, 32, 18, _q4_0, Q4, _q4_0_affine),
  QuantType("Q4_1", 3, 32, 20, _q4_1, Q4),
  QuantType("Q5_0", 6, 32, 22, _q5_0, Q5),
  QuantType("Q5_1", 7, 32, 24, _q5_1, Q5),
  QuantType("Q8_0", 8, 32, 34, _q8_0, Q8, _q8_0_affine),
  QuantType("Q2_K", 10, 256, 84, _q2_k, Q2K),
  QuantType("Q3_K", 11, 256, 110, _q3_k, Q3K),
  QuantType("Q4_K", 12, 256, 144, _q4_k, K45),
  QuantType("Q5_K", 13, 256, 176, _q5_k, K45),
  QuantType("Q6_K", 14, 256, 210, _q6_k, Q6K),
  QuantType("IQ2_XXS", 16, 256, 66, _iq2_xxs, IQ2XXS),
  QuantType("IQ4_XS", 23, 256, 136, _iq4_xs, IQ4XS),
  _nat("I8", 24, dtypes.int8),
  _nat("I16", 25, dtypes.int16),
  _nat("I32", 26, dtypes.int32),
  _nat("I64", 27, dtypes.int64),
  _nat("F64", 28, dtypes.float64),
  QuantType("BF16", 30, 1, 2, _bf16),
  QuantType("TQ1_0", 34, 256, 54, _tq1_0, _TQ1Layout()),
  QuantType("TQ2_0", 35, 256, 66, _tq2_0, TQ2),
  QuantType("MXFP4", 39, 32, 17, _mxfp4, Q4),
]}
INTERNAL = {t.name: t for t in [QuantType("Q8_S16", -1, 16, 20, _q8_s16, Q8S16), QuantType("Q8_M32", -2, 32, 40, _q8_m32, Q8)]}
QTYPE_BY_NAME = {t.name: t for t in QTYPES.values()} | INTERNAL

def dequantize(blocks: Tensor, qtype: QuantType | int | str) -> Tensor:
  """Packed uint8 `[..., n_blocks, block_bytes]` -> values `[..., n_blocks * block_elems]` (lazy)."""
  qt = qtype if isinstance(qtype, QuantType) else QTYPES[qtype] if isinstance(qtype, int) else QTYPE_BY_NAME[qtype]
  return qt.unpack(blocks).flatten(-2)

# ---------------------------------------------------------------- packed tensors

class QTensor:
  """A GGUF tensor that stays packed: `blocks` is uint8 `[*shape[:-1], shape[-1] // block, block_bytes]`.

  `shape` is the logical (tinygrad-order) shape. Indexing the leading axes (expert ids, token ids) is recorded and
  applied per byte field when the values are built (see `Packed`), so a lookup reads only the rows it selects and
  fuses into its consumer; `blocks` of an indexed QTensor is the equivalent (lazy) gather of the packed bytes."""
  def __init__(self, blocks: Tensor, qtype: QuantType, shape: tuple[int, ...], _src: tuple[Tensor, tuple[Any, ...]] | None = None,
               x8: Tensor | None = None):
    assert blocks.shape == (*shape[:-1], shape[-1] // qtype.block, qtype.nbytes), (blocks.shape, shape, qtype)
    self.blocks, self.qtype, self.shape = blocks, qtype, tuple(shape)
    self._src = _src or (blocks, ())  # ungathered blocks and the indices applied to them, in order
    self.x8 = x8  # Q4_0 only: the ungathered bytes as `interleave_q4_0` lays them out (`_src[0]` is then a view of them)

  def __repr__(self): return f"QTensor({self.qtype.name}, shape={self.shape}, device={self.device})"
  @property
  def device(self): return self.blocks.device
  @property
  def nbytes(self) -> int: return prod(self.blocks.shape)
  @property
  def ndim(self) -> int: return len(self.shape)

  def loaded(self, dtype: DType | None = None) -> Tensor:
    """Values in the format's load order, `[*shape[:-1], nb, *layout.shape]`; for contractions over the last axis."""
    lay = self.qtype.layout
    x = self.qtype.raw(Packed(self._src[0], lay, self._src[1]))
    x = x.expand(*self.shape[:-1], self.shape[-1] // self.qtype.block, *lay.shape)  # a field-free axis would stay size 1
    return x if dtype is None or x.dtype == dtype else x.cast(dtype)

  def dequant(self, dtype: DType | None = None) -> Tensor: return self.qtype.layout.to_elems(self.loaded(dtype)).flatten(-2)

  def affine(self, lanes: int, dtype: DType | None = None) -> Affine:
    """The parts of `QuantType.affine`: q `[*shape[:-1], nb, *layout.shape]` in load order, d `[*shape[:-1], nb, lanes]`,
    per block, broadcast over `lanes` accumulators before any gather (see `Packed`)."""
    qt, nb = self.qtype, self.shape[-1] // self.qtype.block
    d, q, c = qt.affine(Packed(self._src[0], qt.layout, self._src[1]), Packed(self._src[0], Layout("j", j=lanes), self._src[1]))
    cast = lambda t: t if dtype is None or t.dtype == dtype else t.cast(dtype)
    return cast(d.expand(*self.shape[:-1], nb, lanes)), cast(q.expand(*self.shape[:-1], nb, *qt.layout.shape)), c

  def __getitem__(self, idx) -> QTensor:
    """Index leading axes only (the packed last axis cannot be sliced mid-block). An index tensor (expert or token ids,
    always in range) is, on the CPU (backend.Capabilities.in_range_gathers), taken modulo the axis as unsigned: the compiler can then
    prove every gathered row in range and loads its bytes unconditionally, not each behind a bounds check that keeps
    clang from vectorizing the row (a V2-Lite-shaped expert GEMV). A power-of-two axis makes it one `&`; the row offset
    is computed once per row either way."""
    if isinstance(idx, Tensor) and dtypes.is_int(idx.dtype) and settings.current(self.blocks.device).caps.in_range_gathers:
      idx = (idx.cast(dtypes.uint32) % self.shape[0]).cast(dtypes.int32)
    blocks = self.blocks[idx]
    return QTensor(blocks, self.qtype, (*blocks.shape[:-2], self.shape[-1]), (self._src[0], self._src[1] + (idx,)), self.x8)

  def to(self, device: str) -> QTensor:
    base, idx = self._src
    mv = lambda i: i.to(device) if isinstance(i, Tensor) else tuple(map(mv, i)) if isinstance(i, tuple) else i
    return functools.reduce(lambda q, i: q[mv(i)], idx, QTensor(base.to(device), self.qtype, (*base.shape[:-2], base.shape[-2] * self.qtype.block)))

Weight = Tensor | QTensor

def _realized(a: np.ndarray, device: str) -> Tensor:
  """A re-encoded weight realized now, at load: a lazy `Tensor(a)` would first be copied inside the first captured
  step, and that copy replayed with it (a prefill chunk re-copied qwen2.5's widened weights, ~130 MB, every time)."""
  return host_tensor(a, device)

def q5_0_as_q8_0(w: QTensor) -> QTensor:
  """The same weight re-encoded as Q8_0: each block keeps its fp16 scale and its 5-bit values minus 16 become the int8
  values, so every dequantized value is identical. 34 bytes per 32 weights instead of 22, but tinygrad's CPU code for a
  Q8_0 GEMV is faster per weight than for Q5_0, whose 5th bits cost a shift and mask per weight."""
  assert w.qtype.name == "Q5_0" and w._src[1] == (), w
  b = w.blocks.numpy()
  qh = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)                                    # [..., nb, 1]
  q = np.concatenate([b[..., 6:22] & 0xF, b[..., 6:22] >> 4], axis=-1).astype(np.int16)   # element j: nibble, then
  q |= ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16) << 4                 # bit j of qh as the 5th
  out = np.concatenate([b[..., 0:2], (q - 16).astype(np.int8).view(np.uint8)], axis=-1)
  return QTensor(_realized(out, w.device), QTYPE_BY_NAME["Q8_0"], w.shape)

X8 = 8  # output rows per group of interleave_q4_0's layout
_REPACK_THREADS = min(4, os.cpu_count() or 1)
REPACK_GROUPS = 4096  # groups of 8 rows per repacking thread at least (~4 MB of V2-Lite's rows)
_Q4_0_FIELDS = np.dtype([("d", "<u2"), ("q", "<u4", (4,))])    # a Q4_0 block: its scale, its 16 quant bytes as 4 words
_Q4_0_X8 = np.dtype([("d", "<u2", (X8,)), ("q", "<u4", (4, X8))])  # a group's block: 8 scales, then word k of each row

def interleave_q4_0(w: QTensor) -> QTensor:
  """A Q4_0 matrix (or stack of expert matrices) with a row count that is a multiple of X8, its bytes laid out for
  quant/intdot.py's repacked GEMV (ggml's q4_0_8x8 arithmetic): per group of 8 rows and block, the 8 fp16 scales
  (16 bytes), then for k = 0..3 the 8 rows' quant bytes 4k..4k+3 side by side (32 bytes each). One 32-byte load then
  holds, for each of the 8 rows, the 4 weight bytes that one broadcast dword of x multiplies, where the file's layout
  needs the 8 rows' blocks transposed in registers for every block of every GEMV. The values are the same bytes:
  everything else that reads the weight (a float dequant, a gather) reads `blocks`, a lazy view that restores the
  file's layout from them. Made at load (models/widen.py), where the CPU takes Q4_0's integer dots."""
  assert w.qtype.name == "Q4_0" and w._src[1] == () and w.x8 is None and w.shape[-2] % X8 == 0, w
  b, nb = host_view(w.blocks), w.shape[-1] // 32
  v = (b if b is not None else w.blocks.numpy()).reshape(-1, X8, nb, 18).view(_Q4_0_FIELDS)[..., 0]   # [G, 8 rows, nb]
  phys = host_empty((v.shape[0], nb), _Q4_0_X8)   # moved as 2- and 4-byte fields: a byte-wise transpose is ~5x slower
  def part(a: int, b: int) -> None: phys["d"][a:b], phys["q"][a:b] = v["d"][a:b].transpose(0, 2, 1), v["q"][a:b].transpose(0, 2, 3, 1)
  n = min(_REPACK_THREADS, max(1, len(v) // REPACK_GROUPS))  # numpy's copies release the GIL: the groups split over threads
  with concurrent.futures.ThreadPoolExecutor(n) as pool: list(pool.map(part, *zip(*[(i * len(v) // n, (i + 1) * len(v) // n) for i in range(n)])))
  x8 = host_owned(phys.view(np.uint8).reshape(*w.shape[:-2], w.shape[-2] // X8, nb, 8 * 18), w.device)
  return QTensor(_deinterleave(x8, w.shape), w.qtype, w.shape, x8=x8)

def _deinterleave(x8: Tensor, shape: tuple[int, ...]) -> Tensor:
  """interleave_q4_0's bytes `[*lead, G, nb, 144]` -> the file's blocks `[*lead, G * 8, nb, 18]`, lazily."""
  *lead, G, nb, _ = x8.shape
  n = len(lead)
  s = x8[..., :16].reshape(*lead, G, nb, X8, 2).permute(*range(n), n, n + 2, n + 1, n + 3)                 # [..., G, 8, nb, 2]
  q = x8[..., 16:].reshape(*lead, G, nb, 4, X8, 4).permute(*range(n), n, n + 3, n + 1, n + 2, n + 4)      # [..., G, 8, nb, 4, 4]
  return s.cat(q.reshape(*lead, G, X8, nb, 16), dim=-1).reshape(*shape[:-1], nb, 18)

def _f32_bytes(a: np.ndarray) -> np.ndarray: return np.ascontiguousarray(a.astype(np.float32)[..., None]).view(np.uint8)

def _q6_k_as_q8_s16(b: np.ndarray) -> np.ndarray:
  ql, qh, sc, d = b[..., :128], b[..., 128:192], b[..., 192:208].view(np.int8), b[..., 208:210].view(np.float16)
  parts = []  # element h*128 + q*32 + l: nibble q>>1 of ql[h*64 + (q&1)*32 + l], high bits = plane q of qh[h*32 + l]
  for h in range(2):
    for q in range(4):
      lo = (ql[..., h*64 + (q & 1)*32:][..., :32] >> (4 * (q >> 1))) & 0xF
      parts.append((lo | (((qh[..., h*32:h*32 + 32] >> (2 * q)) & 3) << 4)).astype(np.int8) - 32)
  q = np.concatenate(parts, axis=-1).reshape(*b.shape[:-1], 16, 16)            # 16 sub-blocks of 16, scale index = e // 16
  return np.concatenate([_f32_bytes(d.astype(np.float32) * sc.astype(np.float32)), q.view(np.uint8)], axis=-1)

def _q4_k_as_q8_m32(b: np.ndarray) -> np.ndarray:
  d, dmin = b[..., 0:2].view(np.float16).astype(np.float32), b[..., 2:4].view(np.float16).astype(np.float32)
  A, B, C, qs = b[..., 4:8], b[..., 8:12], b[..., 12:16], b[..., 16:144]
  sc = np.concatenate([A & 63, (C & 0xF) | ((A >> 6) << 4)], axis=-1).astype(np.float32)   # sub-blocks 0..3, 4..7
  mn = np.concatenate([B & 63, (C >> 4) | ((B >> 6) << 4)], axis=-1).astype(np.float32)
  q = np.stack([qs.reshape(*qs.shape[:-1], 4, 32) & 0xF, qs.reshape(*qs.shape[:-1], 4, 32) >> 4], axis=-2)  # sub-block 2g+p
  return np.concatenate([_f32_bytes(d * sc), _f32_bytes(dmin * mn), q.reshape(*b.shape[:-1], 8, 32)], axis=-1)

_WIDEN = {"Q6_K": ("Q8_S16", _q6_k_as_q8_s16), "Q4_K": ("Q8_M32", _q4_k_as_q8_m32)}
K_WIDENED = {k: INTERNAL[v] for k, (v, _) in _WIDEN.items()}  # K-quant name -> the format it is widened to

def widen_k_quant(w: QTensor) -> QTensor:
  """A Q6_K or Q4_K weight re-encoded in the internal Q8_S16 / Q8_M32 format: the same values bit for bit, 1.25 bytes
  per weight instead of 0.82 / 0.56, and a GEMV with per-value work of one int8 convert and multiply-add (the K-quant
  bit fields cost several times the instructions per weight)."""
  assert w.qtype.name in _WIDEN and w._src[1] == (), w
  qt, conv = K_WIDENED[w.qtype.name], _WIDEN[w.qtype.name][1]
  out = conv(w.blocks.numpy()).reshape(*w.shape[:-1], w.shape[-1] // qt.block, qt.nbytes)
  return QTensor(_realized(out, w.device), qt, w.shape)

def as_tensor(w: Weight, dtype: DType | None = dtypes.float32) -> Tensor:
  if isinstance(w, QTensor): return w.dequant(dtype)
  return w if dtype is None or w.dtype == dtype else w.cast(dtype)

GPU_BLOCK = 32   # values per block up to which a GPU's GEMV gives each thread whole blocks (backend/gpu's packed_gemv
                 # unrolls them); a 256-value block (K-quants, IQ2) has too few per row to share a row over 32 threads
LANES = 16       # accumulators per row in a GEMV: 16 float32 = one 512-bit vector (two 256-bit ones)
LANES_MAX_ROWS = 8  # x rows per weight matrix up to which `linear` uses the lanes form (measured: it wins from 1 row to 8,
                    # the plain matmul form at 16 and 32)

def linear(x: Tensor, w: Weight, bias: Weight | None = None, dtype: DType | None = None, affine: bool = True) -> Tensor:
  """`x @ w.T (+ bias)` with `w` `[out, in]` (or `[E, out, in]` after an expert gather, then x is `[E, ..., in]`). The
  dequantization is part of the same lazy graph, so a GEMV is one kernel that reads only packed bytes. Quantized
  weights are contracted in their load order, with x permuted to match. For a GEMV (one weight matrix or a gather of
  experts, at most `LANES_MAX_ROWS` rows of x) the contraction is two sums: first over the blocks and every layout
  axis but `LANES` consecutive positions of the layout's lane axis, then over those lanes. The first sum keeps one
  accumulator per lane, which the C compiler turns into vector multiply-adds; a plain dot product is one chain of
  dependent scalar adds (float addition is not reassociated). Where quant/activations.py says so ("llama.cpp"
  numerics, or "auto" for the formats below), x is first rounded the way llama.cpp rounds the input of a matmul with
  this weight type, and where the backend can (quant/intdot.py: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q2_K/Q4_K/Q6_K/IQ2_XXS on an AVX2 CPU) the GEMV takes
  llama.cpp's integer block dot products instead of this float form. `dtype`: that of x and the dequantized weight
  (default: the current settings' matmul type, float32 unless the model asks for half); accumulation and the result are float32
  either way. The per-block form of a format that has one (QuantType.affine) is for one row of x only: with several
  rows (a batched step) and with `affine=False` (nn/moe.py's expert tiles, whose rows gather the same weight) each
  value is unpacked whole, so each row costs one multiply-add per value, where the affine sums cost a multiply and an
  add per row and value."""
  dtype, f32 = dtype or settings.current(x.device).matmul, dtypes.float32
  if isinstance(w, QTensor) and (y := intdot.try_linear(x, w)) is not None: return y if bias is None else y + as_tensor(bias, f32)
  if isinstance(w, QTensor): x = round_activations(x, w.qtype.name)
  if isinstance(w, QTensor) and w.qtype.quantized:
    lay, qt, caps = w.qtype.layout, w.qtype, settings.current(w.device).caps
    rows = prod(x.shape[:-2 - (w.ndim - 2)]) * x.shape[-2] if x.ndim >= 2 else 1  # per weight matrix: not the axes matching w's leading ones
    gemv = isinstance(rows, int) and rows <= LANES_MAX_ROWS
    if gemv and caps.float_bits: dtype = f32  # its dequantized values live in registers: half would save no bytes
    v, k = w.loaded(dtype), len(lay.order) + 1                                    # v: [*lead, out, nb, *layout]
    xl = lay.to_load(x.cast(dtype).reshape(*x.shape[:-1], w.shape[-1] // qt.block, qt.block))   # [..., nb, *layout]
    if not gemv: y = xl.flatten(-k).matmul(v.flatten(-k).transpose(-1, -2), dtype=f32)
    elif not caps.gemv_lanes and qt.block <= GPU_BLOCK:  # a GPU: each block's sum, then the blocks'
      p = xl.unsqueeze(-k - 1) * v.unsqueeze(-k - 2)                              # [..., T, out, nb, *layout]
      y = p.sum(tuple(range(-k + 1, 0)), dtype=f32).sum(-1)
    else:
      n = lay.n[lay.lane]
      wd = max(d for d in range(1, min(lay.lanes or LANES, n) + 1) if n % d == 0)
      def lanes_last(p: Tensor) -> Tensor:                                        # [..., nb, *layout] -> [..., nb, *rest, wd]
        li = p.ndim - k + 1 + lay.order.index(lay.lane)
        p = p.reshape(*p.shape[:li], n // wd, wd, *p.shape[li + 1:])
        return p.permute(*(i for i in range(p.ndim) if i != li + 1), li + 1)     # the lanes last, the rest in load order
      if qt.affine is not None and prod(lay.shape) > wd and settings.current(w.device).caps.affine_gemv and affine:
        # per block and lane: d * (sum x q + c * sum x), the sums over the block's values that share the lane; c * sum x
        # once per x (a small kernel of its own), not per output row
        d, q, c = w.affine(wd, dtype)
        inner = tuple(range(-k, -1))
        t = lanes_last(xl.unsqueeze(-k - 1) * q.unsqueeze(-k - 2)).sum(inner, dtype=f32)          # [..., T, out, nb, wd]
        if c: t = t + (lanes_last(xl).sum(inner, dtype=f32) * c).unsqueeze(-3).contiguous()      # + [..., T, 1, nb, wd]
        y = (t * d.unsqueeze(-4)).sum(-2, dtype=f32).sum(-1)
      else:
        p = lanes_last(xl.unsqueeze(-k - 1) * v.unsqueeze(-k - 2))                # [..., T, out, nb, *rest, wd]
        y = p.sum(tuple(range(p.ndim - k - 1, p.ndim - 1)), dtype=f32).sum(-1)
  elif len(w.shape) == 2 and w.shape[-1] % LANES == 0 and isinstance(rows := prod(x.shape[:-1]), int) and rows <= LANES_MAX_ROWS:
    y = dot_lanes(x.cast(dtype), as_tensor(w, dtype))  # a float GEMV (V4's F16 compressor, router, hyper-connections)
  else: y = x.cast(dtype).matmul(as_tensor(w, dtype).transpose(-1, -2), dtype=f32)
  return y if bias is None else y + as_tensor(bias, f32)

def panel_gemm(x: Tensor, w: Tensor, n: int, bias: Weight | None = None) -> Tensor:
  """`x @ w.T (+ bias)` for a float weight `[out, in]`, first copied as panels of n outputs, `[out / n, in, n]`: a GEMM
  iteration (n outputs by a few tokens, backend/cpu/kernel_opts.py) then reads its weight column as one contiguous run
  instead of one n-float piece per row of a `[in, out]` copy, a page apart for a wide weight (V2-Lite's 2048 x 10944
  gate). The panels are the outer loop, so each stays in cache while every token passes it."""
  O, I = w.shape
  p = w.reshape(O // n, n, I).permute(0, 2, 1).contiguous()                                   # [out/n, in, n]
  lead, rows = x.shape[:-1], prod(x.shape[:-1])
  if (c := settings.current(w.device).caps.c_gemm) and w.dtype == dtypes.float32 and cgemm.applies(rows, O // n, n, *c):
    y = cgemm.panel_gemm(x.float().reshape(rows, I), p, *c).reshape(*lead, O)                  # the same sums, vector accumulators
  else:
    y = (x.cast(w.dtype).reshape(1, rows, I, 1) * p.reshape(O // n, 1, I, n)).sum(2, dtype=dtypes.float32)  # [out/n, rows, n]
    y = y.permute(1, 0, 2).reshape(*lead, O)
  return y if bias is None else y + as_tensor(bias, dtypes.float32)

def dot_lanes(q: Tensor, k: Tensor, lanes: int = LANES) -> Tensor:
  """`q @ k.T` over the last axis. For a few query rows (decode) as `linear`'s GEMV: per output, `lanes` partial sums
  (position i into lane i % lanes), then their sum; the plain form is one chain of dependent adds per score, each
  waiting on the one before (576 of them for V2-Lite's latent scores). Where the device's lanes are threads (a GPU
  renderer: Capabilities.dot_lanes), the plain form."""
  n = q.shape[-1]
  if n % lanes or not settings.current(q.device).caps.dot_lanes: return q.matmul(k.transpose(-1, -2), dtype=dtypes.float32)
  p = q.unsqueeze(-2) * k.unsqueeze(-3)                                                  # [..., T, S, n]
  return p.reshape(*p.shape[:-1], n // lanes, lanes).sum(-2, dtype=dtypes.float32).sum(-1)
