"""quant/intdot.py: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 GEMVs under llama.cpp's activation rounding as integer block dot products.

The reference is numpy, independent of the kernel: x rounded to Q8_0 as ggml's quantize_row_q8_0 does (np.rint is
ties-to-even, the scale an fp16), the weight's integers read from the block bytes, and llama.cpp's per-block sum
`fp16(d_w) * fp16(d_x) * sum_i w_i x_i` with exact integer inner sums. Only the order of the float sums over blocks
differs (8 lanes, then llama.cpp's horizontal sum, against numpy's), hence a relative tolerance of 1e-6 of the largest
output: a wrong block, nibble half, fifth bit, scale or row offset moves outputs by whole percents. Both summation orders
llama.cpp uses (Q4_0's repacked form, one sequential sum per output; the other formats' eight lanes) are also held to
numpy models of that order bit for bit."""
import numpy as np
import pytest
from tinygrad import Tensor

from tg_ds4 import backend
from tg_ds4.backend.compat import Ops
from tg_ds4.quant import formats, intdot, settings
from tg_ds4.quant.formats import QTYPES, QTensor, interleave_q4_0, linear

pytestmark = pytest.mark.skipif(not backend.capabilities("CPU").int_dot_formats,
                                reason="needs an x86 CPU with AVX2/F16C/FMA and tinygrad 0.14's internals")
QT = {q.name: q for q in QTYPES.values()}

def _blocks(rng, fmt: str, *shape: int) -> np.ndarray:
  *lead, out, k = shape
  raw = rng.integers(0, 256, size=(*lead, out, k // 32, QT[fmt].nbytes), dtype=np.uint8)
  d = (rng.random((*lead, out, k // 32, 2)) * 0.02 - 0.01).astype(np.float16)  # scales (and Q4_1's minima)
  head = 4 if fmt in intdot.MINIMUM else 2
  raw[..., :head] = d.view(np.uint8).reshape(*d.shape[:-1], 4)[..., :head]
  return raw

def _f16(b: np.ndarray) -> np.ndarray: return b.copy().view(np.float16)[..., 0].astype(np.float64)

def _weight_ints(raw: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(integers `[..., nb, 32]`, fp16 scales and minima `[..., nb]` as float) of Q4_0 (low nibbles first, minus 8), Q4_1
  (d, m, nibbles: value d * q + m), Q5_0 (d, 32 fifth bits, nibbles: minus 16), Q5_1 (d, m, fifth bits, nibbles) or
  Q8_0 blocks, as ggml's dequantize_row_* read them."""
  head = 4 if fmt in intdot.MINIMUM else 2
  d, m = _f16(raw[..., :2]), _f16(raw[..., 2:4]) if head == 4 else np.zeros(raw.shape[:-1])
  if fmt == "Q8_0": return raw[..., 2:].view(np.int8).astype(np.int64), d, m
  fifth = np.zeros((*raw.shape[:-1], 32), np.int64)
  if fmt.startswith("Q5"):
    qh = raw[..., head:head + 4].copy().view("<u4").astype(np.int64)
    fifth, head = ((qh >> np.arange(32)) & 1) * 16, head + 4
  q = np.concatenate([raw[..., head:head + 16] & 15, raw[..., head:head + 16] >> 4], -1).astype(np.int64) + fifth
  return q - {"Q4_0": 8, "Q5_0": 16}.get(fmt, 0), d, m

def _x_ints(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Q8_1 of x (ggml's quantize_row_q8_1, whose values and scale are Q8_0's): ints, fp16 scale, fp16(d * sum q)."""
  b = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
  amax = np.abs(b).max(-1, keepdims=True)
  with np.errstate(divide="ignore"): q = np.rint(b * np.where(amax != 0, np.float32(127) / amax, 0).astype(np.float32))
  d = amax[..., 0] / np.float32(127)
  s = (d * q.sum(-1).astype(np.float32)).astype(np.float16).astype(np.float64)
  return q.astype(np.int64), d.astype(np.float16).astype(np.float64), s

def _reference(x: np.ndarray, raw: np.ndarray, fmt: str) -> np.ndarray:
  """x `[..., R, in]` (broadcasting over raw's leading axes), raw `[..., out, nb, bytes]` -> `[..., R, out]`."""
  wq, wd, wm = _weight_ints(raw, fmt)
  xq, xd, xs = _x_ints(x)
  dots = np.einsum("...rbi,...obi->...rob", xq, wq)                  # exact integer block dots
  return (dots * xd[..., :, None, :] * wd[..., None, :, :] + wm[..., None, :, :] * xs[..., :, None, :]).sum(-1)

def _check(y: np.ndarray, ref: np.ndarray):
  assert y.shape == ref.shape
  assert np.abs(y - ref).max() <= 1e-6 * np.abs(ref).max()

@pytest.mark.parametrize("fmt", list(intdot.FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 32])  # 32: a prefill chunk, in tiles of MAX_ROWS rows
def test_dense(fmt, rows, monkeypatch):
  monkeypatch.setattr(intdot, "GEMM_MIN_FLOAT_BYTES", 0)  # the tiles for a small weight too
  rng = np.random.default_rng(1)
  raw, x = _blocks(rng, fmt, 96, 256), rng.standard_normal((rows, 1, 256)).astype(np.float32)
  w = QTensor(Tensor(raw).realize(), QT[fmt], (96, 256))
  with settings.override(numerics="llama.cpp"): y = linear(Tensor(x), w).numpy()
  _check(y, _reference(x, raw, fmt))

@pytest.mark.parametrize("fmt", list(intdot.FORMATS))
@pytest.mark.parametrize("x_lead", [(1, 3), (1, 1)])  # one x per selected matrix (down), or one x for all (gate, up)
def test_gathered(fmt, x_lead):
  rng = np.random.default_rng(2)
  raw, ids = _blocks(rng, fmt, 8, 64, 256), np.array([[6, 1, 6]], np.int32)
  x = rng.standard_normal((*x_lead, 2, 256)).astype(np.float32)
  w = QTensor(Tensor(raw).realize(), QT[fmt], (8, 64, 256))
  with settings.override(numerics="llama.cpp"): y = linear(Tensor(x), w[Tensor(ids)]).numpy()
  _check(y, _reference(x, raw[ids], fmt))

def _repacked_q4_0(x: np.ndarray, raw: np.ndarray) -> np.ndarray:
  """ggml's repacked Q4_0 (llama.cpp's arithmetic on an x86 CPU with AVX2 when the row count is a multiple of 8), in
  numpy: per output, acc = fma(float(block dot), fp16(d_w) * fp16(d_x), acc) over the blocks in order from 0. The scale
  product of two fp16 values is exact in float32 and the block dot times it exact in float64, so float64's sum rounded
  to float32 is the fma (a double rounding could differ only on an exact float32 tie)."""
  wq, wd, _ = _weight_ints(raw, "Q4_0")
  xq, xd, _ = _x_ints(x)
  dots = np.einsum("...rbi,...obi->...rob", xq, wq)
  scale = (xd[..., :, None, :].astype(np.float32) * wd[..., None, :, :].astype(np.float32)).astype(np.float64)
  acc = np.zeros(dots.shape[:-1], np.float32)
  for b in range(dots.shape[-1]): acc = (dots[..., b] * scale[..., b] + acc).astype(np.float32)
  return acc

def _lanes(x: np.ndarray, raw: np.ndarray, fmt: str) -> np.ndarray:
  """ggml's vec_dot on x86 with AVX2 (and tinyBLAS's GEMM, the same sums), in numpy: per output, 8 float lanes, lane j
  acc_j = fma(float(block dot of the block's values 4j..4j+3), fp16(d_w) * fp16(d_x), acc_j) over the blocks in order,
  then hsum_float_8's ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)), plus (Q4_1, Q5_1) the minima's own sum
  summs = fma(m_w, s_x, summs). Exact in float64 before each float32 rounding, as _repacked_q4_0 says."""
  wq, wd, wm = _weight_ints(raw, fmt)
  xq, xd, xs = _x_ints(x)
  dots = np.einsum("...rbjk,...objk->...robj", xq.reshape(*xq.shape[:-1], 8, 4), wq.reshape(*wq.shape[:-1], 8, 4))
  f32 = lambda v: v.astype(np.float32).astype(np.float64)
  scale = f32(xd[..., :, None, :] * wd[..., None, :, :])
  acc, sm = np.zeros(dots.shape[:-2] + (8,)), np.zeros(dots.shape[:-2])
  for b in range(dots.shape[-2]):
    acc = f32(dots[..., b, :] * scale[..., b, None] + acc)
    sm = f32(wm[..., None, :, b] * xs[..., :, None, b] + sm)
  a = acc
  return (f32(f32(f32(a[..., 0] + a[..., 4]) + f32(a[..., 2] + a[..., 6])) + f32(f32(a[..., 1] + a[..., 5]) + f32(a[..., 3] + a[..., 7]))) +
          sm).astype(np.float32)

@pytest.mark.parametrize("fmt", ["Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_lanes_are_ggml_vec_dot_bit_for_bit(fmt, monkeypatch):
  """The formats ggml does not repack on x86: exactly its vec_dot's (and tinyBLAS's) eight lanes, bit for bit, for a
  GEMV, a batched step and a prefill chunk's tiles, dense and gathered."""
  monkeypatch.setattr(intdot, "GEMM_MIN_FLOAT_BYTES", 0)
  rng = np.random.default_rng(11)
  raw, graw, ids = _blocks(rng, fmt, 64, 512), _blocks(rng, fmt, 6, 40, 256), np.array([[5, 0, 5]], np.int32)
  w, gw = QTensor(Tensor(raw).realize(), QT[fmt], (64, 512)), QTensor(Tensor(graw).realize(), QT[fmt], (6, 40, 256))
  for rows in (1, 3, 32):
    x = (rng.standard_normal((rows, 1, 512)) * 3).astype(np.float32)
    gx = rng.standard_normal((1, 3, min(rows, 8), 256)).astype(np.float32)
    with settings.override(numerics="llama.cpp"):
      assert np.array_equal(linear(Tensor(x), w).numpy(), _lanes(x, raw, fmt))
      assert np.array_equal(linear(Tensor(gx), gw[Tensor(ids)]).numpy(), _lanes(gx, graw[ids], fmt))

@pytest.mark.parametrize("rows", [1, 3, 32])
def test_q4_0_is_ggml_repacked_bit_for_bit(rows, monkeypatch):
  """Q4_0 with a row count that is a multiple of 8: exactly llama.cpp's repacked GEMV/GEMM arithmetic, bit for bit, for
  a GEMV, a batched step and a prefill chunk's tiles, dense and gathered; a row count that is not a multiple of 8, and a
  stack of per-head matrices (ggml repacks neither), keep the 8-lane form within the reference's tolerance."""
  monkeypatch.setattr(intdot, "GEMM_MIN_FLOAT_BYTES", 0)
  rng = np.random.default_rng(10)
  raw, x = _blocks(rng, "Q4_0", 64, 512), (rng.standard_normal((rows, 1, 512)) * 3).astype(np.float32)
  w = QTensor(Tensor(raw).realize(), QT["Q4_0"], (64, 512))
  graw, ids = _blocks(rng, "Q4_0", 6, 40, 256), np.array([[5, 0, 5]], np.int32)
  gx = rng.standard_normal((1, 3, min(rows, 8), 256)).astype(np.float32)
  gw = QTensor(Tensor(graw).realize(), QT["Q4_0"], (6, 40, 256))
  odd = QTensor(Tensor(raw[:60]).realize(), QT["Q4_0"], (60, 512))
  heads = QTensor(Tensor(raw.reshape(2, 32, 16, 18)).realize(), QT["Q4_0"], (2, 32, 512))  # per-head matrices (MLA's absorbs)
  hx = rng.standard_normal((2, 1, 512)).astype(np.float32)
  monkeypatch.setattr(formats, "REPACK_GROUPS", 2)  # the groups split over threads as a big weight's are
  iw, igw = interleave_q4_0(w), interleave_q4_0(gw)  # the layout the CPU's load gives such weights (models/widen.py)
  with settings.override(numerics="llama.cpp"):
    assert np.array_equal(linear(Tensor(x), w).numpy(), _repacked_q4_0(x, raw))
    assert np.array_equal(linear(Tensor(gx), gw[Tensor(ids)]).numpy(), _repacked_q4_0(gx, graw[ids]))
    assert np.array_equal(linear(Tensor(x), iw).numpy(), _repacked_q4_0(x, raw))
    assert np.array_equal(linear(Tensor(gx), igw[Tensor(ids)]).numpy(), _repacked_q4_0(gx, graw[ids]))
    y, hy = linear(Tensor(x[:8]), odd).numpy(), linear(Tensor(hx), heads).numpy()
  # everything else reads the file's blocks, restored from the interleaved bytes: the same bytes, the same float math
  assert np.array_equal(iw.blocks.numpy(), raw) and np.array_equal(igw[Tensor(ids)].blocks.numpy(), graw[ids])
  assert np.array_equal(iw.x8.numpy()[3, 5, 16 + 32 * 2 + 4 * 6:][:4], raw[3 * 8 + 6, 5, 2 + 4 * 2:][:4])  # group 3, block 5: row 6's bytes 8..11
  # exact numerics: the float GEMV fused over the view is another kernel than over the file's blocks (its opts may sum
  # in another order), the same values
  fy, fw = linear(Tensor(gx), igw[Tensor(ids)]).numpy(), linear(Tensor(gx), gw[Tensor(ids)]).numpy()
  assert np.abs(fy - fw).max() <= 1e-6 * np.abs(fw).max()
  assert np.array_equal(y, _lanes(x[:8], raw[:60], "Q4_0"))
  assert not np.array_equal(y, _repacked_q4_0(x[:8], raw[:60]))
  hraw = raw.reshape(2, 32, 16, 18)
  assert np.array_equal(hy, _lanes(hx, hraw, "Q4_0"))
  assert not np.array_equal(hy, _repacked_q4_0(hx, hraw))  # ggml repacks no stack of matrices that a plain mul_mat reads

@pytest.mark.parametrize("rows", [4, 24])
def test_rows_equal_alone(rows, monkeypatch):
  """A batched step's rows (4) and a prefill chunk's (24: three tiles) against the one-row GEMV: each row keeps its own
  accumulators, so bitwise the same: a prompt's prefill computes each matmul row as its decode step would."""
  monkeypatch.setattr(intdot, "GEMM_MIN_FLOAT_BYTES", 0)
  rng = np.random.default_rng(3)
  raw, x = _blocks(rng, "Q4_0", 64, 512), rng.standard_normal((rows, 1, 512)).astype(np.float32)
  w = QTensor(Tensor(raw).realize(), QT["Q4_0"], (64, 512))
  with settings.override(numerics="llama.cpp"):
    together = linear(Tensor(x), w)
    assert any("intdot" in u.arg.name for u in together.uop.toposort() if u.op is Ops.SINK and hasattr(u.arg, "name"))
    together = together.numpy()
    alone = [linear(Tensor(x[i]), w).numpy() for i in range(rows)]
  assert all(np.array_equal(together[i], alone[i]) for i in range(rows))

@pytest.mark.parametrize("fmt", [*intdot.FORMATS, "Q4_0x8"])
@pytest.mark.parametrize("rows", [3, 32])
def test_a_block_of_rows_reads_in_place(fmt, rows, monkeypatch):
  """A unit-step slice of a matrix's rows (V4's attn_output_a groups) takes the integer kernel on the matrix's own
  bytes from the slice's first row: bitwise the GEMV/GEMM of those rows as a matrix of their own (Q4_0x8: interleaved)."""
  monkeypatch.setattr(intdot, "GEMM_MIN_FLOAT_BYTES", 0)
  rng = np.random.default_rng(11)
  q = fmt[:4]
  raw, x = _blocks(rng, q, 64, 256), rng.standard_normal((rows, 256)).astype(np.float32)
  w = QTensor(Tensor(raw).realize(), QT[q], (64, 256))
  part = QTensor(Tensor(raw[16:40]).realize(), QT[q], (24, 256))
  if fmt == "Q4_0x8": w, part = interleave_q4_0(w), interleave_q4_0(part)
  with settings.override(numerics="llama.cpp"):
    y = linear(Tensor(x), w[16:40])
    assert [u.arg.name for u in y.uop.toposort() if u.op is Ops.SINK and "intdot" in getattr(u.arg, "name", "")]
    assert np.array_equal(y.numpy(), linear(Tensor(x), part).numpy())
  _check(y.numpy(), _reference(x, raw[16:40], q))

def test_only_where_inputs_are_rounded(monkeypatch):
  """The integer kernel runs where actquant rounds the input ("llama.cpp" and "auto" numerics), never in exact float
  math (also what a matmul outside a model's graphs gets), and `TG_DS4_INT_DOT=0` turns the kernel off (the float form
  on rounded x then gives the same values; "auto" is then exact)."""
  rng = np.random.default_rng(4)
  raw, x = _blocks(rng, "Q4_0", 32, 128), Tensor(rng.standard_normal((1, 128)).astype(np.float32))
  w = QTensor(Tensor(raw).realize(), QT["Q4_0"], (32, 128))
  names = lambda t: [u.arg.name for u in t.uop.toposort() if u.op is Ops.SINK and hasattr(u.arg, "name")]
  assert intdot.try_linear(x, w) is None
  with settings.override(numerics="exact"): assert intdot.try_linear(x, w) is None
  with settings.override(numerics="auto"): assert any("intdot" in n for n in names(linear(x, w)))
  with settings.override(numerics="llama.cpp"):
    on = linear(x, w)
    assert any("intdot" in n for n in names(on))
  monkeypatch.setenv("TG_DS4_INT_DOT", "0")  # read when the settings are resolved (a model's load)
  with settings.override(numerics="llama.cpp"):
    off = linear(x, w)
    assert not any("intdot" in n for n in names(off))
    np.testing.assert_allclose(on.numpy(), off.numpy(), rtol=0, atol=1e-6 * np.abs(off.numpy()).max())

def test_expert_tiles_equal_per_pair():
  """A prefill chunk's expert tiles (moe: each tile's rows against its one gathered weight, intdot.takes_all) give
  each token what its own per-pair GEMVs give: the same integer dots, each row with its own accumulators. The routing
  weights and the weighted sum over experts are float kernels of other shapes in a chunk than for one token, so the
  outputs agree to float rounding (measured: 3e-6 of the largest at worst), not bitwise; a row read against another
  tile's expert moves them by whole units."""
  from tg_ds4.config import Gating, MoEConfig
  from tg_ds4.nn.moe import MoE
  cfg = MoEConfig(n_expert=16, n_expert_used=4, expert_ff_dim=32, gating=Gating.SOFTMAX)
  rng = np.random.default_rng(5)
  moe = MoE(64, cfg)
  moe.ffn_gate_inp.weight = Tensor(rng.standard_normal((16, 64)).astype(np.float32))
  for name, (o, i) in (("ffn_gate_exps", (32, 64)), ("ffn_up_exps", (32, 64)), ("ffn_down_exps", (64, 32))):
    getattr(moe, name).weight = QTensor(Tensor(_blocks(rng, "Q4_0", 16, o, i)).realize(), QT["Q4_0"], (16, o, i))
  x = rng.standard_normal((1, 24, 64)).astype(np.float32)
  with settings.override(numerics="llama.cpp"):
    assert moe.tiled(24 * 4, "CPU") and intdot.takes_all(*moe._exps_weights())
    chunk = moe(Tensor(x)).numpy()
    alone = np.concatenate([moe(Tensor(x[:, t:t + 1])).numpy() for t in range(24)], 1)
  np.testing.assert_allclose(chunk, alone, rtol=0, atol=1e-5 * np.abs(alone).max())

def test_kernels_declare_their_buffers():
  """tinygrad reads which buffers a kernel writes and reads from its STOREs and LOADs, and the native replay runs a
  kernel beside any other that touches none of them: a C statement has neither, so without its declared buffers the
  GEMV would run beside the rounding of its x (NaN logits in decode, as on test_reference's ds3k Q4_0)."""
  from tinygrad.engine.realize import compile_linear, get_call_outs_ins
  rng = np.random.default_rng(6)
  w = QTensor(Tensor(_blocks(rng, "Q8_0", 32, 128)).realize(), QT["Q8_0"], (32, 128))
  with settings.override(numerics="llama.cpp"): y = linear(Tensor(rng.standard_normal((1, 128)).astype(np.float32)) * 2, w)
  lin, _ = y.linear_with_vars()
  seen = {call.src[0].arg.name: get_call_outs_ins(call) for call in compile_linear(lin).src if call.src[0].op is Ops.PROGRAM}
  if settings.current().caps.int_dot_vnni:  # and the lanes' start (intdot.OFFSET)
    assert seen["q8_0_quantize_4"] == ((0, 1, 2), (3,))
    assert seen["q8_0_intdot_1_1_32_128"] == ((0,), (1, 2, 3, 4))
  else:
    assert seen["q8_0_quantize_4"] == ((0, 1), (2,))           # writes the int8 values and scales, reads x
    assert seen["q8_0_intdot_1_1_32_128"] == ((0,), (1, 2, 3))  # writes y, reads the weight, the values and scales

def test_a_chunk_takes_the_tiles_only_for_a_big_weight_without_vnni(monkeypatch):
  """Without VNNI a prefill chunk's rows take the integer tiles for a weight whose float copy is at least
  GEMM_MIN_FLOAT_BYTES, the float GEMM for a smaller one (its float copy stays in cache); with VNNI the tiles whatever
  the size; one row the GEMV whatever the size."""
  rng = np.random.default_rng(5)
  k, n = 1024, intdot.GEMM_MIN_FLOAT_BYTES // 4 // 1024
  big = QTensor(Tensor(_blocks(rng, "Q4_0", n, k)).realize(), QT["Q4_0"], (n, k))
  small = QTensor(Tensor(_blocks(rng, "Q4_0", 64, k)).realize(), QT["Q4_0"], (64, k))
  x = Tensor(rng.standard_normal((1, 32, k)).astype(np.float32))
  tiled = lambda t: any("intdot" in u.arg.name for u in t.uop.toposort() if u.op is Ops.SINK and hasattr(u.arg, "name"))
  with settings.override(numerics="llama.cpp") as s:
    assert tiled(linear(x, big)) and tiled(linear(x[:, :1], small)) and tiled(linear(x, small)) == s.caps.int_dot_vnni
  monkeypatch.setenv("TG_DS4_VNNI", "0")
  with settings.override(numerics="llama.cpp") as s:
    assert not s.caps.int_dot_vnni
    assert tiled(linear(x, big)) and not tiled(linear(x, small)) and tiled(linear(x[:, :1], small))

@pytest.mark.skipif(not backend.capabilities("CPU").int_dot_vnni, reason="needs AVX-512 VNNI or AVX-VNNI")
@pytest.mark.parametrize("fmt", list(intdot.FORMATS))
def test_vnni_gives_the_same_integers(fmt, monkeypatch):
  """`vpdpbusd` (one instruction) against `vpmaddubsw` + `vpmaddwd` (AVX2): bitwise the same outputs, extremes included
  (Q8_0 weight bytes of -128 and 127 against x rounded to +-127, where an int16 pair sum is largest), for a GEMV and a
  prefill chunk's tiles; and both within the reference's tolerance."""
  monkeypatch.setattr(intdot, "GEMM_MIN_FLOAT_BYTES", 0)
  rng = np.random.default_rng(8)
  raw = _blocks(rng, fmt, 64, 256)
  if fmt == "Q8_0": raw[:8, :, 2:] = rng.choice(np.array([128, 127], np.uint8), size=raw[:8, :, 2:].shape)  # -128 and 127
  w = QTensor(Tensor(raw).realize(), QT[fmt], (64, 256))
  ws = [w, interleave_q4_0(w)] if fmt == "Q4_0" else [w]  # Q4_0 also as the CPU's load lays it out (models/widen.py)
  for rows in (1, 16):
    x = np.sign(rng.standard_normal((rows, 1, 256))).astype(np.float32)                      # every value rounds to +-127
    x[:, :, ::3] *= rng.random((rows, 1, 86)).astype(np.float32)
    with settings.override(numerics="llama.cpp"): vnni = [linear(Tensor(x), v).numpy() for v in ws]
    monkeypatch.setenv("TG_DS4_VNNI", "0")
    with settings.override(numerics="llama.cpp"):
      assert not settings.current().caps.int_dot_vnni
      avx2 = [linear(Tensor(x), v).numpy() for v in ws]
    monkeypatch.delenv("TG_DS4_VNNI")
    assert all(np.array_equal(vnni[0], y) for y in vnni[1:] + avx2)
    vnni = vnni[0]
    _check(vnni, _reference(x, raw, fmt))

@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0", "Q5_1", "Q2_K", "IQ2_XXS"])  # repacked, the 8-lane form (with Q8_1's sums), Q8_K
def test_counted_rows_compute_only_those(fmt):
  """`live` (nn/moe.py's tiles: the rows each tile's pairs fill): a gathered matrix takes its first `live` rows of x,
  bitwise what it gives for them with every row, and gives zeros for the rest (a padding tile, 0, for all of them)."""
  rng = np.random.default_rng(9)
  k = 256
  raw = _blocks(rng, fmt, 8, 64, k) if fmt in intdot.FORMATS else rng.integers(0, 256, (8, 64, 1, QT[fmt].nbytes), np.uint8)
  ids = np.array([6, 1, 6], np.int32)
  if fmt == "Q2_K": raw[..., 80:84] = np.array([0.01, 0.002], np.float16).view(np.uint8)       # d, dmin
  if fmt == "IQ2_XXS": raw[..., :2] = np.array([0.01], np.float16).view(np.uint8)
  x = rng.standard_normal((3, 4, k)).astype(np.float32)
  w = QTensor(Tensor(raw).realize(), QT[fmt], (8, 64, k))
  with settings.override(numerics="llama.cpp"):
    every = intdot.linear(Tensor(x), w[Tensor(ids)]).numpy()
    some = intdot.linear(Tensor(x), w[Tensor(ids)], Tensor(np.array([4, 0, 2], np.int32))).numpy()
  assert np.isfinite(every).all() and every[1].any() and every[2, 2:].any()
  assert np.array_equal(some[0], every[0]) and np.array_equal(some[2, :2], every[2, :2]) and not some[1].any() and not some[2, 2:].any()
  if fmt in intdot.FORMATS: _check(every, _reference(x, raw[ids], fmt))

def test_load_interleaves_q4_0_where_its_integer_dots_run(monkeypatch):
  """A model's load re-lays its Q4_0 matrices and routed experts (models/widen.py's interleave) under the default
  numerics on this CPU, and nothing under exact numerics; the logits are bitwise those of the file's layout, for a
  chunk of 16 tokens (the integer kernels' tiles) and one of 11 (the float path, over the view in the file's layout)."""
  from tg_ds4.models import widen
  from tg_ds4.nn.layers import packed_weights
  from tg_ds4.runtime.runner import Runner
  path, ids = "tests/fixtures/deepseek2/ds3/ds3-Q4_0.gguf", [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79]
  def load(numerics: str):
    r = Runner.load(path, max_ctx=64, numerics=numerics)
    return r, [(o, w) for o, _, w in packed_weights(r.model) if w.qtype.name == "Q4_0"]
  r, ws = load("auto")
  assert all(w.x8 is None for _, w in load("exact")[1])
  interleaved = [w for _, w in ws if w.x8 is not None]
  assert len(interleaved) >= 20 and any(w.ndim == 3 for w in interleaved)       # experts too
  assert all(w.shape[-2] % 8 == 0 for w in interleaved)
  got = [r.prefill(ids[:n], chunk=n).numpy() for n in (16, 11)]
  monkeypatch.setattr(widen, "interleave", lambda *a, **k: None)
  plain, pws = load("auto")
  assert all(w.x8 is None for _, w in pws)
  assert all(np.array_equal(g, plain.prefill(ids[:n], chunk=n).numpy()) for g, n in zip(got, (16, 11)))
