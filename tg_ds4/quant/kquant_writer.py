"""Q4_K quantization in numpy, bit for bit ggml's `quantize_row_q4_K_ref` (ggml-quants.c): gguf-py's quantizers stop at
the 32-element types (`gguf.quants.quantize` raises NotImplementedError for every K-quant), and `--quantize q4_k` of a
checkpoint folder should give exactly the blocks llama.cpp's quantizer writes without an importance matrix.

Vectorized over blocks. Bit-identity needs ggml's float32 arithmetic reproduced exactly:
- every sum is accumulated left to right in float32, as the C loops do (numpy's `sum` along a row adds pairwise,
  which rounds differently), so sums loop over the 32 elements of a sub-block, each step vectorized over sub-blocks;
- every expression keeps C's evaluation order and float32 constants (`scale * L + min - x` is `(scale * L + min) - x`);
- `nearest_int` is ggml's magic-number trick (add 1.5 * 2**23, keep the low mantissa bits): round half to even, and
  the same wrapped value ggml gets for an out-of-range argument (an infinite scale, say);
- d and dmin are rounded to float16 to nearest even, as GGML_FP32_TO_FP16 does.
- min / max are taken as ggml's `if (x[i] < min)` loops take them, so a NaN or inf lands where it lands in ggml.
The sub-block scale search (`make_qkx2_quants`) keeps its state per sub-block: the running `min` it moves to a
better fit is what the next candidate scale is measured from, and a sub-block whose final scale rounds to 0 keeps the
quants that search chose. Checked against ggml's own `ggml_quantize_chunk` (tests/fixtures/make_q4k_reference.py)."""
from __future__ import annotations

import numpy as np

Q4_K_BLOCK = 256  # QK_K: elements per block
Q4_K_BYTES = 144  # block_q4_K: d, dmin (float16), scales[12] (6-bit scale and min per 32-element sub-block), qs[128]
_SUB = 32         # elements per sub-block
_NMAX = 15        # 4-bit quants 0..15
# make_qkx2_quants' candidate scales as quantize_row_q4_K_ref asks for them: nmax + rmin + rdelta * is, is = 0..nstep
_RMIN, _RDELTA, _NSTEP = np.float32(-1.0), np.float32(0.1), 20

def nearest_int(f: np.ndarray) -> np.ndarray:
  """ggml's nearest_int on float32: round half to even for |f| <= 4194303, ggml's own wrapped value beyond."""
  return ((f + np.float32(12582912.0)).view(np.int32) & 0x007FFFFF) - 0x00400000

def _seq_sum(a: np.ndarray) -> np.ndarray:
  """Sum over the first axis left to right in float32, as ggml's loops add (starting from the first term)."""
  s = a[0].copy()
  for r in a[1:]: s += r
  return s

def _quants(iscale: np.ndarray, x: np.ndarray, mn: np.ndarray) -> np.ndarray:
  """MAX(0, MIN(nmax, nearest_int(iscale*(x[i] - min)))) as float32 (ggml multiplies them with floats)."""
  return np.clip(nearest_int(iscale * (x - mn)), 0, _NMAX).astype(np.float32)

def make_qkx2_quants(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """ggml's make_qkx2_quants(32, 15, x, weights, L, &the_min, Laux, -1, 0.1, 20, false) for sub-blocks laid out
  element-major: x, w `[32, M]`. Returns (scale `[M]`, the_min `[M]`, L `[32, M]` float32 0..15)."""
  mn, mx = x[0], x[0]
  for r in x[1:]: mn, mx = np.where(r < mn, r, mn), np.where(r > mx, r, mx)  # as ggml's `if (x[i] < min)`: a NaN never taken
  sum_w, sum_x = _seq_sum(w), _seq_sum(w * x)
  mn = np.where(mn > 0, np.float32(0), mn)
  flat = mx == mn  # ggml returns scale 0, L 0 for these before dividing by max - min
  iscale = np.float32(_NMAX) / (mx - mn)
  scale = np.float32(1) / iscale
  L = _quants(iscale, x, mn)
  diff = scale * L + mn - x
  best = _seq_sum(w * (diff * diff))
  for step in range(_NSTEP + 1):
    iscale = (_RMIN + _RDELTA * np.float32(step) + np.float32(_NMAX)) / (mx - mn)
    laux = _quants(iscale, x, mn)
    wl = w * laux
    sum_l, sum_l2, sum_xl = _seq_sum(wl), _seq_sum(wl * laux), _seq_sum(wl * x)
    D = sum_w * sum_l2 - sum_l * sum_l
    this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
    this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
    pos = this_min > 0
    this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
    this_min = np.where(pos, np.float32(0), this_min)
    diff = this_scale * laux + this_min - x
    cur = _seq_sum(w * (diff * diff))
    take = (D > 0) & (cur < best)
    L = np.where(take, laux, L)
    best, scale, mn = np.where(take, cur, best), np.where(take, this_scale, scale), np.where(take, this_min, mn)
  return np.where(flat, np.float32(0), scale), -mn, np.where(flat, np.float32(0), L)

def quantize_blocks(blocks: np.ndarray) -> np.ndarray:
  """quantize_row_q4_K_ref for float32 blocks `[n, 256]`: uint8 `[n, 144]`."""
  n = blocks.shape[0]
  # x[l, b, j] = element 32*j + l of block b: element-major, so each step of a sum reads one contiguous row
  x = np.ascontiguousarray(blocks.astype(np.float32, copy=False).reshape(n, 8, _SUB).transpose(2, 0, 1))
  with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
    av_x = np.sqrt(_seq_sum(x * x) / np.float32(_SUB))
    w = av_x + np.abs(x)
    scales, mins, L = make_qkx2_quants(x.reshape(_SUB, -1), w.reshape(_SUB, -1))
    scales, mins, L = scales.reshape(n, 8), mins.reshape(n, 8), L.reshape(_SUB, n, 8)
    # max_scale / max_min start at 0 and take a sub-block's value only when greater (so never -0 or below 0)
    max_scale, max_min = np.zeros(n, np.float32), np.zeros(n, np.float32)
    for j in range(8):
      max_scale = np.where(scales[:, j] > max_scale, scales[:, j], max_scale)
      max_min = np.where(mins[:, j] > max_min, mins[:, j], max_min)
    inv_scale = np.where(max_scale > 0, np.float32(63) / max_scale, np.float32(0))
    inv_min = np.where(max_min > 0, np.float32(63) / max_min, np.float32(0))
    # ggml stores nearest_int's int in a uint8 before MIN(63, .): a negative one wraps to >= 64, so 63
    ls = np.minimum(nearest_int(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    # GGML_FP32_TO_FP16 rounds to nearest even and overflows to inf, as numpy's cast does
    d16, dmin16 = (max_scale / np.float32(63)).astype(np.float16), (max_min / np.float32(63)).astype(np.float16)
    d = d16.astype(np.float32)[:, None] * ls.astype(np.float32)
    dm = dmin16.astype(np.float32)[:, None] * lm.astype(np.float32)
    q = np.clip(nearest_int((x + dm) / d), 0, _NMAX).astype(np.float32)
    L = np.where(d == 0, L, q).astype(np.uint8)  # `if (!d) continue;`: those sub-blocks keep make_qkx2_quants' quants
  # scales[12]: sub-blocks 0..3 in the low 6 bits of bytes 0..3 (scale) and 4..7 (min); sub-blocks 4..7 as low nibbles
  # in bytes 8..11 (scale | min << 4) with their top 2 bits in the top bits of bytes 0..3 (scale) and 4..7 (min)
  packed = np.empty((n, 12), np.uint8)
  packed[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
  packed[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
  packed[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
  # qs: each 64 elements as 32 bytes, element l in the low nibble of byte l and element l + 32 in its high nibble
  Lb = L.transpose(1, 2, 0).reshape(n, 4, 2, _SUB)  # [block, 64-group, half, l]
  qs = (Lb[:, :, 0] | (Lb[:, :, 1] << 4)).reshape(n, 128)
  return np.concatenate([d16.view(np.uint8).reshape(n, 2), dmin16.view(np.uint8).reshape(n, 2), packed, qs], axis=1)

def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
  """float rows `[..., k * 256]` -> Q4_K bytes `[..., k * 144]`, the shape convention of `gguf.quants.quantize`."""
  if rows.shape[-1] % Q4_K_BLOCK: raise ValueError(f"Q4_K needs rows of a multiple of {Q4_K_BLOCK} elements, got {rows.shape[-1]}")
  blocks = quantize_blocks(np.asarray(rows, np.float32).reshape(-1, Q4_K_BLOCK))
  return blocks.reshape(*rows.shape[:-1], rows.shape[-1] // Q4_K_BLOCK * Q4_K_BYTES)
