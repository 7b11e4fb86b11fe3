"""How a quantized matmul treats its input: llama.cpp's rounding, exact float math, or each where it is faster.

llama.cpp's CPU backend does not multiply a quantized weight by float activations: it first rounds each activation row
to the weight type's "vec_dot_type" (Q8_0/Q8_1 blocks of 32 with an fp16 scale, Q8_K blocks of 256 with an f32 scale,
or fp16 for F16 weights) and takes integer block dot products. That rounding moves logits by ~0.05-0.2 and can flip
close greedy choices or MoE routes. The numerics a model's graphs are built under (quant/settings.py):
- "exact": float math on the exact dequantized weights, the references' arithmetic (transformers on the same values);
- "llama.cpp": every quantized matmul's input rounded as llama.cpp rounds it, for token-exact comparisons with it;
- "auto" (what a model loads with unless told otherwise): llama.cpp's rounding for the weight types whose integer dot
  product the device runs natively (backend.Capabilities.int_dot_formats: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q2_K/Q4_K/Q6_K/IQ2_XXS on an
  AVX2 CPU, where it is faster than exact float math and is what llama.cpp computes for them), exact float math for
  every other type and device.
Outside a model's graphs matmuls are exact. The rounding is expressed as lazy tensor ops and
fuses like everything else."""
from __future__ import annotations

from tinygrad import Tensor, dtypes

from tg_ds4 import backend
from tg_ds4.quant import settings

# ggml-cpu's type_traits_cpu[weight].vec_dot_type, by weight type name
VEC_DOT_TYPE = {"F16": "F16", "Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0", "MXFP4": "Q8_0", "Q4_1": "Q8_1", "Q5_1": "Q8_1",
                **{t: "Q8_K" for t in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ4_XS", "TQ1_0", "TQ2_0")}}

def rounds(weight_type: str, device: str) -> bool:
  """Whether a matmul input for a `weight_type` weight on `device` is rounded as llama.cpp rounds it, under the current
  settings (quant/settings.py)."""
  s = settings.current(device)
  if s.numerics == "exact" or weight_type not in VEC_DOT_TYPE: return False
  return s.numerics == "llama.cpp" or weight_type in s.caps.int_dot_formats

def effective(numerics: str, device: str) -> str:
  """`numerics` as it works out on `device`: "auto" is "exact" where the device has no integer dot product at all."""
  return "exact" if settings.check(numerics) == "auto" and not backend.capabilities(device).int_dot_formats else numerics

def _blocks(x: Tensor, n: int) -> Tensor: return x.reshape(*x.shape[:-1], x.shape[-1] // n, n)

def _fp16_round(v: Tensor) -> Tensor:
  """float32 -> nearest fp16 value (ties to even), as float32, for 0 <= v < 65520 (fp16 overflow not modelled). Done on the bits because tinygrad
  folds `cast(half).cast(float)` away inside a kernel."""
  u = v.bitcast(dtypes.uint32)
  normal = ((u + 0xFFF + ((u >> 13) & 1)) & 0xFFFFE000).bitcast(dtypes.float32)  # keep 10 mantissa bits
  return (v < 2.0 ** -14).where((v * 2.0 ** 24).round() * 2.0 ** -24, normal)   # fp16 subnormals: multiples of 2^-24

def _q8_0(x: Tensor) -> Tensor:
  """quantize_row_q8_0 (x86 SIMD path): q = rint(x * 127/amax) (ties to even), scale stored as fp16(amax/127)."""
  b = _blocks(x.float(), 32)
  amax = b.abs().max(-1, keepdim=True)
  q = (b * (amax != 0).where(127.0 / amax, 0.0)).round()
  return (q * _fp16_round(amax / 127.0)).reshape(x.shape)

def _q8_k(x: Tensor) -> Tensor:
  """quantize_row_q8_K_ref: iscale = -127/max (max = the entry of largest magnitude, sign kept), q = min(127, rint)."""
  b = _blocks(x.float(), 256)
  a = b.abs()
  first = (a == a.max(-1, keepdim=True)).cast(dtypes.int32).cumsum(-1) == 1   # the first entry reaching amax, as ggml scans
  mx = (first & (a == a.max(-1, keepdim=True))).where(b, 0.0).sum(-1, keepdim=True)
  iscale = (mx != 0).where(-127.0 / mx, 0.0)
  q = (b * iscale).round().minimum(127.0)
  return (q * (mx != 0).where(1.0 / iscale, 0.0)).reshape(x.shape)

def round_activations(x: Tensor, weight_type: str) -> Tensor:
  """x rounded as llama.cpp rounds a matmul input for a `weight_type` weight, where `rounds` says so (else x)."""
  if not rounds(weight_type, str(x.device)): return x
  vt = VEC_DOT_TYPE[weight_type]
  # materialised: left lazy, the rounding fuses into the matmul that reads it and is recomputed per output row (an MLA
  # absorb GEMV's whole input rounded again for each of its outputs)
  if vt == "F16": return (x.sign() * _fp16_round(x.abs().float())).cast(x.dtype).contiguous()
  return (_q8_k(x) if vt == "Q8_K" else _q8_0(x)).contiguous()
