"""Attention over a KV cache as one C kernel on the CPU: scores, softmax and attn·v of a decode step or a prefill chunk
in one pass over the cache rows, flash-attention style. MLA's latent cache (nn/mla.py: one row per position, its first
columns the values) and GQA's K/V cache (nn/gqa.py: per position and KV head a key then a value) are the same walk with
other offsets. DeepSeek V4's keys (models/deepseek4.py: compressed rows, then a ring of raw rows, which are also the
values) are the same walk over two segments, which key each query sees computed from the position (and the indexer's
stored choice) per block of keys, and a per-head sink logit in the softmax (`attention_sinks`).

tinygrad renders the three as separate kernels over the symbolic count of cache rows, and a chunk's attn·v as one
scalar chain per (query, value column): at a few thousand cached positions the attention cost more than every weight
of the step. Here each statement owns a block of query rows (heads of one token that share a KV head) and walks the
cache rows in blocks: the block's scores as register tiles of rows by keys (each key vector loaded once for the rows),
then per row the running maximum, the block's probabilities and the rescaled sums, then the block's values added into
the rows' accumulators, a pair of vectors of value columns at a time for all rows. Rows are split over the threads; a
row's result does not depend on which other rows run with it.

The arithmetic is the attention's, in another order: scores `q·k * scale`, each row's softmax kept as a running maximum
and sum (exp by Cephes' expf polynomial), the output the probability-weighted sum of the values divided by the sum. A
chunk's query at token t sees the cache rows up to start_pos + t (the causal mask), and with a sliding window only the
last `window` of them. The start position and the cache slot may be symbolic (a captured step's variables: the kernel
takes them as parameters)."""
from __future__ import annotations

from dataclasses import dataclass

from tinygrad import Tensor, dtypes

from tg_ds4.backend.compat import AxisType, Estimates, KernelInfo, UOp
from tg_ds4.quant import ckernel

KEYS_PER_BLOCK = 64  # cache rows per softmax block: the block's scores and probabilities stay in L1

@dataclass(frozen=True)
class Layout:
  """Where a cache row `[slots, max_ctx, kv_heads * head]` holds each KV head's key and value (floats): KV head g's key
  is `key_dim` floats from g * head, its value `value_dim` floats from g * head + value_offset."""
  kv_heads: int
  key_dim: int
  value_dim: int
  value_offset: int
  head: int

  @staticmethod
  def latent(width: int, values: int) -> Layout:
    """MLA's: one row of `width` per position serving as every head's key, its first `values` columns the value."""
    return Layout(1, width, values, 0, width)

  @staticmethod
  def kv(kv_heads: int, key_dim: int, value_dim: int) -> Layout:
    """GQA's: per KV head a key of key_dim then a value of value_dim."""
    return Layout(kv_heads, key_dim, value_dim, key_dim, key_dim + value_dim)

def applies(layout: Layout, heads: int, cache: Tensor, unit: tuple[int, int] | None) -> bool:
  """Whether the CPU's vector `unit` (float lanes, registers; None: no such kernel on this device) tiles `heads` query
  heads over a float32 cache of this layout."""
  return unit is not None and cache.dtype == dtypes.float32 and heads % layout.kv_heads == 0 and layout.key_dim % unit[0] == 0 \
    and layout.value_dim % (2 * unit[0]) == 0

def _rows(group: int, registers: int) -> int:
  """Query rows per statement: heads of one token sharing a KV head, as many as half the vector registers hold two
  vectors of each for (8 with AVX-512's 32 registers, 4 with AVX2's 16), fewer where the group is not a multiple."""
  most = 8 if registers >= 32 else 4
  return max(r for r in range(1, most + 1) if group % r == 0)

def _hsum(v: str, floats: int) -> str:
  """A C expression: the sum of vector `v`'s lanes, halves added pairwise."""
  expr, n = v, floats
  while n > 1:
    n //= 2
    lo, hi = ", ".join(str(i) for i in range(n)), ", ".join(str(i + n) for i in range(n))
    expr = f"(__builtin_shufflevector({expr}, {expr}, {lo}) + __builtin_shufflevector({expr}, {expr}, {hi}))"
  return expr

# Cephes' expf on a vector x_ -> p_: e^x = 2^k e^y, k = round(x log2 e), y = x - k ln 2 in two parts, e^y a degree-7
# polynomial; at or below -87 (a masked key's -inf) zero
_EXP = ("x_ = __builtin_elementwise_max(x_, lo_);"
        "const v_ k_ = __builtin_elementwise_floor(x_ * 1.44269504088896341f + 0.5f);"
        "v_ y_ = x_ - k_ * 0.693359375f; y_ = y_ + k_ * 2.12194440e-4f; const v_ z_ = y_ * y_;"
        "v_ p_ = (((((1.9875691500e-4f * y_ + 1.3981999507e-3f) * y_ + 8.3334519073e-3f) * y_ + 4.1665795894e-2f) * y_"
        " + 1.6666665459e-1f) * y_ + 5.0000001201e-1f) * z_ + y_ + 1.0f;"
        "const vi_ e_ = (__builtin_convertvector(k_, vi_) + 127) << 23; v_ f_; __builtin_memcpy(&f_, &e_, sizeof(f_));"
        "p_ = p_ * f_; const vi_ keep_ = x_ > lo_; vi_ pb_; __builtin_memcpy(&pb_, &p_, sizeof(p_)); pb_ = pb_ & keep_;"
        "__builtin_memcpy(&p_, &pb_, sizeof(p_));")

def _score_tile(keys: int, groups: list[tuple[int, int]], D: int, W: int, row: str, sc: str) -> str:
  """C: scores `s_[r][kk_ + k]` of the statement's query rows (`groups` of up to 4 rows: (first, count)) against the
  `keys` key rows from row j0_ + kk_ of `c_` (rows `row` floats apart), as register tiles of rows by keys."""
  out = []
  for r0, rs in groups:
    acc = "".join(f"v_ a{i}_{k} = zero_;" for i in range(rs) for k in range(keys))
    loads = "".join(f"const v_ k{k} = *(const v_ *)(c_ + (long)(j0_ + kk_ + {k}) * {row} + d_);" for k in range(keys)) + \
      "".join(f"const v_ q{i} = *(const v_ *)(q_ + {(r0 + i) * D} + d_);" for i in range(rs))
    fma = "".join(f"a{i}_{k} = a{i}_{k} + q{i} * k{k};" for i in range(rs) for k in range(keys))
    res = "".join(f"s_[{r0 + i}][kk_ + {k}] = {_hsum(f'a{i}_{k}', W)} * {sc};" for i in range(rs) for k in range(keys))
    out.append(f"{{ {acc} for (int d_ = 0; d_ < {D}; d_ += {W}) {{ {loads} {fma} }} {res} }}")
  return " ".join(out)

def _block(RB: int, D: int, Dv: int, W: int, registers: int, row: str, value_offset: int, scale: float, masked: bool) -> str:
  """C: one block of up to KEYS_PER_BLOCK key rows from j0_ (nb_ of them) of `c_` taken into the online softmax of the
  statement's RB query rows: scores, (`masked`: `vis_[kk_]` 0 hides key kk_), the block's maximum and probabilities,
  the running sums rescaled, the values added."""
  KB, KS = KEYS_PER_BLOCK, 4 if registers >= 32 else 2   # keys per score tile (up to 4 rows by KS keys of accumulators)
  groups = [(r, min(4, RB - r)) for r in range(0, RB, 4)]
  sc = f"{float(scale).hex()}f"  # a hex literal: the float32 nearest the scale, as tinygrad's cast of it
  vals_acc = "".join(f"v_ o{i}_{v} = *(v_ *)(&acc_[{i}][c_l + {v * W}]) * corr_[{i}];" for i in range(RB) for v in range(2))
  vals_load = "".join(f"const v_ x{v} = *(const v_ *)(c_ + (long)(j0_ + kk_) * {row} + {value_offset} + c_l + {v * W});"
                      for v in range(2))
  vals_fma = "".join(f"o{i}_{v} = o{i}_{v} + s_[{i}][kk_] * x{v};" for i in range(RB) for v in range(2))
  vals_store = "".join(f"*(v_ *)(&acc_[{i}][c_l + {v * W}]) = o{i}_{v};" for i in range(RB) for v in range(2))
  hide = "for (kk_ = 0; kk_ < nb_; kk_++) if (!vis_[kk_]) s_[i_][kk_] = -__builtin_inff();" if masked else ""
  return f"""int kk_ = 0;
    for (; kk_ + {KS} <= nb_; kk_ += {KS}) {{ {_score_tile(KS, groups, D, W, row, sc)} }}
    for (; kk_ < nb_; kk_++) {{ {_score_tile(1, groups, D, W, row, sc)} }}
    for (int i_ = 0; i_ < {RB}; i_++) {{
      {hide}
      for (kk_ = nb_; kk_ < {KB}; kk_++) s_[i_][kk_] = -__builtin_inff();
      v_ mv_ = *(const v_ *)&s_[i_][0];
      for (kk_ = {W}; kk_ < {KB}; kk_ += {W}) mv_ = __builtin_elementwise_max(mv_, *(const v_ *)&s_[i_][kk_]);
      float mx_ = __builtin_reduce_max(mv_); mx_ = mx_ > m_[i_] ? mx_ : m_[i_];
      v_ sv_ = zero_;
      for (kk_ = 0; kk_ < {KB}; kk_ += {W}) {{ v_ x_ = *(const v_ *)&s_[i_][kk_] - mx_; {_EXP} *(v_ *)&s_[i_][kk_] = p_; sv_ = sv_ + p_; }}
      {{ v_ x_ = zero_ + (m_[i_] - mx_); {_EXP} corr_[i_] = p_[0]; }}
      l_[i_] = l_[i_] * corr_[i_] + {_hsum("sv_", W)}; m_[i_] = mx_;
    }}
    for (int c_l = 0; c_l < {Dv}; c_l += {2 * W}) {{
      {vals_acc}
      for (kk_ = 0; kk_ < nb_; kk_++) {{ {vals_load} {vals_fma} }}
      {vals_store}
    }}"""

def _head(W: int, RB: int, Dv: int, KB: int) -> str:
  return f"""typedef float v_ __attribute__((vector_size({4 * W}), aligned(4)));
  typedef int vi_ __attribute__((vector_size({4 * W}), aligned(4)));
  const v_ zero_ = {{0}}, lo_ = zero_ - 87.0f;
  float m_[{RB}], l_[{RB}], corr_[{RB}], s_[{RB}][{KB}] __attribute__((aligned(64)));
  float acc_[{RB}][{Dv}] __attribute__((aligned(64)));"""

def _store(H: int, RB: int, Dv: int) -> str:
  return f"""float *o_ = (float *)@OUT@ + ((long)t_ * {H} + h0_) * {Dv};
  for (int i_ = 0; i_ < {RB}; i_++) {{
    const float inv_ = 1.0f / l_[i_]; for (int c_l = 0; c_l < {Dv}; c_l++) o_[i_ * {Dv} + c_l] = acc_[i_][c_l] * inv_; }}"""

def _source(H: int, lay: Layout, max_ctx: int, scale: float, window: int, unit: tuple[int, int], count: int) -> str:
  """Statement `@R@` (of `count`; none past them): query rows [h0, h0 + RB) of token t of `[T, H, key_dim]` Q over cache
  slot @SLOT@'s rows up to @POS@ + t (the last `window` of them where a window is set) -> the same rows of `[T, H,
  value_dim]` OUT."""
  (W, registers), G = unit, H // lay.kv_heads
  RB, KB, D, Dv, row = _rows(G, registers), KEYS_PER_BLOCK, lay.key_dim, lay.value_dim, lay.kv_heads * lay.head
  first = f"n_ > {window} ? n_ - {window} : 0" if window else "0"
  return f"""if (@R@ < {count}) ({{ {_head(W, RB, Dv, KB)}
  const int t_ = @R@ / {H // RB}, g_ = (@R@ % {H // RB}) / {G // RB}, h0_ = (@R@ % {H // RB}) * {RB};
  const int n_ = (int)@POS@ + t_ + 1, start_ = {first};
  const float *q_ = (const float *)@Q@ + ((long)t_ * {H} + h0_) * {D};
  const float *c_ = (const float *)@C@ + (long)@SLOT@ * {max_ctx} * {row} + (long)g_ * {lay.head};
  for (int i_ = 0; i_ < {RB}; i_++) {{ m_[i_] = -__builtin_inff(); l_[i_] = 0.0f; for (int c_l = 0; c_l < {Dv}; c_l++) acc_[i_][c_l] = 0.0f; }}
  for (int j0_ = start_; j0_ < n_; j0_ += {KB}) {{
    const int nb_ = n_ - j0_ < {KB} ? n_ - j0_ : {KB};
    {_block(RB, D, Dv, W, registers, str(row), lay.value_offset, scale, False)}
  }}
  {_store(H, RB, Dv)}
}});"""

def attention(q: Tensor, cache: Tensor, slot: int | UOp, start_pos: int | UOp, layout: Layout, scale: float, unit: tuple[int, int],
              window: int = 0) -> Tensor:
  """q `[T, H, key_dim]` (token t at position start_pos + t; heads grouped by the KV head they share, in order) over rows
  [0, start_pos + t + 1) of slot `slot` of `cache` `[slots, max_ctx, ...]` laid out as `layout` (with `window` only the
  last `window` of them) -> `[T, H, value_dim]`: softmax(q k^T * scale) @ v per row, float32 (see the module docstring)."""
  (T, H, _), max_ctx = q.shape, cache.shape[1]
  RB = _rows(H // layout.kv_heads, unit[1])
  count = T * H // RB
  # a decode step has few statements (2-4 for 16 heads): spread over all the threads even where they do not divide them,
  # the output padded for the statements past the last that do nothing
  threads, per = ckernel.uneven_threads(str(q.device), count)
  srcs = {"OUT": Tensor.empty(threads * per * RB * layout.value_dim, dtype=dtypes.float32, device=q.device),
          "Q": q.float().contiguous().flatten(), "C": cache.flatten()}
  scalars = {"POS": start_pos, "SLOT": slot}
  body = ckernel.format_string(_source(H, layout, max_ctx, scale, window, unit, count), [*srcs, *scalars, "R"])
  def kernel(*params: UOp) -> UOp:
    bufs, vals = params[:len(srcs)], params[len(srcs):]
    t, i = UOp.range(threads, 0, AxisType.THREAD), UOp.range(per, 1)
    r = t * per + i
    rows = vals[0] + T if not window else min(window, max_ctx)  # cache rows the last token sees (symbolic in a captured step)
    D, Dv, row = layout.key_dim, layout.value_dim, layout.kv_heads * layout.head
    est = Estimates(ops=2 * H * T * rows * (D + Dv), lds=4 * (count * rows * (D + Dv) + T * H * (D + Dv)),
                    mem=4 * (rows * row + T * H * (D + Dv)))
    info = KernelInfo(name=f"attention_{T}_{H}_{D}", estimates=est)
    return ckernel.statement_kernel(body, bufs, {0: r * RB * layout.value_dim}, r, (i, t), info, scalars=vals)
  return ckernel.call(kernel, list(srcs.values()), list(scalars.values()))[0][:T * H * layout.value_dim].reshape(T, H, layout.value_dim)

@dataclass(frozen=True)
class SinkKeys:
  """DeepSeek V4's attention keys (models/deepseek4.py), which are also its values: the compressed rows `[0, n)` of a
  static cache, n = start_pos // ratio + candidates, then every slot of the raw ring (`slots` rows of `ring_row`
  floats, position p in slot p % slots). A query at position q sees a compressed row j once its window is complete,
  (j + 1) * ratio <= q + 1 (with `selected`: and where the indexer chose it), and a raw slot holding a position in
  (q - window, q]. The softmax has a per-head sink logit: a denominator term with no value."""
  ratio: int        # 0: no compressed rows
  candidates: int   # compressed rows past start_pos // ratio that a chunk writes
  slots: int
  ring_row: int
  window: int
  selected: bool

def _sink_source(H: int, T: int, D: int, keys: SinkKeys, max_rows: int, chunk: int, scale: float, unit: tuple[int, int], count: int,
                 sel_row: int = 0) -> str:
  """Statement `@R@` (of `count`): query rows [h0, h0 + RB) of token t of `[T, H, D]` Q over the keys of `keys` (the
  compressed rows @ROWS@, the raw ring @RAW@, the indexer's choice @SEL@ `[chunk, max_rows]` from its row `sel_row`,
  each of cache slot @SLOT@) -> the same rows of `[T, H, D]` OUT. A block of keys the token sees none of is skipped:
  taken in, it would leave the sums as they are."""
  (W, registers), KB, k = unit, KEYS_PER_BLOCK, keys
  RB = _rows(H, registers)
  seen = f"(j_ + 1) * {k.ratio} <= qpos_ + 1" + (f" && sel_[(long)t_ * {max_rows} + j_]" if k.selected else "")
  held = f"last_ - ((last_ % {k.slots} + {k.slots} - j_) % {k.slots})"
  sel_off = f" + {sel_row * max_rows}" if sel_row else ""
  return f"""if (@R@ < {count}) ({{ {_head(W, RB, D, KB)}
  unsigned char vis_[{KB}];
  const int t_ = @R@ / {H // RB}, h0_ = (@R@ % {H // RB}) * {RB};
  const int qpos_ = (int)@POS@ + t_, last_ = (int)@POS@ + {T - 1};
  const float *q_ = (const float *)@Q@ + ((long)t_ * {H} + h0_) * {D};
  const float *raw_ = (const float *)@RAW@ + (long)@SLOT@ * {k.slots * k.ring_row};
  const float *rows_ = {f"(const float *)@ROWS@ + (long)@SLOT@ * {max_rows * D}" if k.ratio else "raw_"};
  {f"const unsigned char *sel_ = (const unsigned char *)@SEL@ + (long)@SLOT@ * {chunk * max_rows}{sel_off};" if k.selected else ""}
  for (int i_ = 0; i_ < {RB}; i_++) {{       /* the sink as the first term: its logit the maximum so far, e^0 the sum */
    m_[i_] = ((const float *)@SINK@)[h0_ + i_]; l_[i_] = 1.0f; for (int c_l = 0; c_l < {D}; c_l++) acc_[i_][c_l] = 0.0f; }}
  for (int seg_ = {0 if k.ratio else 1}; seg_ < 2; seg_++) {{
    const float *c_ = seg_ ? raw_ : rows_;
    const int row_ = seg_ ? {k.ring_row} : {D}, n_ = seg_ ? {k.slots} : {f"(int)@POS@ / {k.ratio} + {k.candidates}" if k.ratio else 0};
    for (int j0_ = 0; j0_ < n_; j0_ += {KB}) {{
      const int nb_ = n_ - j0_ < {KB} ? n_ - j0_ : {KB};
      int any_ = 0;
      for (int kk_ = 0; kk_ < nb_; kk_++) {{
        const int j_ = j0_ + kk_;
        if (seg_) {{ const int p_ = {held}; vis_[kk_] = p_ >= 0 && p_ <= qpos_ && p_ > qpos_ - {k.window}; }}
        else vis_[kk_] = {seen if k.ratio else 0};
        any_ |= vis_[kk_];
      }}
      if (!any_) continue;
      {_block(RB, D, D, W, registers, "row_", 0, scale, True)}
    }}
  }}
  {_store(H, RB, D)}
}});"""

def sink_applies(q: Tensor, raw: Tensor, rows: Tensor | None, unit: tuple[int, int] | None, slot, start_pos) -> bool:
  """Whether `attention_sinks` takes these: a vector unit, float32 keys whose width it tiles, an int or variable slot
  and position."""
  return unit is not None and raw.dtype == dtypes.float32 and (rows is None or rows.dtype == dtypes.float32) and \
    q.shape[-1] % (2 * unit[0]) == 0 and ckernel.bound_variable(start_pos) and ckernel.bound_variable(slot)

def attention_sinks(q: Tensor, raw: Tensor, rows: Tensor | None, sel: Tensor | None, sinks: Tensor, slot: int | UOp, start_pos: int | UOp,
                    keys: SinkKeys, scale: float, unit: tuple[int, int], sel_row: int = 0) -> Tensor:
  """q `[T, H, D]` (token t at position start_pos + t) over V4's keys (`SinkKeys`) in cache slot `slot`: `raw` the rings
  `[cache slots, slots, ring_row]` (a key in its first D floats), `rows` the compressed-row caches `[cache slots,
  max_rows, D]`, `sel` the indexer's choices `[cache slots, chunk, max_rows]` (uint8, rows [sel_row, sel_row + T)
  written: several rows of one slot in a step each have their own), `sinks`
  `[H]` -> `[T, H, D]`: softmax over the visible keys and the sink of (q k^T * scale), times the keys, float32. The
  sums run in this module's order (see the docstring)."""
  (T, H, D), max_rows = q.shape, rows.shape[1] if rows is not None else 0
  chunk = sel.shape[1] if sel is not None else 0
  RB = _rows(H, unit[1])
  count = T * H // RB
  threads, per = ckernel.uneven_threads(str(q.device), count)
  srcs = {"OUT": Tensor.empty(threads * per * RB * D, dtype=dtypes.float32, device=q.device),
          "Q": q.float().contiguous().flatten(), "RAW": raw.flatten(), "SINK": sinks.float().contiguous().flatten()}
  if rows is not None: srcs["ROWS"] = rows.flatten()
  if sel is not None: srcs["SEL"] = sel.flatten()
  scalars = {"POS": start_pos, "SLOT": slot}
  assert sel is None or sel_row + T <= chunk, f"indexer choice rows [{sel_row}, {sel_row + T}) past the {chunk} kept per slot"
  body = ckernel.format_string(_sink_source(H, T, D, keys, max_rows, chunk, scale, unit, count, sel_row), [*srcs, *scalars, "R"])
  def kernel(*params: UOp) -> UOp:
    bufs, vals = params[:len(srcs)], params[len(srcs):]
    t, i = UOp.range(threads, 0, AxisType.THREAD), UOp.range(per, 1)
    r = t * per + i
    n = keys.slots + (vals[0] // keys.ratio + keys.candidates if keys.ratio else 0)  # keys the kernel walks (symbolic in a captured step)
    est = Estimates(ops=4 * H * T * n * D, lds=4 * (count * n * 2 * D + 2 * T * H * D), mem=4 * (n * D + 2 * T * H * D))
    info = KernelInfo(name=f"attention_sinks_{T}_{H}_{D}", estimates=est)
    return ckernel.statement_kernel(body, bufs, {0: r * RB * D}, r, (i, t), info, scalars=vals)
  return ckernel.call(kernel, list(srcs.values()), list(scalars.values()))[0][:T * H * D].reshape(T, H, D)
