"""Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 GEMVs as llama.cpp computes them on an AVX2 CPU: x rounded to Q8_0 (int8 per block
of 32 with an fp16 scale, quant/activations.py's _q8_0; Q8_1 for Q4_1 and Q5_1, with each block's sum), each weight
block's integer dot product with it taken by `vpmaddubsw`/`vpmaddwd` and scaled by the two block scales. Q4_1, Q5_0,
Q5_1 and Q8_0 (ggml's vec_dot; tinyBLAS's GEMM sums the same lanes) keep eight float lanes per output, summed at the
end; Q4_0 with a row count that is a multiple of 8 is ggml's repacked form (`_source_q4_0x8`), which llama.cpp loads
such a matrix into on these CPUs: one float accumulator per output, eight outputs per vector. x is rounded by a kernel
of its own (`_quantize`), once for all GEMVs that read it.

Only where quant/activations.py rounds the input ("auto" or "llama.cpp" numerics): this is llama.cpp's arithmetic, not
the exact float GEMV (quant/formats.py's linear), which is also slower on rounded x (its per-value int-to-float
convert and multiply-add bound it; `profiles/q4_0_gemv_forms.c`). tinygrad's C renderer has no integer-dot
instruction, so the block dot is C with clang's x86 builtins, one kernel made with `Tensor.custom_kernel`: each output
row's loop over its blocks is one `Ops.CUSTOM` statement inside the kernel's (threaded) range over output rows.
Several rows of x (a batched step) share each unpacked weight block and keep their own accumulators, so a row's result
does not depend on how many rows run with it. A gathered weight (nn/moe.py's experts: `QTensor[idx]`) reads each
selected matrix through its index.

Used where the device's capabilities list the format (backend.Capabilities.int_dot_formats: the CPU device, tinygrad's
internals as backend/compat.py expects, an x86 CPU with AVX2 and F16C, `TG_DS4_INT_DOT` not 0). Q2_K, IQ2_XXS, Q4_K and Q6_K run
through the same `linear` on x rounded to Q8_K; their rounding kernel and block dots are quant/intdot_k.py's."""
from __future__ import annotations

import functools

from tinygrad import Tensor, dtypes

from tg_ds4 import backend
from tg_ds4.backend.compat import AxisType, Estimates, KernelInfo, UOp, prod
from tg_ds4.quant import activations, ckernel, intdot_k, settings

# block bytes: an fp16 scale (Q4_1, Q5_1: and an fp16 minimum), Q5's 32 fifth bits, then nibbles or int8
FORMATS = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
MINIMUM = ("Q4_1", "Q5_1")          # value d * q + m: x rounded to Q8_1, whose block sums carry the minimum
# with VNNI, signed weights enter `vpdpbusd` as unsigned bytes w + 128 and each lane starts from -128 times the sum of
# its 4 values of x (`@XL@`, from _quantize): the same integers without the sign transfer (`vpsignb`) per block and row
OFFSET = ("Q4_0", "Q5_0", "Q8_0")
assert set(FORMATS) | set(intdot_k.FORMATS) == set(backend.INT_DOT_FORMATS)  # and the K-quants and IQ2_XXS: x rounded to Q8_K (intdot_k)
MAX_ROWS = 8                        # rows of x per weight matrix kept in registers (8 accumulators of 8 floats)
MAX_TILES = 16                      # a prefill chunk's rows against one weight (ungathered): up to this many tiles of
                                    # MAX_ROWS rows, each weight row unpacked once per tile while it sits in L1
# without VNNI a prefill chunk takes the tiles only for a weight whose float32 copy would be at least this big: the
# float GEMM writes that copy once per chunk and reads it back, which a weight too big to stay in the cores' caches pays
# for in memory traffic; a small one (a 135M model's) stays in cache, and its float GEMM (quant/cgemm.py) keeps up with
# tiles that take two instructions per block dot. With VNNI's one the tiles are faster at every size.
GEMM_MIN_FLOAT_BYTES = 8 << 20

def takes(w) -> bool:
  """Whether a GEMV over `w` (packed, on its device) takes this path at all, whatever x: the format and the rounding."""
  name, device = getattr(getattr(w, "qtype", None), "name", None), str(w.device)
  return name in settings.current(device).caps.int_dot_formats and activations.rounds(name, device)

def try_linear(x: Tensor, w) -> Tensor | None:
  """`x @ w.T` by this path, or None where it does not apply (quant.formats.linear then computes it in float)."""
  return linear(x, w) if takes(w) and applies(x, w) else None

def takes_all(*ws) -> bool:
  """Whether a prefill chunk's expert tiles should gather each tile's weight once and pass its rows as x rows (nn/moe.py):
  where this path takes every one of `ws`, whose kernel unpacks each weight block once for all rows."""
  return all(takes(w) for w in ws)

def repacked(w) -> bool:
  """Whether `w`'s GEMVs take ggml's repacked Q4_0 form (_source_q4_0x8): Q4_0 with a row count that is a multiple of 8,
  a matrix or gathered experts (ggml repacks a 2-D weight of a mul_mat and a 3-D one of a mul_mat_id; a stack of
  per-head matrices used by a plain mul_mat, MLA's attn_k_b and attn_v_b, keeps its blocks and the 8-lane sums)."""
  return w.qtype.name == "Q4_0" and w.shape[-2] % 8 == 0 and (len(w.shape) == 2 or bool(w._src[1]))

def applies(x: Tensor, w) -> bool:
  """For a `w` this path `takes`: whether `linear(x, w)` fits it: ungathered or gathered once on the leading axis, at
  most MAX_ROWS rows of x per weight matrix (an ungathered one, without VNNI at least GEMM_MIN_FLOAT_BYTES as float32:
  a multiple of MAX_ROWS, up to MAX_TILES tiles of them, where the CPU's capabilities allow: a prefill chunk), static
  shapes."""
  if len(w._src[1]) > 1 or not all(isinstance(s, int) for s in (*x.shape, *w.shape)) or x.shape[-1] != w.shape[-1]: return False
  if w._src[1] and not (isinstance(w._src[1][0], Tensor) and w._src[0].ndim == 4) and _first_row(w) is None: return False
  if not (lead := w.shape[:-2]):                                           # every leading axis of x is rows
    R = prod(x.shape[:-1])
    if R <= MAX_ROWS: return True
    caps = settings.current(str(w.device)).caps
    return (caps.int_gemm and R % MAX_ROWS == 0 and R <= MAX_TILES * MAX_ROWS
            and (caps.int_dot_vnni or prod(w.shape) * 4 >= GEMM_MIN_FLOAT_BYTES))
  return x.ndim >= 2 and x.shape[-2] <= MAX_ROWS and x.ndim - 2 <= len(lead)

def _first_row(w) -> int | None:
  """For `w` a block of consecutive rows of a 2-D weight (a unit-step slice of its rows: V4's attn_output_a groups),
  the first row, which the kernel reads from in place; else None. Q4_0's repacked rows go in groups of 8."""
  base, idx = w._src
  if base.ndim != 3 or len(idx) != 1 or not isinstance(s := idx[0], slice) or s.step not in (None, 1): return None
  rows = range(base.shape[0])[s]
  return rows.start if len(rows) and not (repacked(w) and rows.start % 8) else None

# one output row (`@R@`: the flat index over matrix x output row) against R rows of x; the format's unpack
# gives 32 int8 weights `wq_` per block; the lanes are summed as llama.cpp's hsum_float_8 sums them
_NIBBLES = "v16u lo_ = raw_ & (unsigned char)15, hi_ = raw_ >> 4;\n      v32c wq_ = (v32c)__builtin_shufflevector(lo_, hi_, " + \
           ",".join(map(str, range(32))) + ")"
# Q5's fifth bits (bit i of the 32-bit field: value i), each to a byte of 16 or 0, as ggml's bytes_from_bits_32
_FIFTH = ("v4u qh_; __builtin_memcpy(&qh_, blk_ + %d, 4);\n      const v32u hb_ = (v32u)__builtin_shufflevector(qh_, qh_, " +
          ",".join(str(i // 8) for i in range(32)) + ") & (v32u){" + ",".join(str(1 << (i % 8)) for i in range(32)) + "};\n      ")
_UNPACK = {
  "Q4_0": "v16u raw_; __builtin_memcpy(&raw_, blk_ + 2, 16); " + _NIBBLES + " - (signed char)8;",
  "Q4_1": "v16u raw_; __builtin_memcpy(&raw_, blk_ + 4, 16); " + _NIBBLES + ";",
  "Q5_0": _FIFTH % 2 + "v16u raw_; __builtin_memcpy(&raw_, blk_ + 6, 16); " + _NIBBLES +
          " + ((v32c)(hb_ != 0) & (signed char)16) - (signed char)16;",
  "Q5_1": _FIFTH % 4 + "v16u raw_; __builtin_memcpy(&raw_, blk_ + 8, 16); " + _NIBBLES + " + ((v32c)(hb_ != 0) & (signed char)16);",
  "Q8_0": "v32c wq_; __builtin_memcpy(&wq_, blk_ + 2, 32);"}

def _source(fmt: str, nb: int, out: int, rows: int, matrix_bytes: int, gathered: bool, x_per_matrix: bool, tiles: int = 1,
            vnni: bool = False, stride: int = 0) -> str:
  """`tiles` > 1 (a prefill chunk, ungathered): the output row against `tiles` consecutive tiles of `rows` rows of x in
  turn, each tile with its own accumulators, so a row's result is the same as in a tile alone. `vnni`: each block's
  int32 lanes from one `vpdpbusd` (backend.Capabilities.int_dot_vnni), the same integers. `stride`: rows of x (and of
  the output) per matrix where the statement takes only the first `rows` of them (`linear`'s counted rows); default
  rows * tiles."""
  bb, m = FORMATS[fmt], fmt in MINIMUM  # + its minimum times x's block sum, a float sum of its own (ggml's summs)
  off = vnni and fmt in OFFSET
  # the block's 8 int32 lanes: unsigned weights (Q4_1, Q5_1: as they are; OFFSET: + 128) straight into the dot, signed
  # ones through |w| and x with w's signs
  aw = "(v32c)wu_" if off else "wq_" if m else "aw_"
  xs = "xv_" if off or m else "__builtin_ia32_psignb256(xv_, wq_)"
  start = "xl_" if off else "(v8i){0,0,0,0,0,0,0,0}"
  dot = (f"__builtin_ia32_vpdpbusd256({start}, (v8i){aw}, (v8i){xs})" if vnni else
         f"__builtin_ia32_pmaddwd256(__builtin_ia32_pmaddubsw256({aw}, {xs}), one_)")
  mat = ("((const int *)@IDX@)[@R@ / %d]" if gathered else "@R@ / %d") % out
  total = stride or rows * tiles
  xrow = "(@R@ / %d) * %d" % (out, total) if x_per_matrix else "0"
  unpack = f"""const unsigned char *blk_ = w_ + b_ * {bb};
    {_UNPACK[fmt]}
    __fp16 h_; __builtin_memcpy(&h_, blk_, 2); const float dw_ = (float)h_;
    {"__fp16 mh_; __builtin_memcpy(&mh_, blk_ + 2, 2); const float mw_ = (float)mh_;" if m else "const float mw_ = 0.0f;"}
    {"const v32u wu_ = (v32u)wq_ + (unsigned char)128;" if off else "const v32c aw_ = __builtin_ia32_psignb256(wq_, wq_); (void)aw_;"}"""
  # tiles: the weight row unpacked once into arrays that stay in L1 (a Q5 block's bits cost more than a load per tile)
  wv = "const v32u wu_ = wu_s_[b_];" if off else "const v32c wq_ = wq_s_[b_], aw_ = aw_s_[b_]; (void)aw_;"
  prologue = "" if tiles == 1 else f"""{"v32u wu_s_[%d];" % nb if off else "v32c wq_s_[%d], aw_s_[%d];" % (nb, nb)} float dw_s_[{nb}], mw_s_[{nb}];
  for (int b_ = 0; b_ < {nb}; b_++) {{ {unpack}
    {"wu_s_[b_] = wu_;" if off else "wq_s_[b_] = wq_; aw_s_[b_] = aw_;"} dw_s_[b_] = dw_; mw_s_[b_] = mw_; (void)mw_; }}"""
  block = unpack if tiles == 1 else f"{wv} const float dw_ = dw_s_[b_], mw_ = mw_s_[b_]; (void)mw_;"
  return f"""({{ typedef signed char v32c __attribute__((vector_size(32))); typedef unsigned char v16u __attribute__((vector_size(16)));
  typedef short v16s __attribute__((vector_size(32))); typedef int v8i __attribute__((vector_size(32)));
  typedef float v8f __attribute__((vector_size(32))); typedef unsigned char v4u __attribute__((vector_size(4)));
  typedef unsigned char v32u __attribute__((vector_size(32)));
  const unsigned char *w_ = (const unsigned char *)@W@ + (long)({mat}) * {matrix_bytes}L + (long)(@R@ % {out}) * {nb * bb};
  const v16s one_ = {{1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1}};
  {prologue}
  for (int t_ = 0; t_ < {tiles}; t_++) {{
  const int xr_ = {xrow} + t_ * {rows};
  v8f acc_[{rows}];
  float sm_[{rows}];
  for (int r_ = 0; r_ < {rows}; r_++) {{ acc_[r_] = (v8f){{0,0,0,0,0,0,0,0}}; sm_[r_] = 0.0f; }}
  for (int b_ = 0; b_ < {nb}; b_++) {{
    {block}
    for (int r_ = 0; r_ < {rows}; r_++) {{
      v32c xv_; __builtin_memcpy(&xv_, (const signed char *)@XQ@ + ((long)(xr_ + r_) * {nb} + b_) * 32, 32);
      {"v8i xl_; __builtin_memcpy(&xl_, (const int *)@XL@ + ((long)(xr_ + r_) * %d + b_) * 8, 32);" % nb if off else ""}
      const v8i s_ = {dot};
      acc_[r_] = acc_[r_] + __builtin_convertvector(s_, v8f) * (dw_ * ((const float *)@XD@)[(long)(xr_ + r_) * {nb} + b_]);
      {"sm_[r_] += mw_ * ((const float *)@XS@)[(long)(xr_ + r_) * %d + b_];" % nb if m else ""}
    }}
  }}
  for (int r_ = 0; r_ < {rows}; r_++) {{
    const v8f a_ = acc_[r_];
    ((float *)@OUT@)[(long)(@R@ / {out}) * {out * total} + (long)(t_ * {rows} + r_) * {out} + @R@ % {out}] =
      ((a_[0] + a_[4]) + (a_[2] + a_[6])) + ((a_[1] + a_[5]) + (a_[3] + a_[7])){" + sm_[r_]" if m else ""};
  }}
  }}
}});"""

# ggml's repacked Q4_0 (repack.cpp's q4_0_8x8_q8_0), which llama.cpp runs on every x86 CPU with AVX2 for a Q4_0 matrix
# whose row count is a multiple of 8: eight output rows per statement (`@R@`: the group of 8 over matrix x output row),
# each block's integer dot taken whole per output, and one float accumulator per output, fma(float(dot), d_w * d_x, acc)
# over the blocks in order. GEMV and GEMM tiles compute the same sums, so a row's result does not depend on the rows
# beside it. Each block's 8 rows are unpacked to unsigned nibbles once per tile and transposed (lane i of vector j: row
# i's bytes 4j..4j+3), so one `vpdpbusd` with x's dword j broadcast serves 8 outputs; the nibbles' -8 enters as
# -8 * (x's block sum), the accumulator's start (`@XI@`, from _quantize).
def _transpose8(names: list[str], out: list[str]) -> str:
  """C statements: the 8x8 int32 transpose of v8i `names` into new v8i `out` (unpack 32, unpack 64, then 128-bit halves)."""
  a, lines = names, []
  lo, hi = "0,8,1,9,4,12,5,13", "2,10,3,11,6,14,7,15"
  t = [f"t{i}_" for i in range(8)]
  for k in range(4): lines += [f"const v8i {t[2*k]} = __builtin_shufflevector({a[2*k]}, {a[2*k+1]}, {lo});",
                               f"const v8i {t[2*k+1]} = __builtin_shufflevector({a[2*k]}, {a[2*k+1]}, {hi});"]
  lo64, hi64 = "0,1,8,9,4,5,12,13", "2,3,10,11,6,7,14,15"
  u = [f"u{i}_" for i in range(8)]
  for k, (p, q) in enumerate(((0, 2), (1, 3), (4, 6), (5, 7))):
    lines += [f"const v8i {u[2*k]} = __builtin_shufflevector({t[p]}, {t[q]}, {lo64});",
              f"const v8i {u[2*k+1]} = __builtin_shufflevector({t[p]}, {t[q]}, {hi64});"]
  # u0: rows 0-3 dwords (0,4); u1: (1,5); u2: (2,6); u3: (3,7); u4..u7 the same for rows 4-7
  for j, (p, q) in enumerate(((0, 4), (1, 5), (2, 6), (3, 7))):
    lines += [f"const v8i {out[j]} = __builtin_shufflevector({u[p]}, {u[q]}, 0,1,2,3,8,9,10,11);",
              f"const v8i {out[j+4]} = __builtin_shufflevector({u[p]}, {u[q]}, 4,5,6,7,12,13,14,15);"]
  return "\n      ".join(lines)

def _source_q4_0x8(nb: int, out: int, rows: int, matrix_bytes: int, gathered: bool, x_per_matrix: bool, tiles: int = 1,
                   vnni: bool = False, stride: int = 0, interleaved: bool = False) -> str:
  """The statement for one group of 8 output rows (see above); the other arguments as `_source`'s. `interleaved`: the
  weight's bytes as quant/formats.py's interleave_q4_0 lays them out, whose 32-byte loads are the transposed vectors
  (their nibbles masked and shifted) instead of the file's blocks transposed here."""
  row_bytes, total = nb * 18, stride or rows * tiles
  mat = ("((const int *)@IDX@)[@R@ * 8 / %d]" if gathered else "@R@ * 8 / %d") % out
  xrow = "(@R@ * 8 / %d) * %d" % (out, total) if x_per_matrix else "0"
  T = [f"T{j}_" for j in range(8)]
  if interleaved:  # the group's blocks are 144 bytes apart from o_'s first row on (8 rows x 18 bytes each)
    nib = "(v8i){" + ",".join(["0x0f0f0f0f"] * 8) + "}"
    unpack = "\n      ".join(
      ["const unsigned char *g_ = w_ + b_ * 144L; __builtin_memcpy(&h_, g_, 16);"] +
      [f"v8i V{k}_; __builtin_memcpy(&V{k}_, g_ + {16 + 32 * k}, 32); const v8i {T[k]} = V{k}_ & {nib}, {T[k + 4]} = (V{k}_ >> 4) & {nib};"
       for k in range(4)])
    transpose = ""
  else:
    unpack = "\n      ".join(
      f"v16u r{i}_; __builtin_memcpy(&r{i}_, w_ + {i * row_bytes}L + b_ * 18 + 2, 16); "
      f"const v8i c{i}_ = (v8i)__builtin_shufflevector(r{i}_ & (unsigned char)15, r{i}_ >> 4, {','.join(map(str, range(32)))}); "
      f"__builtin_memcpy(&hs_[{i}], w_ + {i * row_bytes}L + b_ * 18, 2);" for i in range(8))
    unpack = "unsigned short hs_[8];\n      " + unpack + "\n      __builtin_memcpy(&h_, hs_, 16);"
    transpose = _transpose8([f"c{i}_" for i in range(8)], T)
  step = ("s_ = __builtin_ia32_vpdpbusd256(s_, {T}, xb_);" if vnni else
          "s_ = s_ + __builtin_ia32_pmaddwd256(__builtin_ia32_pmaddubsw256((v32c){T}, (v32c)xb_), one_);")
  splat = lambda v, t="v8i": "(%s){" % t + ",".join([v] * 8) + "}"
  dots = "\n        ".join(f"{{ const v8i xb_ = {splat(f'xq_[{j}]')}; {step.format(T=T[j])} }}" for j in range(8))
  return f"""({{ typedef signed char v32c __attribute__((vector_size(32))); typedef unsigned char v16u __attribute__((vector_size(16)));
  typedef short v16s __attribute__((vector_size(32))); typedef int v8i __attribute__((vector_size(32)));
  typedef float v8f __attribute__((vector_size(32))); typedef __fp16 v8h __attribute__((vector_size(16)));
  const int o_ = (@R@ * 8) % {out};
  const unsigned char *w_ = (const unsigned char *)@W@ + (long)({mat}) * {matrix_bytes}L + (long)o_ * {row_bytes};
  const v16s one_ = {{1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1}};
  for (int t_ = 0; t_ < {tiles}; t_++) {{
    const int xr_ = {xrow} + t_ * {rows};
    v8f acc_[{rows}];
    for (int r_ = 0; r_ < {rows}; r_++) acc_[r_] = (v8f){{0,0,0,0,0,0,0,0}};
    for (int b_ = 0; b_ < {nb}; b_++) {{
      v8h h_;
      {unpack}
      {transpose}
      const v8f dw_ = __builtin_convertvector(h_, v8f);
      for (int r_ = 0; r_ < {rows}; r_++) {{
        const long xb_i_ = (long)(xr_ + r_) * {nb} + b_;
        const int *xq_ = (const int *)((const signed char *)@XQ@ + xb_i_ * 32);
        const int x8_ = ((const int *)@XI@)[xb_i_];
        v8i s_ = {splat("x8_")};
        {dots}
        const float dx_ = ((const float *)@XD@)[xb_i_];
        acc_[r_] = __builtin_ia32_vfmaddps256(__builtin_convertvector(s_, v8f), dw_ * {splat("dx_", "v8f")}, acc_[r_]);
      }}
    }}
    for (int r_ = 0; r_ < {rows}; r_++)
      __builtin_memcpy((float *)@OUT@ + (long)(@R@ * 8 / {out}) * {out * total} + (long)(t_ * {rows} + r_) * {out} + o_, &acc_[r_], 32);
  }}
}});"""

# one block of 32 floats (`@R@`: the block) -> its int8 values and its scale, as ggml's quantize_row_q8_0 (AVX2 path)
# computes them and activations._q8_0 states them: amax, the scale rounded to fp16 (F16C's round to nearest even),
# rint(x * 127 / amax) in the default rounding mode (ties to even); for Q8_1 (quantize_row_q8_1) also the block's
# sum, fp16(amax / 127 * sum q)
_QUANTIZE = """({ const float *x_ = (const float *)@X@ + (long)@R@ * 32;
  float amax_ = 0.0f;
  for (int i_ = 0; i_ < 32; i_++) { const float a_ = __builtin_fabsf(x_[i_]); amax_ = a_ > amax_ ? a_ : amax_; }
  const __fp16 h_ = (__fp16)(amax_ / 127.0f);
  ((float *)@XD@)[@R@] = (float)h_;
  const float id_ = amax_ != 0.0f ? 127.0f / amax_ : 0.0f;
  int sum_ = 0;
  for (int i_ = 0; i_ < 32; i_++) {
    const int q_ = (int)__builtin_rintf(x_[i_] * id_);
    ((signed char *)@XQ@)[(long)@R@ * 32 + i_] = (signed char)q_; sum_ += q_;
  }
  @SUM@
});"""

def _quantize(x: Tensor, sums: bool, minus8: bool = False, lanes: bool = False) -> tuple[Tensor, ...]:
  """x `[..., in]` -> (int8 `[..., in/32, 32]`, float32 scales `[..., in/32]`, with `sums` Q8_1's block sums `[..., in/32]`,
  with `minus8` -8 times each block's integer sum, int32 `[..., in/32]`: the start of _source_q4_0x8's block dots, with
  `lanes` -128 times the sums of each 4 values, int32 `[..., in/32, 8]`: the lanes' start of OFFSET's dots), one kernel
  (actquant's rounding as lazy tensor ops is three: the block maxima, the values, the scales)."""
  blocks, nb = prod(x.shape) // 32, x.shape[-1] // 32
  srcs = {"XQ": Tensor.empty(blocks * 32, dtype=dtypes.int8, device=x.device), "XD": Tensor.empty(blocks, dtype=dtypes.float32, device=x.device)}
  if sums: srcs["XS"] = Tensor.empty(blocks, dtype=dtypes.float32, device=x.device)
  if minus8: srcs["XI"] = Tensor.empty(blocks, dtype=dtypes.int32, device=x.device)
  if lanes: srcs["XL"] = Tensor.empty(blocks * 8, dtype=dtypes.int32, device=x.device)
  srcs["X"] = x.float().contiguous().flatten()
  src = _QUANTIZE.replace("@SUM@", ("((float *)@XS@)[@R@] = (float)(__fp16)(amax_ / 127.0f * (float)sum_);" if sums else "") +
                                   ("((int *)@XI@)[@R@] = -8 * sum_;" if minus8 else "") +
                                   ("""for (int l_ = 0; l_ < 8; l_++) { const signed char *q_ = (const signed char *)@XQ@ + (long)@R@ * 32 + 4 * l_;
    ((int *)@XL@)[(long)@R@ * 8 + l_] = -128 * (q_[0] + q_[1] + q_[2] + q_[3]); }""" if lanes else ""))
  body = ckernel.format_string(src, [*srcs, "R"])
  def kernel(*params: UOp) -> UOp:
    r = UOp.range(blocks, 0)
    est = Estimates(ops=3 * blocks * 32, lds=blocks * 32 * 9 + 8 * blocks, mem=blocks * 32 * 5 + 8 * blocks)
    info = KernelInfo(name=f"q8_{int(sums)}_quantize_{blocks}", estimates=est)
    written = {i: r * 32 if n == "XQ" else r * 8 if n == "XL" else r for i, n in enumerate(srcs) if n != "X"}
    return ckernel.statement_kernel(body, params, written, r, (r,), info)
  *outs, _ = Tensor.custom_kernel(*srcs.values(), fxn=kernel)
  return tuple(o.reshape(*x.shape[:-1], nb, *{"XQ": (32,), "XL": (8,)}.get(n, ())) for n, o in zip(srcs, outs))

def linear(x: Tensor, w, live: Tensor | None = None) -> Tensor:
  """`x @ w.T` for `applies(x, w)`, float32: w `[out, in]` and x `[..., in]` (every leading axis rows) -> `[..., out]`;
  w `[*lead, out, in]` and x `[*lead', R, in]` (lead' broadcasts to lead) -> `[*lead, R, out]`. `live` (a gathered w:
  one int per matrix, shape `lead`): how many of its R rows of x that matrix takes, 0..R; its outputs past them are 0
  and cost nothing (nn/moe.py's expert tiles: the rows its expert's pairs fill, none in the tiles that only pad the
  count), so a tile costs one unpack of each weight block plus a dot per row it holds."""
  fmt, (out, k), lead = w.qtype.name, w.shape[-2:], w.shape[:-2]
  q8k = fmt in intdot_k.FORMATS                                              # x rounded to Q8_K blocks of 256 (intdot_k)
  block, block_bytes = (intdot_k.BLOCK, intdot_k.FORMATS[fmt]) if q8k else (32, FORMATS[fmt])
  nb, L = k // block, prod(lead)
  shape = (*x.shape[:-1], out)
  if not lead: x = x.reshape(-1, k)                                           # [R, in]
  R = x.shape[-2]
  x8 = repacked(w)                                                           # ggml's repacked Q4_0 (_source_q4_0x8)
  # [..., R, nb, block] int8; [..., R, nb] scales (, sums: Q8_1's [..., R, nb], Q8_K's [..., R, nb, 16])
  vnni = settings.current(str(w.device)).caps.int_dot_vnni
  lanes = vnni and fmt in OFFSET and not x8
  xq, *xs = intdot_k.quantize(x) if q8k else _quantize(x, fmt in MINIMUM, x8, lanes)
  if q8k and fmt not in intdot_k.BSUMS: xs = xs[:1]
  x_per_matrix = x.ndim > 2 and prod(x.shape[:-2]) > 1
  if x_per_matrix and tuple(x.shape[:-2]) != tuple(lead):                  # x broadcast over the matrices: copied out
    pad = (1,) * (len(lead) + 2 - x.ndim)
    xq, *xs = [t.reshape(*pad, *t.shape).expand(*lead, *t.shape[x.ndim - 2:]).contiguous() for t in (xq, *xs)]
  xq_rows = (L if x_per_matrix else 1) * R
  base, idx = w._src
  interleaved = x8 and w.x8 is not None                                      # quant/formats.py's interleave_q4_0
  if interleaved: base = w.x8
  first = _first_row(w)                                                      # a block of rows read in place
  gathered = bool(idx) and first is None
  srcs = {"OUT": Tensor.empty(L * R * out, dtype=dtypes.float32, device=w.device), "W": base.flatten(), "XQ": xq.flatten(), "XD": xs[0].flatten()}
  if len(xs) > 1: srcs["XB" if q8k else "XI" if x8 else "XL" if lanes else "XS"] = xs[1].flatten()
  if gathered: srcs["IDX"] = idx[0].cast(dtypes.int32).contiguous().flatten()
  if live is not None: srcs["LIVE"] = live.cast(dtypes.int32).contiguous().flatten()
  names = [*srcs, "R"]
  matrix_bytes = out * nb * block_bytes
  rows, tiles = (R, 1) if R <= MAX_ROWS else (MAX_ROWS, R // MAX_ROWS)    # a chunk: tiles of MAX_ROWS rows
  source = (functools.partial(intdot_k.source, fmt) if q8k else functools.partial(_source_q4_0x8, interleaved=interleaved) if x8 else
            functools.partial(_source, fmt))
  per = 8 if x8 else 1                                                       # output rows per statement
  if live is None: src = source(nb, out, rows, matrix_bytes, gathered, x_per_matrix, tiles, vnni)
  else:  # counted rows: the statement for its matrix's count of rows (each a loop of constant length), the rest zeros
    def zero(r: int) -> str:
      return (f"__builtin_memset((float *)@OUT@ + (long)(@R@ * 8 / {out}) * {out * R} + {r * out}L + (@R@ * 8) % {out}, 0, 32);" if x8 else
              f"((float *)@OUT@)[(long)(@R@ / {out}) * {out * R} + {r * out}L + @R@ % {out}] = 0.0f;")
    cases = "".join(f"case {n}: {source(nb, out, n, matrix_bytes, gathered, x_per_matrix, 1, vnni, stride=R)} "
                    f"{''.join(zero(r) for r in range(n, R))} break;\n  " for n in range(1, R + 1))
    src = f"switch (((const int *)@LIVE@)[@R@ * {per} / {out}]) {{\n  {cases}default: {''.join(zero(r) for r in range(R))} }}"
  if first:  # every source starts its weight pointer from @W@ once: moved to the block's first row (rows are nb blocks)
    assert src.count(W := "(const unsigned char *)@W@") == 1
    src = src.replace(W, f"({W} + {first * nb * block_bytes}L)")
  body = ckernel.format_string(src, names)
  n = L * out // per
  threads = ckernel.threads(str(w.device), n)
  def kernel(*params: UOp) -> UOp:
    # the rows split over the threads by hand (a THREAD range outermost): tinygrad's opts pass would rebuild the
    # kernel's info without the estimates below, and it has nothing else to do here
    t, i = UOp.range(threads, 0, AxisType.THREAD), UOp.range(n // threads, 1)
    # counted rows: the statements dealt out in turn, as the tiles that hold pairs come first and the empty ones last
    S = out // per                                                           # statements per matrix
    # counted rows: whole matrices dealt out to the threads in turn (the tiles that hold pairs come first, the empty
    # ones last); statements dealt one by one would write neighbouring floats of one output row from both threads
    r = ((i // S) * threads + t) * S + i % S if live is not None and L % threads == 0 else t * (n // threads) + i
    # what tinygrad cannot count in a C statement: the weight rows read once, x's int8 blocks and scales, the outputs
    xb = block + 4 + (32 if q8k else 0)                                      # x's bytes per block: values, scale (, Q8_K's sums)
    est = Estimates(ops=2 * L * R * out * k, lds=L * out * (tiles * nb * block_bytes + R * nb * xb) + 4 * L * R * out,
                    mem=L * out * nb * block_bytes + xq_rows * nb * xb + 4 * L * R * out)
    info = KernelInfo(name=f"{fmt.lower()}_intdot_{L}_{R}_{out}_{k}", estimates=est)
    return ckernel.statement_kernel(body, params, {0: (r * per) // out * (out * R) + (r * per) % out}, r, (i, t), info)
  y = Tensor.custom_kernel(*srcs.values(), fxn=kernel)[0]
  return y.reshape(*lead, R, out) if lead else y.reshape(shape)
