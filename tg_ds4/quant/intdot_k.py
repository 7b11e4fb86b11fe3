"""Q2_K and IQ2_XXS GEMVs as llama.cpp computes them on an x86 CPU with AVX2: x rounded to Q8_K (int8 per block of
256 with a float32 scale and 16 int16 sums of 16 values, ggml's quantize_row_q8_K_ref, which quant/activations.py's
_q8_k states as tensor ops), each weight block's integer dot product with it in eight int32 lanes, and eight float
lanes per output accumulated over the blocks by fused multiply-adds, summed at the end as hsum_float_8 sums them
(ggml's vec_dot_q2_K_q8_K and vec_dot_iq2_xxs_q8_K). On a CPU with AVX-512, llama.cpp 0.3.36 instead repacks a Q2_K
matrix whose row count is a multiple of 8 (repack.cpp's q2_K_8x8_q8_K): the same integers, its own float order, not
reproduced here. quant/intdot.py runs these statements as it runs its own
formats' (one output row per statement, several rows of x per weight block, gathered experts, prefill tiles); this
module holds what differs: the Q8_K rounding kernel and the block dots.

Lane l of a block's integer sum holds the products of the values 4l..4l+3 of every 32 of the block (what `vpmaddubsw`
then `vpmaddwd`, or one `vpdpbusd`, leave in lane l), each times its sub-block's scale. Those integers are exact in any
order, so only the float steps need llama.cpp's order:
- Q2_K: acc = fma(-d_x * dmin_w, float(mins . bsums lane l), acc), then acc = fma(d_x * d_w, float(lane l), acc), where
  lane l of the mins term is min(2l) * bsum(2l) + min(2l+1) * bsum(2l+1). A GEMV multiplies each plane's int16 pair
  sums by their scales (`vpmaddwd`, as llama.cpp); prefill tiles scale the values once per weight row instead (a 2-bit
  value times its 4-bit scale fits an unsigned byte), and each row's dot is then one multiply-add instruction per
  plane (VNNI) or two (AVX2).
- IQ2_XXS: each 32 values are 4 rows of 8 from a 256-entry grid (bytes 8, 25, 43) with 4 x 7 sign bits and a 4-bit
  scale s; x takes the signs (`vpsignb`), the lanes are summed with weight 2s + 1, acc = fma(d_w * d_x, float(lane l),
  acc), and the result is 0.125 * hsum. The grid and the sign patterns (gguf-py's) are constant arrays in the kernel."""
from __future__ import annotations

import functools

import numpy as np
from tinygrad import Tensor, dtypes

from tg_ds4.backend.compat import Estimates, KernelInfo, UOp, prod
from tg_ds4.quant import ckernel

FORMATS = {"Q2_K": 84, "IQ2_XXS": 66, "Q4_K": 144, "Q6_K": 210}  # block bytes; a block is 256 values
BLOCK = 256
BSUMS = ("Q2_K", "Q4_K", "Q6_K")  # formats whose dot reads x's 16 sums per block

@functools.cache
def _table_values() -> dict[str, np.ndarray]:
  from gguf.quants import IQ2_XXS
  IQ2_XXS.init_grid()
  assert IQ2_XXS.grid is not None
  grid = IQ2_XXS.grid.reshape(256, 8).astype(np.uint8)                                    # a code's 8 bytes: 8, 25 or 43
  bits = (np.frombuffer(IQ2_XXS.ksigns, dtype=np.uint8)[:, None] >> np.arange(8)) & 1
  return {"GRID": grid.reshape(-1), "SIGNS": np.where(bits == 1, -1, 1).astype(np.int8).reshape(-1)}  # ggml's keven_signs_q2xs


_TYPES = """typedef signed char v32c __attribute__((vector_size(32))); typedef unsigned char v32u __attribute__((vector_size(32)));
  typedef short v16s __attribute__((vector_size(32))); typedef int v8i __attribute__((vector_size(32)));
  typedef float v8f __attribute__((vector_size(32))); typedef unsigned long long v4q __attribute__((vector_size(32)));
  typedef short v8s __attribute__((vector_size(16))); typedef float v4f __attribute__((vector_size(16)));"""

def _splat(v: str, t: str, n: int) -> str: return "(%s){" % t + ",".join([v] * n) + "}"

# a block's scalars (`_HEAD`, from its bytes `blk_`) and plane `p_`'s 32 values (`_PLANE`) as the dot reads them: Q2_K's
# d, dmin and 16 minima, its 2-bit values times their 4-bit scales; IQ2_XXS's d, its grid bytes, signs and lane
# weight 2s + 1. Each is (C, [(type, name)] of what it defines).
_HEAD = {
  "Q2_K": ("""v16s mn_; for (int i_ = 0; i_ < 16; i_++) mn_[i_] = (short)(blk_[i_] >> 4);
      __fp16 h_; __builtin_memcpy(&h_, blk_ + 80, 2); const float dw_ = (float)h_;
      __builtin_memcpy(&h_, blk_ + 82, 2); const float mw_ = (float)h_;""", [("v16s", "mn_"), ("float", "dw_"), ("float", "mw_")]),
  "IQ2_XXS": ("__fp16 h_; __builtin_memcpy(&h_, blk_, 2); const float dw_ = (float)h_;", [("float", "dw_")]),
  # Q4_K: the 12 bytes of 6-bit scales and minima unpacked as ggml's utmp shuffle (get_scale_min_k4's values)
  "Q4_K": ("""unsigned int u_[4]; __builtin_memcpy(u_, blk_ + 4, 12);
      u_[3] = ((u_[2] >> 4) & 0x0f0f0f0fu) | (((u_[1] >> 6) & 0x03030303u) << 4);
      const unsigned int ua_ = u_[1] & 0x3f3f3f3fu;
      u_[1] = (u_[2] & 0x0f0f0f0fu) | (((u_[0] >> 6) & 0x03030303u) << 4); u_[2] = ua_; u_[0] &= 0x3f3f3f3fu;
      const unsigned char *sm_ = (const unsigned char *)u_;
      v8s sc_, mn_; for (int i_ = 0; i_ < 8; i_++) { sc_[i_] = sm_[i_]; mn_[i_] = sm_[8 + i_]; }
      __fp16 h_; __builtin_memcpy(&h_, blk_, 2); const float dw_ = (float)h_;
      __builtin_memcpy(&h_, blk_ + 2, 2); const float mw_ = (float)h_;""", [("v8s", "sc_"), ("v8s", "mn_"), ("float", "dw_"), ("float", "mw_")]),
  "Q6_K": ("""v16s sc6_; for (int i_ = 0; i_ < 16; i_++) sc6_[i_] = (short)(signed char)blk_[192 + i_];
      __fp16 h_; __builtin_memcpy(&h_, blk_ + 208, 2); const float dw_ = (float)h_;""", [("v16s", "sc6_"), ("float", "dw_")])}
_PLANE = {
  "Q2_K": ("""v32u bits_; __builtin_memcpy(&bits_, blk_ + 16 + (p_ >> 2) * 32, 32);
        const unsigned char lo_ = blk_[2 * p_] & 15, hi_ = blk_[2 * p_ + 1] & 15;
        const v32u q_ = (bits_ >> (unsigned char)(2 * (p_ & 3))) & (unsigned char)3;
        const v16s scl_ = {%s};""" % ",".join(["lo_"] * 8 + ["hi_"] * 8), [("v32u", "q_"), ("v16s", "scl_")]),
  "IQ2_XXS": ("""unsigned int a_, m_; __builtin_memcpy(&a_, blk_ + 2 + 8 * p_, 4); __builtin_memcpy(&m_, blk_ + 6 + 8 * p_, 4);
        const v32u q_ = (v32u)(v4q){grid_[a_ & 255], grid_[(a_ >> 8) & 255], grid_[(a_ >> 16) & 255], grid_[a_ >> 24]};
        const v32c sg_ = (v32c)(v4q){signs_[m_ & 127], signs_[(m_ >> 7) & 127], signs_[(m_ >> 14) & 127], signs_[(m_ >> 21) & 127]};
        const short l_ = (short)(2 * (m_ >> 28) + 1);
        const v16s ls_ = {%s};""" % ",".join(["l_"] * 16), [("v32u", "q_"), ("v32c", "sg_"), ("v16s", "ls_")]),
  # Q4_K: plane p is the low (p even) or high nibbles of the 32 bytes p/2, one 6-bit scale
  "Q4_K": ("""v32u bits_; __builtin_memcpy(&bits_, blk_ + 16 + (p_ >> 1) * 32, 32);
        const v32u q_ = (bits_ >> (unsigned char)(4 * (p_ & 1))) & (unsigned char)15;
        const short k_ = sc_[p_];
        const v16s scl_ = {%s};""" % ",".join(["k_"] * 16), [("v32u", "q_"), ("v16s", "scl_")]),
  # Q6_K: plane p = 4h + k takes nibble k >> 1 of ql's 32 bytes 64h + 32 (k & 1) and bits 2k, 2k+1 of qh's 32 bytes
  # 128 + 32h as its value's bits 4 and 5 (0..63, the -32 is x's sums' term); its two halves' int8 scales 2p, 2p+1
  "Q6_K": ("""const int h6_ = p_ >> 2, k6_ = p_ & 3;
        v32u lb_, hb_; __builtin_memcpy(&lb_, blk_ + 64 * h6_ + 32 * (k6_ & 1), 32); __builtin_memcpy(&hb_, blk_ + 128 + 32 * h6_, 32);
        const v32u q_ = ((lb_ >> (unsigned char)(4 * (k6_ >> 1))) & (unsigned char)15) |
                        (((hb_ >> (unsigned char)(2 * k6_)) & (unsigned char)3) << (unsigned char)4);
        const short ka_ = sc6_[2 * p_], kb_ = sc6_[2 * p_ + 1];
        const v16s scl_ = {%s};""" % ",".join(["ka_"] * 8 + ["kb_"] * 8), [("v32u", "q_"), ("v16s", "scl_")])}
# prefill tiles: Q2_K's values times their scales once per weight row (a 2-bit value times a 4-bit scale fits a byte),
# so that each row's dot is one multiply-add per plane; a GEMV takes the scales per row instead (llama.cpp's
# vpmaddwd with them), which costs less than the byte multiplies where the block is unpacked for one row
_SCALED = """const v32u sc_ = {%s};
        const v32u q_ = uq_ * sc_;""" % ",".join(["lo_"] * 16 + ["hi_"] * 16)
@functools.cache
def _c_tables() -> str:
  """IQ2_XXS's grid (256 rows of 8 bytes) and sign patterns (128 of 8 bytes of +-1) as constant C arrays of 64-bit rows
  in the statement (compiled into the kernel: no buffer to load or capture)."""
  v = _table_values()
  rows = lambda a: ",".join(f"{x}ULL" for x in a.view(np.uint64))
  return (f"static const unsigned long long grid_[256] = {{{rows(v['GRID'])}}};\n  "
          f"static const unsigned long long signs_[128] = {{{rows(v['SIGNS'].view(np.uint8))}}};")


def _step(fmt: str, vnni: bool, scaled: bool) -> str:
  """Row r_'s lanes `s_[r_]` += plane p_ of the block against the row's 32 int8 `xv_` (`scaled`: Q2_K's values already
  times their scales)."""
  if fmt == "Q2_K" and scaled:
    return ("s_[r_] = __builtin_ia32_vpdpbusd256(s_[r_], (v8i)q_, (v8i)xv_);" if vnni else
            f"s_[r_] = s_[r_] + __builtin_ia32_pmaddwd256(__builtin_ia32_pmaddubsw256((v32c)q_, xv_), {_splat('1', 'v16s', 16)});")
  if fmt in ("Q2_K", "Q4_K", "Q6_K"): return "s_[r_] = s_[r_] + __builtin_ia32_pmaddwd256(__builtin_ia32_pmaddubsw256((v32c)q_, xv_), scl_);"
  return "s_[r_] = s_[r_] + __builtin_ia32_pmaddwd256(__builtin_ia32_pmaddubsw256((v32c)q_, __builtin_ia32_psignb256(xv_, sg_)), ls_);"

def _finish(fmt: str) -> str:
  """Row r_'s float lanes `acc_[r_]` after the block: its scale `xd_` (Q2_K: and its 16 sums at `xb_i_`)."""
  if fmt == "Q2_K":
    return f"""v16s bs_; __builtin_memcpy(&bs_, (const short *)@XB@ + xb_i_ * 16, 32);
        const v8i mp_ = __builtin_ia32_pmaddwd256(mn_, bs_);
        acc_[r_] = __builtin_ia32_vfmaddps256({_splat("-xd_ * mw_", "v8f", 8)}, __builtin_convertvector(mp_, v8f), acc_[r_]);
        acc_[r_] = __builtin_ia32_vfmaddps256({_splat("xd_ * dw_", "v8f", 8)}, __builtin_convertvector(s_[r_], v8f), acc_[r_]);"""
  if fmt == "Q4_K":  # the minima against x's 8 sums of 32 (hadd of the 16 sums), 4 lanes of their own (acc_m)
    pm = ",".join(f"(float)(mn_[{2*k}] * (short)(bs_[{4*k}] + bs_[{4*k+1}]) + mn_[{2*k+1}] * (short)(bs_[{4*k+2}] + bs_[{4*k+3}]))" for k in range(4))
    return f"""v16s bs_; __builtin_memcpy(&bs_, (const short *)@XB@ + xb_i_ * 16, 32);
        accm_[r_] = __builtin_ia32_vfmaddps({_splat("-xd_ * mw_", "v4f", 4)}, (v4f){{{pm}}}, accm_[r_]);
        acc_[r_] = __builtin_ia32_vfmaddps256({_splat("xd_ * dw_", "v8f", 8)}, __builtin_convertvector(s_[r_], v8f), acc_[r_]);"""
  if fmt == "Q6_K":  # the values' -32: 32 times x's 16 sums times their scales, lane l from the sums 2l, 2l+1
    return f"""v16s bs_; __builtin_memcpy(&bs_, (const short *)@XB@ + xb_i_ * 16, 32);
        const v8i sb_ = __builtin_ia32_pmaddwd256(bs_, sc6_) << 5;
        acc_[r_] = __builtin_ia32_vfmaddps256({_splat("xd_ * dw_", "v8f", 8)}, __builtin_convertvector(s_[r_] - sb_, v8f), acc_[r_]);"""
  return f"acc_[r_] = __builtin_ia32_vfmaddps256({_splat('dw_ * xd_', 'v8f', 8)}, __builtin_convertvector(s_[r_], v8f), acc_[r_]);"

def source(fmt: str, nb: int, out: int, rows: int, matrix_bytes: int, gathered: bool, x_per_matrix: bool, tiles: int = 1,
           vnni: bool = False, stride: int = 0) -> str:
  """One output row (`@R@`: the flat index over matrix x output row) against `rows` rows of x, in `tiles` tiles of them
  in turn (each with its own accumulators), as quant/intdot.py's `_source`; its other arguments are that one's. Each
  plane is unpacked and then taken by every row before the next (one row: the block streams through registers); with
  tiles the weight row is unpacked once, into arrays that stay in L1, and every tile reads them."""
  bb, total = FORMATS[fmt], stride or rows * tiles
  mat = ("((const int *)@IDX@)[@R@ / %d]" if gathered else "@R@ / %d") % out
  xrow = "(@R@ / %d) * %d" % (out, total) if x_per_matrix else "0"
  (head, hv), (plane, pv) = _HEAD[fmt], _PLANE[fmt]
  scaled = fmt == "Q2_K" and tiles > 1
  if scaled: plane, pv = plane.replace("const v32u q_ =", "const v32u uq_ =") + "\n        " + _SCALED, [("v32u", "q_")]
  blk = f"const unsigned char *blk_ = w_ + (long)b_ * {bb};"
  if tiles == 1: prologue = ""
  else:
    decl = " ".join([f"{t} {n}s_[{nb}];" for t, n in hv] + [f"{t} {n}s_[{nb}][8];" for t, n in pv])
    keep_h, keep_p = " ".join(f"{n}s_[b_] = {n};" for _, n in hv), " ".join(f"{n}s_[b_][p_] = {n};" for _, n in pv)
    prologue = f"""{decl}
  for (int b_ = 0; b_ < {nb}; b_++) {{ {blk}
    {{ {head} {keep_h}
      for (int p_ = 0; p_ < 8; p_++) {{ {plane} {keep_p} }} }} }}"""
    head = " ".join(f"const {t} {n} = {n}s_[b_];" for t, n in hv)
    plane = " ".join(f"const {t} {n} = {n}s_[b_][p_];" for t, n in pv)
  tail = "0.125f * " if fmt == "IQ2_XXS" else ""
  # Q4_K's minima sum: (m0 + m2) + (m1 + m3), added after the 8 lanes (ggml's movehl, movehdup, add_ss)
  mins = " + ((accm_[r_][0] + accm_[r_][2]) + (accm_[r_][1] + accm_[r_][3]))" if fmt == "Q4_K" else ""
  return f"""({{ {_TYPES}
  const unsigned char *w_ = (const unsigned char *)@W@ + (long)({mat}) * {matrix_bytes}L + (long)(@R@ % {out}) * {nb * bb};
  {_c_tables() if fmt == 'IQ2_XXS' else ''}
  {prologue}
  for (int t_ = 0; t_ < {tiles}; t_++) {{
    const int xr_ = {xrow} + t_ * {rows};
    v8f acc_[{rows}]; v4f accm_[{rows}]; (void)accm_;
    for (int r_ = 0; r_ < {rows}; r_++) {{ acc_[r_] = {_splat("0.0f", "v8f", 8)}; accm_[r_] = {_splat("0.0f", "v4f", 4)}; }}
    for (int b_ = 0; b_ < {nb}; b_++) {{
      {blk} (void)blk_;
      {head}
      v8i s_[{rows}];
      for (int r_ = 0; r_ < {rows}; r_++) s_[r_] = {_splat("0", "v8i", 8)};
      for (int p_ = 0; p_ < 8; p_++) {{
        {plane}
        for (int r_ = 0; r_ < {rows}; r_++) {{
          v32c xv_; __builtin_memcpy(&xv_, (const signed char *)@XQ@ + ((long)(xr_ + r_) * {nb} + b_) * {BLOCK} + 32 * p_, 32);
          {_step(fmt, vnni, scaled)}
        }}
      }}
      for (int r_ = 0; r_ < {rows}; r_++) {{
        const long xb_i_ = (long)(xr_ + r_) * {nb} + b_;
        const float xd_ = ((const float *)@XD@)[xb_i_];
        {_finish(fmt)}
      }}
    }}
    for (int r_ = 0; r_ < {rows}; r_++) {{
      const v8f a_ = acc_[r_];
      ((float *)@OUT@)[(long)(@R@ / {out}) * {out * total} + (long)(t_ * {rows} + r_) * {out} + @R@ % {out}] =
        {tail}(((a_[0] + a_[4]) + (a_[2] + a_[6])) + ((a_[1] + a_[5]) + (a_[3] + a_[7]))){mins};
    }}
  }}
}});"""

# one block of 256 floats (`@R@`: the block) -> its int8 values, its scale and its 16 sums of 16, as ggml's
# quantize_row_q8_K_ref: max = the first value of largest magnitude (sign kept), iscale = -127 / max,
# q = min(127, rint(iscale * x)) in the default rounding mode (ggml's nearest_int), d = 1 / iscale
_QUANTIZE = """({ const float *x_ = (const float *)@X@ + (long)@R@ * 256;
  signed char *q_ = (signed char *)@XQ@ + (long)@R@ * 256; short *bs_ = (short *)@XB@ + (long)@R@ * 16;
  float amax_ = 0.0f, max_ = 0.0f;
  for (int i_ = 0; i_ < 256; i_++) { const float a_ = __builtin_fabsf(x_[i_]); if (a_ > amax_) { amax_ = a_; max_ = x_[i_]; } }
  const float is_ = amax_ != 0.0f ? -127.0f / max_ : 0.0f;
  for (int j_ = 0; j_ < 16; j_++) {
    int s_ = 0;
    for (int i_ = 0; i_ < 16; i_++) {
      const int v_ = (int)__builtin_rintf(is_ * x_[j_ * 16 + i_]), c_ = v_ < 127 ? v_ : 127;
      q_[j_ * 16 + i_] = (signed char)c_; s_ += c_;
    }
    bs_[j_] = (short)s_;
  }
  ((float *)@XD@)[@R@] = amax_ != 0.0f ? 1.0f / is_ : 0.0f;
});"""

def quantize(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
  """x `[..., in]` -> (int8 `[..., in/256, 256]`, float32 scales `[..., in/256]`, int16 sums `[..., in/256, 16]`), one kernel."""
  blocks, nb = prod(x.shape) // BLOCK, x.shape[-1] // BLOCK
  srcs = {"XQ": Tensor.empty(blocks * BLOCK, dtype=dtypes.int8, device=x.device),
          "XD": Tensor.empty(blocks, dtype=dtypes.float32, device=x.device),
          "XB": Tensor.empty(blocks * 16, dtype=dtypes.int16, device=x.device), "X": x.float().contiguous().flatten()}
  body = ckernel.format_string(_QUANTIZE, [*srcs, "R"])
  def kernel(*params: UOp) -> UOp:
    r = UOp.range(blocks, 0)
    est = Estimates(ops=4 * blocks * BLOCK, lds=blocks * BLOCK * 9 + 36 * blocks, mem=blocks * BLOCK * 5 + 36 * blocks)
    info = KernelInfo(name=f"q8_k_quantize_{blocks}", estimates=est)
    return ckernel.statement_kernel(body, params, {0: r * BLOCK, 1: r, 2: r * 16}, r, (r,), info)
  xq, xd, xb, _ = Tensor.custom_kernel(*srcs.values(), fxn=kernel)
  lead = x.shape[:-1]
  return xq.reshape(*lead, nb, BLOCK), xd.reshape(*lead, nb), xb.reshape(*lead, nb, 16)
