"""MLA's attention over the latent cache as one C kernel on the CPU (nn/mla.py): scores, softmax and attn·v of a decode
step or a prefill chunk in one pass over the cache rows, flash-attention style.

tinygrad renders the three as separate kernels over the symbolic count of cache rows, and the attn·v one of a chunk as
one scalar chain per (query, latent column): at a few thousand cached positions the attention cost more than every
weight of the step. Here each statement owns a block of query rows (the heads of one token, token-major) and walks the
cache rows in blocks: the block's scores as register tiles of rows by keys (each key vector loaded once for the rows),
then per row the running maximum, the block's probabilities and the rescaled sums, then the block's values added into
the rows' accumulators, a pair of vectors of latent columns at a time for all rows. Rows are split over the threads; a
row's result does not depend on which other rows run with it.

The arithmetic is the attention's, in another order: scores `q·k * scale` (k the cached `[latent ; rope]` row), each
row's softmax kept as a running maximum and sum (exp by a Cephes polynomial, within 2 ulp of expf), the output the
probability-weighted sum of the keys' latent parts divided by the sum. A chunk's query at token t sees the cache rows up
to start_pos + t (the causal mask). The start position and the cache slot may be symbolic (a captured step's variables:
the kernel takes them as parameters)."""
from __future__ import annotations

from tinygrad import Tensor, dtypes

from tg_ds4.backend.compat import AxisType, Estimates, KernelInfo, UOp
from tg_ds4.quant import ckernel

KEYS_PER_BLOCK = 64  # cache rows per softmax block: the block's scores and probabilities stay in L1

def applies(D: int, L: int, cache: Tensor, unit: tuple[int, int] | None) -> bool:
  """Whether the CPU's vector `unit` (float lanes, registers; None: no such kernel on this device) tiles D-wide float32
  cache rows whose first L columns are the values."""
  return unit is not None and cache.dtype == dtypes.float32 and D % unit[0] == 0 and L % (2 * unit[0]) == 0

def _rows(H: int, registers: int) -> int:
  """Query rows per statement: heads of one token, as many as half the vector registers hold two vectors of each for
  (8 with AVX-512's 32 registers, 4 with AVX2's 16), fewer where H is not a multiple."""
  most = 8 if registers >= 32 else 4
  return next(r for r in (most, 4, 2, 1) if r <= most and H % r == 0)

def _hsum(v: str, floats: int) -> str:
  """A C expression: the sum of vector `v`'s lanes, halves added pairwise."""
  expr, n = v, floats
  while n > 1:
    n //= 2
    lo, hi = ", ".join(str(i) for i in range(n)), ", ".join(str(i + n) for i in range(n))
    expr = f"(__builtin_shufflevector({expr}, {expr}, {lo}) + __builtin_shufflevector({expr}, {expr}, {hi}))"
  return expr

def _source(H: int, L: int, D: int, max_ctx: int, scale: float, unit: tuple[int, int]) -> str:
  """Statement `@R@`: query rows [@R@ * RB, @R@ * RB + RB) of `[T, H, D]` Q (token @R@ / (H / RB)) over cache slot
  @SLOT@'s rows [0, @POS@ + t + 1) -> the same rows of `[T, H, L]` OUT."""
  (W, registers), RB, KB = unit, _rows(H, unit[1]), KEYS_PER_BLOCK
  KS = 4 if registers >= 32 else 2       # keys per score tile (RS rows by KS keys of accumulators)
  RS = min(4, RB)
  sc = f"{float(scale).hex()}f"  # a hex literal: the float32 nearest the scale, as tinygrad's cast of it

  def tile(keys: int) -> str:
    acc = "".join(f"v_ a{i}_{k} = zero_;" for i in range(RS) for k in range(keys))
    loads = "".join(f"const v_ k{k} = *(const v_ *)(c_ + (long)(j0_ + kk_ + {k}) * {D} + d_);" for k in range(keys)) + \
      "".join(f"const v_ q{i} = *(const v_ *)(q_ + (long)(r0_ + {i}) * {D} + d_);" for i in range(RS))
    fma = "".join(f"a{i}_{k} = a{i}_{k} + q{i} * k{k};" for i in range(RS) for k in range(keys))
    out = "".join(f"s_[r0_ + {i}][kk_ + {k}] = {_hsum(f'a{i}_{k}', W)} * {sc};" for i in range(RS) for k in range(keys))
    return f"for (int r0_ = 0; r0_ < {RB}; r0_ += {RS}) {{ {acc} for (int d_ = 0; d_ < {D}; d_ += {W}) {{ {loads} {fma} }} {out} }}"

  vals_acc = "".join(f"v_ o{i}_{v} = *(v_ *)(&acc_[{i}][c_l + {v * W}]) * corr_[{i}];" for i in range(RB) for v in range(2))
  vals_load = "".join(f"const v_ x{v} = *(const v_ *)(c_ + (long)(j0_ + kk_) * {D} + c_l + {v * W});" for v in range(2))
  vals_fma = "".join(f"o{i}_{v} = o{i}_{v} + s_[{i}][kk_] * x{v};" for i in range(RB) for v in range(2))
  vals_store = "".join(f"*(v_ *)(&acc_[{i}][c_l + {v * W}]) = o{i}_{v};" for i in range(RB) for v in range(2))
  # Cephes' expf: e^x = 2^k e^y, k = round(x log2 e), y = x - k ln 2 in two parts, e^y a degree-7 polynomial; below -87
  # (an empty key slot's -inf) zero
  exp = ("x_ = __builtin_elementwise_max(x_, lo_);"
         "const v_ k_ = __builtin_elementwise_floor(x_ * 1.44269504088896341f + 0.5f);"
         "v_ y_ = x_ - k_ * 0.693359375f; y_ = y_ + k_ * 2.12194440e-4f; const v_ z_ = y_ * y_;"
         "v_ p_ = (((((1.9875691500e-4f * y_ + 1.3981999507e-3f) * y_ + 8.3334519073e-3f) * y_ + 4.1665795894e-2f) * y_"
         " + 1.6666665459e-1f) * y_ + 5.0000001201e-1f) * z_ + y_ + 1.0f;"
         "const vi_ e_ = (__builtin_convertvector(k_, vi_) + 127) << 23; v_ f_; __builtin_memcpy(&f_, &e_, sizeof(f_));"
         "p_ = p_ * f_; const vi_ keep_ = x_ > lo_; vi_ pb_; __builtin_memcpy(&pb_, &p_, sizeof(p_)); pb_ = pb_ & keep_;"
         "__builtin_memcpy(&p_, &pb_, sizeof(p_));")
  return f"""({{ typedef float v_ __attribute__((vector_size({4 * W}), aligned(4)));
  typedef int vi_ __attribute__((vector_size({4 * W}), aligned(4)));
  const v_ zero_ = {{0}}, lo_ = zero_ - 87.0f;
  const int t_ = @R@ / {H // RB}, h0_ = (@R@ % {H // RB}) * {RB};
  const int n_ = (int)@POS@ + t_ + 1;
  const float *q_ = (const float *)@Q@ + ((long)t_ * {H} + h0_) * {D};
  const float *c_ = (const float *)@C@ + (long)@SLOT@ * {max_ctx} * {D};
  float m_[{RB}], l_[{RB}], corr_[{RB}], s_[{RB}][{KB}] __attribute__((aligned(64)));
  float acc_[{RB}][{L}] __attribute__((aligned(64)));
  for (int i_ = 0; i_ < {RB}; i_++) {{ m_[i_] = -__builtin_inff(); l_[i_] = 0.0f; for (int c_l = 0; c_l < {L}; c_l++) acc_[i_][c_l] = 0.0f; }}
  for (int j0_ = 0; j0_ < n_; j0_ += {KB}) {{
    const int nb_ = n_ - j0_ < {KB} ? n_ - j0_ : {KB};
    int kk_ = 0;
    for (; kk_ + {KS} <= nb_; kk_ += {KS}) {{ {tile(KS)} }}
    for (; kk_ < nb_; kk_++) {{ {tile(1)} }}
    for (int i_ = 0; i_ < {RB}; i_++) {{
      for (kk_ = nb_; kk_ < {KB}; kk_++) s_[i_][kk_] = -__builtin_inff();
      v_ mv_ = *(const v_ *)&s_[i_][0];
      for (kk_ = {W}; kk_ < {KB}; kk_ += {W}) mv_ = __builtin_elementwise_max(mv_, *(const v_ *)&s_[i_][kk_]);
      float mx_ = __builtin_reduce_max(mv_); mx_ = mx_ > m_[i_] ? mx_ : m_[i_];
      v_ sv_ = zero_;
      for (kk_ = 0; kk_ < {KB}; kk_ += {W}) {{ v_ x_ = *(const v_ *)&s_[i_][kk_] - mx_; {exp} *(v_ *)&s_[i_][kk_] = p_; sv_ = sv_ + p_; }}
      {{ v_ x_ = zero_ + (m_[i_] - mx_); {exp} corr_[i_] = p_[0]; }}
      l_[i_] = l_[i_] * corr_[i_] + {_hsum("sv_", W)}; m_[i_] = mx_;
    }}
    for (int c_l = 0; c_l < {L}; c_l += {2 * W}) {{
      {vals_acc}
      for (kk_ = 0; kk_ < nb_; kk_++) {{ {vals_load} {vals_fma} }}
      {vals_store}
    }}
  }}
  float *o_ = (float *)@OUT@ + ((long)t_ * {H} + h0_) * {L};
  for (int i_ = 0; i_ < {RB}; i_++) {{
    const float inv_ = 1.0f / l_[i_]; for (int c_l = 0; c_l < {L}; c_l++) o_[i_ * {L} + c_l] = acc_[i_][c_l] * inv_; }}
}});"""

def attention(q: Tensor, cache: Tensor, slot: int | UOp, start_pos: int | UOp, L: int, scale: float, unit: tuple[int, int]) -> Tensor:
  """q `[T, H, D]` (token t at position start_pos + t) over rows [0, start_pos + t + 1) of `cache` `[slots, max_ctx, D]`
  slot `slot` -> `[T, H, L]`: softmax(q k^T * scale) @ k[:, :L] per row, float32 (see the module docstring)."""
  (T, H, D), max_ctx = q.shape, cache.shape[1]
  RB = _rows(H, unit[1])
  count = T * H // RB
  srcs = {"OUT": Tensor.empty(T * H * L, dtype=dtypes.float32, device=q.device), "Q": q.float().contiguous().flatten(),
          "C": cache.flatten()}
  scalars = {"POS": start_pos, "SLOT": slot}
  body = ckernel.format_string(_source(H, L, D, max_ctx, scale, unit), [*srcs, *scalars, "R"])
  threads = ckernel.threads(str(q.device), count)
  def kernel(*params: UOp) -> UOp:
    bufs, vals = params[:len(srcs)], params[len(srcs):]
    t, i = UOp.range(threads, 0, AxisType.THREAD), UOp.range(count // threads, 1)
    r = t * (count // threads) + i
    rows = vals[0] + T  # cache rows the last token sees (the kernel's position parameter: symbolic in a captured step)
    est = Estimates(ops=2 * H * T * rows * (D + L), lds=4 * (count * rows * D + T * H * D), mem=4 * (rows * D + T * H * (D + L)))
    info = KernelInfo(name=f"mla_attention_{T}_{H}_{D}", estimates=est)
    return ckernel.statement_kernel(body, bufs, {0: r * RB * L}, r, (i, t), info, scalars=vals)
  return ckernel.call(kernel, list(srcs.values()), list(scalars.values()))[0].reshape(T, H, L)
