"""quant/intdot_k.py: Q2_K, IQ2_XXS, Q4_K and Q6_K GEMVs on x rounded to Q8_K, held bit for bit to ggml's own
quantize_row_q8_K and vec_dot_<fmt>_q8_K (stored outputs: tests/fixtures/make_intdot_k_reference.py),
and, for the shapes the stored case does not cover (batched rows, prefill tiles, gathered experts, with and without
VNNI), to a numpy model of the same arithmetic (quantize_row_q8_K_ref's rounding, exact integer lanes, the float
steps in llama.cpp's order) that equals ggml's on the stored case. A wrong plane, shift, scale nibble, grid row, sign bit
or lane moves an output by whole percents, a different float order by an ulp."""
import pathlib

import numpy as np
import pytest
from gguf.quants import IQ2_XXS, dequantize
from gguf import GGMLQuantizationType
from tinygrad import Tensor

from tg_ds4 import backend
from tg_ds4.backend.compat import Ops
from tg_ds4.quant import activations, intdot, intdot_k, settings
from tg_ds4.quant.formats import QTYPES, QTensor, linear

pytestmark = pytest.mark.skipif(not set(intdot_k.FORMATS) <= backend.capabilities("CPU").int_dot_formats,
                                reason="needs an x86 CPU with AVX2/F16C/FMA and tinygrad 0.14's internals")
QT = {q.name: q for q in QTYPES.values()}
f32 = lambda v: np.asarray(v, np.float64).astype(np.float32).astype(np.float64)

def _blocks(rng, fmt: str, *shape: int) -> np.ndarray:
  """Random blocks `[*lead, out, k/256, bytes]`: any bytes are valid codes; the fp16 scales kept small and finite."""
  *lead, out, k = shape
  raw = rng.integers(0, 256, size=(*lead, out, k // 256, intdot_k.FORMATS[fmt]), dtype=np.uint8)
  at = {"Q2_K": (80, 82), "IQ2_XXS": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}[fmt]
  for o in at: raw[..., o:o + 2] = (rng.random((*lead, out, k // 256)) * 0.02).astype(np.float16)[..., None].view(np.uint8)
  return raw

def _q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """quantize_row_q8_K_ref: (ints `[..., nb, 256]`, float32 scale `[..., nb]`, 16 sums `[..., nb, 16]`)."""
  b = x.reshape(*x.shape[:-1], -1, 256).astype(np.float32)
  mx = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)          # the first value of largest magnitude
  with np.errstate(divide="ignore"): iscale = np.where(mx != 0, np.float32(-127) / mx, 0).astype(np.float32)
  q = np.minimum(127, np.rint(iscale * b)).astype(np.int64)
  with np.errstate(divide="ignore"): d = np.where(mx[..., 0] != 0, np.float32(1) / iscale[..., 0], 0).astype(np.float32)
  return q, d.astype(np.float64), q.reshape(*q.shape[:-1], 16, 16).sum(-1)

def _f16(raw: np.ndarray, at: int) -> np.ndarray: return raw[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float64)

def _k4_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Q4_K's 8 6-bit scales and 8 6-bit minima per block, as ggml's get_scale_min_k4 reads its 12 bytes."""
  q = raw[..., 4:16].astype(np.int64)
  sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)], -1)
  mn = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], -1)
  return sc, mn

def _weights(raw: np.ndarray, fmt: str) -> tuple[np.ndarray, ...]:
  """Per block: the 256 integer values as the dot takes them (Q2_K, Q4_K, Q6_K: times their scales, Q6_K's without its
  -32; IQ2_XXS: signed grid values), the integer weight of each value (IQ2_XXS: 2s + 1 of its 32; else 1), the minima
  or scales the sums of x take (Q2_K, Q4_K: minima; Q6_K: its 16 scales), the fp16 scale(s)."""
  e = np.arange(256); p, t = e // 32, e % 32                                   # plane p of 32 values
  if fmt == "Q4_K":
    sc, mn = _k4_scales(raw)
    q = (raw[..., 16 + (p // 2) * 32 + t].astype(np.int64) >> (4 * (p % 2))) & 15
    return q * sc[..., p], np.ones(256, np.int64), mn, _f16(raw, 0), _f16(raw, 2)
  if fmt == "Q6_K":
    h, k = p // 4, p % 4
    lo = (raw[..., 64 * h + 32 * (k % 2) + t].astype(np.int64) >> (4 * (k // 2))) & 15
    hi = (raw[..., 128 + 32 * h + t].astype(np.int64) >> (2 * k)) & 3
    sc = raw[..., 192:208].view(np.int8).astype(np.int64)
    return (lo | hi << 4) * sc[..., e // 16], np.ones(256, np.int64), sc, _f16(raw, 208)
  if fmt == "Q2_K":
    sc, qs = raw[..., :16].astype(np.int64), raw[..., 16:80].astype(np.int64)
    e = np.arange(256); p, t = e // 32, e % 32                                 # plane p = 4j + i of 32 values
    q = (qs[..., (p // 4) * 32 + t] >> (2 * (p % 4))) & 3
    return q * (sc[..., 2 * p + (t >= 16)] & 15), np.ones(256, np.int64), sc >> 4, _f16(raw, 80), _f16(raw, 82)
  IQ2_XXS.init_grid()
  grid = IQ2_XXS.grid.reshape(256, 8).astype(np.int64)
  signs = 1 - 2 * ((np.frombuffer(IQ2_XXS.ksigns, np.uint8)[:, None] >> np.arange(8)) & 1).astype(np.int64)
  sub = raw[..., 2:].reshape(*raw.shape[:-1], 8, 8)                           # 8 sub-blocks: 4 grid indices, a u32
  w = sub[..., 4:].copy().view("<u4")[..., 0].astype(np.int64)
  vals = grid[sub[..., :4].astype(np.int64)] * signs[(w[..., None] >> (7 * np.arange(4))) & 127]
  ls = np.repeat(2 * (w >> 28) + 1, 32, -1)
  return vals.reshape(*raw.shape[:-1], 256), ls, _f16(raw, 0)

def _hsum(a: np.ndarray) -> np.ndarray:
  return f32(f32(f32(a[..., 0] + a[..., 4]) + f32(a[..., 2] + a[..., 6])) + f32(f32(a[..., 1] + a[..., 5]) + f32(a[..., 3] + a[..., 7])))

def _ggml(x: np.ndarray, raw: np.ndarray, fmt: str) -> np.ndarray:
  """x `[..., R, in]` (broadcasting over raw's leading axes), raw `[..., out, nb, bytes]` -> `[..., R, out]` float32: per
  output eight float lanes, lane l's integer the products of values 4l..4l+3 of each 32, each step an fma (exact in
  float64 before its float32 rounding, as test_intdot's models)."""
  xq, xd, xb = _q8_k(x)
  lane = lambda v: v.reshape(*v.shape[:-1], 8, 8, 4).sum(-1).sum(-2)        # [.., 256] -> 8 lanes over the 8 planes
  if fmt in ("Q2_K", "Q4_K", "Q6_K"):
    wq, _, mn, d, *dmin = _weights(raw, fmt)
    ints = lane(xq[..., :, None, :, :] * wq[..., None, :, :, :])              # [..., R, out, nb, 8]
    if fmt == "Q4_K":  # 4 lanes: minima 2k, 2k+1 against x's sums of 32 (sums 4k..4k+3 in pairs)
      x32 = xb.reshape(*xb.shape[:-1], 8, 2).sum(-1)
      mins = (mn[..., None, :, :, :] * x32[..., :, None, :, :]).reshape(*ints.shape[:-1], 4, 2).sum(-1)
    else:              # Q2_K: 8 lanes of minima 2l, 2l+1 times sums 2l, 2l+1; Q6_K: 32 times the scales' products
      mins = (mn[..., None, :, :, :] * xb[..., :, None, :, :]).reshape(*ints.shape[:-1], 8, 2).sum(-1)
      if fmt == "Q6_K": ints = ints - 32 * mins
  else:
    wq, ls, d = _weights(raw, fmt)
    ints = lane(xq[..., :, None, :, :] * wq[..., None, :, :, :] * ls[..., None, :, :, :])
  acc, acc_m = np.zeros(ints.shape[:-2] + (8,)), np.zeros(ints.shape[:-2] + (4,))
  for b in range(ints.shape[-2]):
    xdb = xd[..., :, None, b, None]
    if fmt == "Q2_K": acc = f32(f32(-xdb * dmin[0][..., None, :, b, None]) * mins[..., b, :] + acc)
    if fmt == "Q4_K": acc_m = f32(f32(-xdb * dmin[0][..., None, :, b, None]) * mins[..., b, :] + acc_m)
    acc = f32(f32(xdb * d[..., None, :, b, None]) * ints[..., b, :] + acc)
  if fmt == "Q4_K": return f32(_hsum(acc) + f32(f32(acc_m[..., 0] + acc_m[..., 2]) + f32(acc_m[..., 1] + acc_m[..., 3]))).astype(np.float32)
  return (f32(0.125 * _hsum(acc)) if fmt == "IQ2_XXS" else _hsum(acc)).astype(np.float32)

@pytest.mark.parametrize("fmt", list(intdot_k.FORMATS))
def test_the_model_reads_blocks_as_ggml(fmt):
  """The reference's reading of the blocks against gguf-py's dequantization (ggml's, in numpy): the values times their
  scales (Q2_K: minus the minima) are the dequantized weights."""
  rng = np.random.default_rng(0)
  raw = _blocks(rng, fmt, 4, 512)
  want = dequantize(raw.reshape(4, -1), GGMLQuantizationType[fmt]).reshape(4, 2, 256).astype(np.float64)
  if fmt == "Q2_K":
    wq, _, mn, d, dmin = _weights(raw, fmt)
    got = d[..., None] * wq - dmin[..., None] * np.repeat(mn, 16, -1)
  elif fmt == "Q4_K":
    wq, _, mn, d, dmin = _weights(raw, fmt)
    got = d[..., None] * wq - dmin[..., None] * np.repeat(mn, 32, -1)
  elif fmt == "Q6_K":
    wq, _, sc, d = _weights(raw, fmt)
    got = d[..., None] * (wq - 32 * np.repeat(sc, 16, -1))
  else:
    wq, ls, d = _weights(raw, fmt)
    got = d[..., None] * wq * ls * 0.125
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)

REF = np.load(pathlib.Path(__file__).parent / "fixtures" / "intdot_k_reference.npz")

def test_ggml_own_outputs_bit_for_bit():
  """ggml's Q8_K blocks of x (values, scale, sums) and its vec_dot of each x row with each weight row, against the
  kernels and the numpy model: equal to the last bit (a block of zeros, a negative largest magnitude, a +-50 tie and
  values ~1e4 among the rows)."""
  x, blocks = REF["x"], REF["x_q8k"]
  xq, xd, xb = (t.numpy() for t in intdot_k.quantize(Tensor(x)))
  assert np.array_equal(xd, blocks[..., :4].copy().view(np.float32)[..., 0])
  assert np.array_equal(xq, blocks[..., 4:260].view(np.int8)) and np.array_equal(xb, blocks[..., 260:].copy().view(np.int16))
  for fmt in intdot_k.FORMATS:
    raw, want = REF[fmt], REF[f"{fmt}_y"]
    w = QTensor(Tensor(raw).realize(), QT[fmt], (raw.shape[0], raw.shape[1] * 256))
    with settings.override(numerics="llama.cpp"): got = linear(Tensor(x), w).numpy()
    assert np.array_equal(got, want), (fmt, np.abs(got - want).max())
    assert np.array_equal(_ggml(x, raw, fmt), want), fmt

def test_q8_k_is_the_tensor_ops_rounding():
  """The kernel's rounding of x (values, scale, sums) against the numpy model, and quant/activations.py's _q8_k (the
  same rounding as tensor ops, what "llama.cpp" numerics use where no kernel runs) against both; a block of zeros, a
  block whose largest magnitude is negative and one where it appears twice with both signs included."""
  rng = np.random.default_rng(1)
  x = (rng.standard_normal((3, 1024)) * 4).astype(np.float32)
  x[0, :256] = 0
  x[1, 300], x[1, 400] = -50, 50
  xq, xd, xb = (t.numpy() for t in intdot_k.quantize(Tensor(x)))
  q, d, b = _q8_k(x)
  assert np.array_equal(xq, q) and np.array_equal(xd, d.astype(np.float32)) and np.array_equal(xb, b)
  assert np.array_equal(activations._q8_k(Tensor(x)).numpy(), (q * d[..., None]).astype(np.float32).reshape(x.shape))

@pytest.mark.parametrize("fmt", list(intdot_k.FORMATS))
def test_bit_for_bit_with_ggml(fmt, monkeypatch):
  """A GEMV, a batched step's 3 rows and a prefill chunk's tiles (32 rows), dense and gathered (one x per selected
  matrix, and one x for all), with VNNI where the CPU has it and without: exactly the model's float32 outputs."""
  monkeypatch.setattr(intdot, "GEMM_MIN_FLOAT_BYTES", 0)  # the tiles for a small weight too
  rng = np.random.default_rng(2)
  raw, graw, ids = _blocks(rng, fmt, 40, 512), _blocks(rng, fmt, 6, 24, 256), np.array([[5, 0, 5]], np.int32)
  w, gw = QTensor(Tensor(raw).realize(), QT[fmt], (40, 512)), QTensor(Tensor(graw).realize(), QT[fmt], (6, 24, 256))
  for vnni in ("1", "0"):
    monkeypatch.setenv("TG_DS4_VNNI", vnni)
    for rows in (1, 3, 32):
      x = (rng.standard_normal((rows, 1, 512)) * 3).astype(np.float32)
      gx = rng.standard_normal((1, 3, min(rows, 8), 256)).astype(np.float32)
      g1 = rng.standard_normal((1, 1, min(rows, 8), 256)).astype(np.float32)
      with settings.override(numerics="llama.cpp"):
        y = linear(Tensor(x), w)
        assert any(f"{fmt.lower()}_intdot" in u.arg.name for u in y.uop.toposort() if u.op is Ops.SINK and hasattr(u.arg, "name"))
        assert np.array_equal(y.numpy(), _ggml(x, raw, fmt)), (vnni, rows)
        assert np.array_equal(linear(Tensor(gx), gw[Tensor(ids)]).numpy(), _ggml(gx, graw[ids], fmt)), (vnni, rows)
        assert np.array_equal(linear(Tensor(g1), gw[Tensor(ids)]).numpy(), _ggml(g1, graw[ids], fmt)), (vnni, rows)

@pytest.mark.parametrize("fmt", list(intdot_k.FORMATS))
def test_float_form_on_rounded_x_agrees(fmt, monkeypatch):
  """`TG_DS4_INT_DOT=0`: the float GEMV on x rounded by tensor ops, the same products summed in another order: within
  float rounding of the kernel's (1e-5 of the largest output; a wrong unpack moves them by whole percents)."""
  rng = np.random.default_rng(3)
  raw, x = _blocks(rng, fmt, 32, 512), Tensor(rng.standard_normal((2, 512)).astype(np.float32))
  w = QTensor(Tensor(raw).realize(), QT[fmt], (32, 512))
  with settings.override(numerics="llama.cpp"): on = linear(x, w).numpy()
  monkeypatch.setenv("TG_DS4_INT_DOT", "0")
  with settings.override(numerics="llama.cpp"):
    assert not settings.current().caps.int_dot_formats
    off = linear(x, w).numpy()
  np.testing.assert_allclose(on, off, rtol=0, atol=1e-5 * np.abs(off).max())
