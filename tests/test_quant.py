"""GGML block formats: values vs gguf-py, expert gathers, fused linear; kernel count and bytes on DEV=NULL.

The DEV=NULL checks schedule 4096x4096 GEMVs and 64-expert gathers without running them; they run in a subprocess
(this file as a script) so the rest of the suite keeps the CPU device. It starts with the first test of the module
and overlaps the CPU tests."""
from __future__ import annotations

import json, os, pathlib, subprocess, sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from tinygrad import GlobalCounters, Tensor, dtypes

from tg_ds4.quant.formats import K_WIDENED, QTYPES, QTYPE_BY_NAME, QTensor, dequantize, linear, q5_0_as_q8_0, widen_k_quant

# fp16 fields (byte offsets) that random bytes must not make inf/nan
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82), "Q3_K": (108,),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ2_XXS": (0,), "IQ4_XS": (0,), "TQ1_0": (52,), "TQ2_0": (64,)}
EXACT = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
NP_NATIVE = {"I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "F64": np.float64}  # gguf-py has no dequantize
NULL_TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q8_S16", "Q8_M32",
              "Q2_K", "Q3_K", "IQ2_XXS", "Q4_1", "Q5_0", "Q5_1", "Q5_K", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4")
MAX_BYTES_RATIO = 1.15

def rand_blocks(qt, lead: tuple[int, ...], nb: int, rng: np.random.Generator) -> np.ndarray:
  """Random packed blocks `[*lead, nb, nbytes]`; float fields get finite values of moderate magnitude."""
  shape = (*lead, nb)
  scale = lambda: (rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 0, shape)).astype(np.float32)
  if qt.name in ("F32", "F16", "F64"): return scale().astype(qt.name.replace("F", "float"))[..., None].view(np.uint8)
  if qt.name == "BF16": return (scale().view(np.uint32) >> 16).astype(np.uint16)[..., None].view(np.uint8)
  b = rng.integers(0, 256, (*shape, qt.nbytes), dtype=np.uint8)
  for off in F16_FIELDS.get(qt.name, ()): b[..., off:off+2] = scale().astype(np.float16)[..., None].view(np.uint8)
  if qt.name == "MXFP4": b[..., 0] = rng.integers(0, 251, shape)  # e8m0: 0 and 1 give subnormal scales, 255 overflows
  return b

def reference(qt, b: np.ndarray) -> np.ndarray:
  if qt.name in NP_NATIVE: return b.view(NP_NATIVE[qt.name]).reshape(*b.shape[:-2], -1)
  return quants.dequantize(b.reshape(*b.shape[:-2], -1), GGMLQuantizationType[qt.name])

# ---------------------------------------------------------------- DEV=NULL (subprocess)

def null_measure(names: list[str]) -> dict:
  """Run in a DEV=NULL process: kernel count and global_mem / packed bytes for a GEMV and a 2-of-64 expert gather."""
  def count(y: Tensor, packed: int) -> list:
    GlobalCounters.reset()  # the graph (and any lookup table upload) is built before this
    y.realize()
    return [GlobalCounters.kernel_count, GlobalCounters.global_mem / packed]
  out = {}
  for name in names:
    qt = QTYPE_BY_NAME[name]
    b = Tensor.empty(4096, 4096 // qt.block, qt.nbytes, dtype=dtypes.uint8).realize()
    x = Tensor.empty(1, 4096).realize()
    gemv = count(linear(x, QTensor(b, qt, (4096, 4096))), b.nbytes())
    E, O, I = 64, 512, 2048
    eb = Tensor.empty(E, O, I // qt.block, qt.nbytes, dtype=dtypes.uint8).realize()
    sel = Tensor([3, 17], dtype=dtypes.int32).realize()
    x = Tensor.empty(1, I).realize()
    gather = count(linear(x.unsqueeze(0), QTensor(eb, qt, (E, O, I))[sel]), 2 * O * I // qt.block * qt.nbytes)
    out[name] = {"gemv": gemv, "gather": gather}
  return out

_null: dict = {}

@pytest.fixture(scope="module", autouse=True)
def _null_proc(request):
  if not any(it.name.startswith(("test_gemv_", "test_expert_gather_")) for it in request.session.items): yield; return
  root = pathlib.Path(__file__).resolve().parents[1]
  env = {**os.environ, "DEV": "NULL", "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
  env.pop("DEBUG", None)
  _null["proc"] = subprocess.Popen([sys.executable, __file__, *NULL_TYPES], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  yield
  if _null["proc"].poll() is None: _null["proc"].kill()

def null_results() -> dict:
  if "res" not in _null:
    out, err = _null["proc"].communicate(timeout=300)
    assert _null["proc"].returncode == 0, err
    _null["res"] = json.loads(out.strip().splitlines()[-1])
  return _null["res"]

# ---------------------------------------------------------------- values

@pytest.mark.parametrize("qt", QTYPES.values(), ids=lambda t: t.name)
def test_dequant_matches_gguf(qt):
  b = rand_blocks(qt, (3, 5), 4 if qt.quantized else 64, np.random.default_rng(qt.id))
  ref = reference(qt, b)
  got = dequantize(Tensor(b), qt).numpy()
  assert got.shape == ref.shape
  if qt.name in NP_NATIVE: np.testing.assert_array_equal(got, ref)
  elif qt.name in EXACT: np.testing.assert_array_equal(got.astype(np.float32).view(np.uint32), ref.view(np.uint32))
  else: np.testing.assert_array_max_ulp(got, ref, maxulp=1)

FLOAT_BITS = ("Q4_0", "Q4_1", "Q8_0")  # quant/formats.py small_float: the codes of these become floats through their bits

@pytest.mark.parametrize("name", FLOAT_BITS)
def test_codes_through_their_bits_on_a_gpu(name):
  """On a GPU renderer (DEV=PYTHON's, Capabilities.float_bits) the codes become float32 through their bits, 2**23 + q
  less 2**23 - c: every code (all 16 nibbles, all 256 int8 bytes) dequantizes to gguf-py's value bit for bit. A wrong
  offset or a signed byte read unsigned gives other values."""
  from tg_ds4 import backend
  qt = QTYPE_BY_NAME[name]
  assert backend.capabilities("PYTHON").float_bits and not backend.capabilities("CPU").float_bits
  b = rand_blocks(qt, (4,), 2, np.random.default_rng(qt.id))
  codes = np.arange(256, dtype=np.uint8).reshape(8, 32)
  qs = (2, 34) if name == "Q8_0" else (2, 18) if name == "Q4_0" else (4, 20)
  b.reshape(8, qt.nbytes)[:, qs[0]:qs[1]] = codes[:, :qs[1] - qs[0]]
  got = dequantize(Tensor(b, device="PYTHON"), qt).numpy()
  np.testing.assert_array_equal(got.view(np.uint32), reference(qt, b).view(np.uint32))

@pytest.mark.parametrize("name,rows", [("Q4_0", 1), ("Q8_0", 3)])
def test_packed_gemv_multiplies_in_float32_on_a_gpu(name, rows):
  """A packed GEMV on a GPU renderer multiplies in float32 even where the device's matmuls take half inputs (its
  dequantized values live only in registers): no kernel of it does half arithmetic (the emulator computes half in
  float32, so only the kernels can tell), and it is within float32 rounding of a float64 product."""
  from tinygrad.uop.ops import GroupOp, Ops
  from tg_ds4.quant import settings
  qt, rng = QTYPE_BY_NAME[name], np.random.default_rng(11)
  b = rand_blocks(qt, (48,), 8, rng)
  x = rng.standard_normal((1, rows, 8 * qt.block)).astype(np.float32)
  ref = x.astype(np.float64) @ reference(qt, b).reshape(48, -1).T.astype(np.float64)
  with settings.Settings.for_model("PYTHON").active() as s:
    assert s.matmul == dtypes.float16
    y, y2 = [linear(Tensor(x, device="PYTHON"), QTensor(Tensor(b, device="PYTHON"), qt, (48, 8 * qt.block))) for _ in range(2)]
  sinks = [c.src[0] for c in y2.linear_with_vars()[0].src if c.op is Ops.CALL and c.src[0].op is Ops.SINK]  # (schedules y2 once)
  assert sinks and not [u.op for k in sinks for u in k.toposort() if u.op in GroupOp.ALU and u.dtype == dtypes.float16]
  np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())

def test_q5_0_as_q8_0_same_values():
  """The CPU re-encoding of Q5_0 weights (models/widen.py) keeps every value: gguf-py's Q5_0 dequantization of the
  original bytes equals its Q8_0 dequantization of the new ones, bit for bit."""
  qt = QTYPE_BY_NAME["Q5_0"]
  b = rand_blocks(qt, (6,), 8, np.random.default_rng(5))
  w8 = q5_0_as_q8_0(QTensor(Tensor(b), qt, (6, 8 * qt.block)))
  assert w8.qtype.name == "Q8_0" and w8.shape == (6, 256) and w8.blocks.shape == (6, 8, 34)
  got = quants.dequantize(w8.blocks.numpy().reshape(6, -1), GGMLQuantizationType.Q8_0)
  np.testing.assert_array_equal(got.view(np.uint32), reference(qt, b).reshape(6, -1).view(np.uint32))

@pytest.mark.parametrize("name", ("Q6_K", "Q4_K"))
def test_widened_k_quant_same_values(name):
  """The CPU re-encoding of K-quant weights (models/widen.py) keeps every value: the widened blocks dequantize to
  gguf-py's values of the original bytes bit for bit, and a GEMV over them agrees with one over the original to float
  rounding (the sums run in another order)."""
  qt, rng = QTYPE_BY_NAME[name], np.random.default_rng(7)
  b = rand_blocks(qt, (6,), 2, rng)
  w = widen_k_quant(QTensor(Tensor(b), qt, (6, 2 * qt.block)))
  assert w.qtype is K_WIDENED[name] and w.shape == (6, 512) and w.blocks.shape == (6, 512 // w.qtype.block, w.qtype.nbytes)
  got = w.dequant(dtypes.float32).numpy()
  np.testing.assert_array_equal(got.view(np.uint32), reference(qt, b).reshape(6, -1).view(np.uint32))
  x = rng.standard_normal((1, 512)).astype(np.float32)
  ref = x.astype(np.float64) @ reference(qt, b).reshape(6, -1).T.astype(np.float64)
  np.testing.assert_allclose(linear(Tensor(x), w).numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())

@pytest.mark.parametrize("name", ("TQ1_0", "TQ2_0", "MXFP4"))
def test_dequant_quantized_data(name):
  # realistic codes from gguf-py's own quantizer (ternary trits, e2m1 with fitted exponents)
  qt = QTYPE_BY_NAME[name]
  q = quants.quantize((np.random.default_rng(2).standard_normal((3, 512)) * 0.3).astype(np.float32), GGMLQuantizationType[name])
  got = dequantize(Tensor(q.reshape(3, -1, qt.nbytes)), qt).numpy()
  np.testing.assert_array_max_ulp(got, quants.dequantize(q, GGMLQuantizationType[name]), maxulp=1)

def test_mxfp4_every_exponent():
  # e8m0 scale bytes 0..254 (0 and 1 give subnormal halves, the top ones overflow to inf in both), every 4-bit code
  qt = QTYPE_BY_NAME["MXFP4"]
  b = np.random.default_rng(1).integers(0, 256, (255, qt.nbytes), dtype=np.uint8)
  b[:, 0], b[:, 1:9] = np.arange(255), np.array([0x10, 0x32, 0x54, 0x76, 0x98, 0xba, 0xdc, 0xfe], dtype=np.uint8)
  with np.errstate(over="ignore"): ref = reference(qt, b)
  np.testing.assert_array_equal(dequantize(Tensor(b), qt).numpy().view(np.uint32), ref.view(np.uint32))

def test_f16_every_bit_pattern():
  # on the CPU F16 is widened with integer ops (quant._f16): every half, subnormals, infs and nans, bit for bit
  h = np.arange(1 << 16, dtype=np.uint16)
  got = dequantize(Tensor(h.view(np.uint8).reshape(-1, 1, 2)), QTYPE_BY_NAME["F16"]).numpy().reshape(-1)
  np.testing.assert_array_equal(got.view(np.uint32), h.view(np.float16).astype(np.float32).view(np.uint32))

def _experts(name: str, nb: int, seed: int, lead=(6, 3)):
  qt = QTYPE_BY_NAME[name]
  b = rand_blocks(qt, lead, nb, np.random.default_rng(seed))
  return QTensor(Tensor(b), qt, (*lead, nb * qt.block)), b, reference(qt, b)

@pytest.mark.parametrize("name", ("F16", "Q3_K", "Q6_K", "IQ2_XXS", "TQ1_0"))
def test_gather_rows(name):
  w, _, full = _experts(name, 2, 7)
  ids = np.array([[4, 0, 4], [5, 1, 2]], dtype=np.int32)  # token x top-k expert ids, with a repeat
  g = w[Tensor(ids, dtype=dtypes.int32)]
  assert g.shape == (2, 3, *w.shape[1:]) and g.blocks.shape == (2, 3, *w.blocks.shape[1:])
  np.testing.assert_array_equal(g.dequant().numpy(), full[ids])

def test_qtensor_indexing():
  w, b, full = _experts("Q4_K", 2, 8)
  g = w[Tensor([3, 1], dtype=dtypes.int32)][1:, ::2]  # gather, then basic indexing of the result
  assert g.shape == (1, 2, 512)
  np.testing.assert_array_equal(g.dequant().numpy(), full[[3, 1]][1:, ::2])
  np.testing.assert_array_equal(g.blocks.numpy(), b[[3, 1]][1:, ::2])  # the equivalent byte gather
  np.testing.assert_array_equal(w[2, 1].dequant().numpy(), full[2, 1])

# formats contracted in a permuted load order must permute x to match; table formats look up per gathered field
@pytest.mark.parametrize("name", ("F16", "Q4_0", "Q5_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ4_XS", "TQ1_0", "MXFP4"))
def test_gathered_linear(name):
  w, _, full = _experts(name, 2 if QTYPE_BY_NAME[name].block > 32 else 8, 3, lead=(4, 5))
  sel = np.array([3, 0], dtype=np.int32)
  x = np.random.default_rng(4).standard_normal((2, 1, w.shape[-1])).astype(np.float32)
  got = linear(Tensor(x), w[Tensor(sel, dtype=dtypes.int32)]).numpy()
  ref = x.astype(np.float64) @ full[sel].astype(np.float64).transpose(0, 2, 1)
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(full).max() * w.shape[-1])

def test_linear_bias_plain():
  w, _, full = _experts("Q3_K", 1, 5, lead=(3,))
  bias, _, bfull = _experts("F16", 3, 6, lead=())
  x = np.random.default_rng(5).standard_normal((2, 256)).astype(np.float32)
  ref = x.astype(np.float64) @ full.T.astype(np.float64) + bfull
  np.testing.assert_allclose(linear(Tensor(x), w, bias).numpy(), ref, rtol=1e-4, atol=1e-5 * np.abs(full).max() * 256)

# ---------------------------------------------------------------- fusion and bytes (DEV=NULL)

# formats whose CPU GEMV (quant.linear's affine form, scheduled on NULL as on the CPU) first sums x over each block's
# values that share a lane, in a kernel of its own that reads only x: the offset term (Q4_0's -8)
X_SUMS = {"Q4_0"}

@pytest.mark.parametrize("name", NULL_TYPES)
def test_gemv_one_kernel_packed_bytes(name):
  kernels, ratio = null_results()[name]["gemv"]
  assert kernels == 1 + (name in X_SUMS) and ratio <= MAX_BYTES_RATIO, (kernels, ratio)

@pytest.mark.parametrize("name", NULL_TYPES)
def test_expert_gather_one_kernel_packed_bytes(name):
  kernels, ratio = null_results()[name]["gather"]
  assert kernels == 1 + (name in X_SUMS) and ratio <= MAX_BYTES_RATIO, (kernels, ratio)

if __name__ == "__main__":
  assert os.environ.get("DEV") == "NULL", "run with DEV=NULL"
  print(json.dumps(null_measure(sys.argv[1:])))

@pytest.mark.parametrize("name", ["Q4_1", "Q5_0", "F32"])
def test_fuse_rows_equals_its_parts(name):
  """layers.fuse_rows (q|k and gate|up of dense GQA blocks): the fused Linear's output is the parts' outputs side by side,
  for one token (the lanes GEMV) and a chunk (the dequantize-once GEMM), and the parts still compute the same through
  their views of the fused bytes."""
  from tg_ds4.nn.layers import Linear, fusable, fuse_rows
  rng, qt = np.random.default_rng(5), QTYPE_BY_NAME[name]
  parts = []
  for n in (48, 16):
    w = rng.standard_normal((n, 64)).astype(np.float32)
    raw = np.ascontiguousarray(quants.quantize(w, GGMLQuantizationType[name])).view(np.uint8)
    lin = Linear(64, n, bias=True)
    lin.weight = QTensor(Tensor(raw.reshape(n, 64 // qt.block, qt.nbytes)), qt, (n, 64))
    lin.bias = Tensor(rng.standard_normal(n).astype(np.float32))
    parts.append(lin)
  xs = [Tensor(rng.standard_normal((1, t, 64)).astype(np.float32)) for t in (1, 5)]
  before = [[p(x).numpy() for p in parts] for x in xs]
  assert fusable(*parts)
  fused = fuse_rows(*parts)
  for x, ref in zip(xs, before):
    np.testing.assert_allclose(fused(x).numpy(), np.concatenate(ref, axis=-1), rtol=1e-5, atol=1e-5)
    for p, r in zip(parts, ref): np.testing.assert_allclose(p(x).numpy(), r, rtol=1e-6, atol=1e-6)

def test_unlike_weights_are_not_fusable():
  from tg_ds4.nn.layers import Linear, fusable
  a, b = Linear(64, 8), Linear(64, 8, bias=True)
  a.weight = b.weight = QTensor(Tensor.zeros(8, 2, 18, dtype=dtypes.uint8).contiguous(), QTYPE_BY_NAME["Q4_0"], (8, 64))
  b.bias = Tensor.zeros(8)
  assert not fusable(a, b)
  b.bias = None
  b.weight = QTensor(Tensor.zeros(8, 2, 20, dtype=dtypes.uint8).contiguous(), QTYPE_BY_NAME["Q4_1"], (8, 64))
  assert not fusable(a, b)
