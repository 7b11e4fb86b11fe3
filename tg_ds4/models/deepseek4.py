"""DeepSeek V4 (GGUF arch `deepseek4`): hyper-connection streams, MQA over one shared KV row with attention sinks, a
sliding window of raw rows plus time-compressed rows (ratio-4 layers with overlapping windows and a top-k indexer,
ratio-128 layers), grouped output LoRA, and a MoE with hash routing in the first layers and clamped SwiGLU experts.

Per layer the math follows transformers' deepseek_v4 and llama.cpp's deepseek4 graph (which agree to float rounding):
  * the residual is `hc` streams `[B, T, hc, D]`. Each sublayer reads `sum_j pre_j x_j` and writes
    `x'_k = post_k y + sum_j comb[j, k] x_j`, with pre/post/comb from one projection of the rms-normed streams and comb
    made doubly stochastic by Sinkhorn iterations; the head collapses the streams the same way (pre weights only);
  * q: low-rank `attn_q_a` -> norm -> `attn_q_b`, then a weightless per-head RMS norm; one KV row `norm(attn_kv x)`
    serves as K and V for every head; RoPE (NORM pairing) rotates the last `rope.dim` dims only, and since V carries it,
    the attention output is rotated back by the query position. Layers with compression use the compress RoPE base
    with YaRN (its magnitude factor cancelled to 1), the others plain RoPE;
  * the softmax has a learned per-head sink logit (a denominator term with no value);
  * keys: the raw rows of the last `window` positions and every compressed row whose window is complete. A compressed
    row pools a window of `ratio` tokens: softmax over the tokens (per channel) of `gate x + ape[pos % ratio]`
    weighting `kv x`, then an RMS norm and RoPE at the window's first position. Ratio-4 layers project to two halves
    and pool 8 tokens: the previous window's first half with the current window's second half. There, an indexer with
    its own compressed keys scores `sum_h w_h relu(q_h . k)` and only the top-k rows are attended.

Cache, all device tensors written inside the graph, so one TinyJit-captured decode step with a symbolic `start_pos`
serves every position and its cost is O(window + compressed rows so far); each has one per cache slot (`[slots, ...]`,
nn/cache_rows.py), a batched step's rows each in their own:
  * raw ring: `window + PREFILL_CHUNK` slots, position p in slot p % slots. The ring is written before attention reads
    it and every read goes through the store (`after`), so a chunk never needs the pre-chunk contents: the slack keeps
    the whole window of the chunk's first query alive. The position each slot holds follows from the last position
    written, so masks are arithmetic on `start_pos`, not stored state;
  * compressor state: the same kind of ring of per-token `[kv | score]` projections, holding the previous window (ratio
    4), the pending one and a chunk;
  * compressed rows: a linear cache, row w = window w. A step (or chunk) always computes the candidate row of every
    window its tokens touch from the post-store state ring and stores it: a window that is not complete yet gets a
    provisional row that no query can see (row w is visible from position (w+1)*ratio-1 on) and that is rewritten with
    the final value by the step that completes the window. So compression needs no data-dependent branch, and the
    shapes depend only on the chunk length; the rows read are `[0, start_pos // ratio + candidates)`, a symbolic length;
  * the indexer top-k is a threshold search (see `topk_mask`), linear in the number of rows.
The slack also makes re-running from up to PREFILL_CHUNK positions back exact (padded prefill chunks rely on it).
The multi-token-prediction block (`nextn_predict_layers`) is loaded only for drafting (DS4NextN)."""
from __future__ import annotations

import functools, math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from tinygrad import Tensor, UOp, dtypes

from tg_ds4.backend.compat import DType, function
from tg_ds4.config import BaseConfig, Gating, Meta, MoEConfig, RopeConfig, RopeType
from tg_ds4.io.gguf import GGUFError, GGUFFile
from tg_ds4.models.nextn import NextNParams, Root
from tg_ds4.nn import attention_kernel
from tg_ds4.nn.cache_rows import Rows
from tg_ds4.nn.layers import Embedding, Linear, Param, Params, RMSNorm, load_weights, matmul, matmul_input
from tg_ds4.nn.moe import MoE
from tg_ds4.nn.rope import apply_rope, rope_table
from tg_ds4.nn.topk import NEG, arange, topk_mask
from tg_ds4.quant import activations, settings
from tg_ds4.quant.formats import QTensor, Weight, as_tensor, dot_lanes, linear

POS_BASE = 2048  # the raw ring's position columns: every integer below it is exact in float16
POS_COLS = 16    # columns after each raw row: its position in the first two, zeros after. A row stride of D + 16 keeps
                 # every row 16-float aligned (with D + 2 the attention kernels read keys only two floats at a time)

@dataclass(frozen=True, kw_only=True)
class DS4Config(BaseConfig):
  """BaseConfig (the shape, q LoRA, experts, the ratio-4 layers' indexer) and V4's own parts."""
  rope_comp: RopeConfig             # compressed layers, compressed rows and the indexer: compress base + YaRN
  o_groups: int
  o_lora_rank: int
  window: int                       # raw rows each query sees, itself included
  compress_ratios: tuple[int, ...]  # per block (the layers, then any multi-token-prediction block): 0, 4 (overlapping
                                    # windows + indexer) or 128
  hc: int                           # hyper-connection streams
  hc_iters: int                     # Sinkhorn iterations
  hc_eps: float
  n_hash_layer: int                 # the first layers route by `ffn_gate_tid2eid[token]`
  swiglu_clamp: tuple[float, ...]   # per block, routed experts
  swiglu_clamp_shexp: tuple[float, ...]
  expert_bias: tuple[bool, ...] = ()  # per block: the router's selection bias `exp_probs_b` (told by the file's tensors)
  n_nextn: int = 0                    # multi-token-prediction blocks after the n_layer the forward runs (DS4NextN)

  @staticmethod
  def from_gguf(gf: GGUFFile) -> DS4Config:
    m = Meta(gf, "deepseek4")
    key = lambda name, default=None: m.need(name) if default is None else m.get(name, default)
    n_layer, n_nextn = m.n_layer(), int(key("nextn_predict_layers", 0) or 0)
    n_all = n_layer + n_nextn
    per_layer = lambda v: tuple(float(x) for x in v[:n_all]) if isinstance(v, list) else (float(v),) * n_all
    head_dim, rope_dim = int(key("attention.key_length")), int(key("rope.dimension_count"))
    if int(key("attention.value_length", head_dim)) != head_dim: raise GGUFError(f"{gf.path}: deepseek4 needs value_length == key_length")
    ratios = tuple(int(r) for r in key("attention.compress_ratios"))
    if len(ratios) < n_all or any(r not in (0, 4, 128) for r in ratios[:n_all]):
      raise GGUFError(f"{gf.path}: deepseek4.attention.compress_ratios {list(ratios)} must give 0, 4 or 128 for each of {n_all} blocks")
    if (g := int(key("expert_gating_func", Gating.SQRT_SOFTPLUS))) != Gating.SQRT_SOFTPLUS:
      raise GGUFError(f"{gf.path}: deepseek4 expects sqrt-softplus expert gating, got gating function {g}")
    if (moe := MoEConfig.from_meta(m, Gating.SQRT_SOFTPLUS)) is None: raise GGUFError(f"{gf.path}: missing metadata key deepseek4.expert_count")
    factor = float(key("rope.scaling.factor", 0.0) or 0.0)
    yarn = key("rope.scaling.type", "none") == "yarn" and factor > 1.0
    # compressed layers: compress base with YaRN; llama.cpp passes attn_factor 1/(1 + 0.1 ln factor), which cancels the
    # magnitude boost of its YaRN rope (rope_table applies the same boost), as the reference does without mscale
    orig_ctx = int(key("rope.scaling.original_context_length", 0) or key("context_length", 4096))
    rope_comp = RopeConfig(rope_dim, float(key("attention.compress_rope_freq_base")), RopeType.NORM, 1.0 / factor if yarn else 1.0,
                           1.0 if yarn else 0.0, 1.0 / (1.0 + 0.1 * math.log(factor)) if yarn else 1.0, orig_ctx,
                           float(key("rope.scaling.yarn_beta_fast", 32.0)), float(key("rope.scaling.yarn_beta_slow", 1.0)))
    clamp = per_layer(key("swiglu_clamp_exp", 0.0))
    return DS4Config(
      n_layer=n_layer, dim=int(key("embedding_length")), n_vocab=m.n_vocab(), n_head=int(key("attention.head_count")), head_dim=head_dim,
      norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)), ctx_len=int(key("context_length", 4096)),
      rope=RopeConfig(rope_dim, float(key("rope.freq_base", 10000.0)), RopeType.NORM), rope_comp=rope_comp,
      q_lora_rank=int(key("attention.q_lora_rank")), o_groups=int(key("attention.output_group_count")),
      o_lora_rank=int(key("attention.output_lora_rank")), window=int(key("attention.sliding_window")), compress_ratios=ratios[:n_all],
      idx_n_head=int(key("attention.indexer.head_count", 0)), idx_head_dim=int(key("attention.indexer.key_length", 0)),
      idx_top_k=int(key("attention.indexer.top_k", 0)), hc=int(key("hyper_connection.count")),
      hc_iters=int(key("hyper_connection.sinkhorn_iterations")), hc_eps=float(key("hyper_connection.epsilon")),
      moe=moe, n_hash_layer=int(key("hash_layer_count", 0)),
      swiglu_clamp=clamp, swiglu_clamp_shexp=per_layer(m.get("swiglu_clamp_shexp")) if m.get("swiglu_clamp_shexp") else clamp,
      expert_bias=tuple(f"blk.{i}.exp_probs_b.bias" in gf for i in range(n_all)), n_nextn=n_nextn)

@dataclass
class Tables:
  """cos/sin tables (rope.rope_table) for both RoPE kinds, and their conjugates for rotating attention outputs back."""
  main: Tensor
  comp: Tensor
  main_inv: Tensor
  comp_inv: Tensor

# ---------------------------------------------------------------- helpers

def rms0(x: Tensor, eps: float) -> Tensor: return x * (x.square().mean(-1, keepdim=True) + eps).rsqrt()  # RMS norm without weight

def rope_tail(x: Tensor, table: Tensor, start_pos: int | UOp | Rows) -> Tensor:
  """RoPE on the last table-width dims of `x` `[B, T, ..., D]` at positions start_pos.. (per row: nn/cache_rows.py's
  Rows; the rest passes through)."""
  r = table.shape[-2] * 2
  return x[..., :-r].cat(apply_rope(x[..., -r:], table, start_pos, RopeType.NORM), dim=-1)

def ring_write(ring: Tensor, new: Tensor, rows: Rows) -> Tensor:
  """Store row b of `new` `[B, T, F]` (positions pos_b..) into the ring of cache slot slot_b of `ring` `[slots, S, F]`
  (position p in ring slot p % S); return all the rings, ordered after the stores (`ring_stores`)."""
  return Tensor(ring.uop.after(*ring_stores(ring, new, rows)))

def ring_stores(ring: Tensor, new: Tensor, rows: Rows) -> list[UOp]:
  """The stores of `ring_write`. A token is a one-slot store; a chunk (one row) rewrites its whole ring, each ring slot
  taking its new row if the chunk covers it (a static shape whatever the wrap point)."""
  S, T = ring.shape[1], new.shape[1]
  if T == 1:
    one = lambda b: (new if len(rows) == 1 else new[b:b + 1]).cast(ring.dtype)
    return [ring[s:s + 1, p % S:p % S + 1].uop.store(one(b).uop) for b, (s, p) in enumerate(rows)]
  assert T <= S and len(rows) == 1, f"a chunk of {T} rows into a ring of {S} is one sequence's"
  (slot, start_pos), = rows
  j = _ring_rows(S, start_pos)
  hit = j.reshape(S, 1) == Tensor.arange(T).reshape(1, T)                         # [S, T]
  taken = hit.unsqueeze(-1).where(new[0].unsqueeze(0), 0.0).sum(1)                # [S, F]
  full = (j < T).reshape(1, S, 1).where(taken.unsqueeze(0), ring[slot:slot + 1]).cast(ring.dtype)
  return [ring[slot:slot + 1, 0:S].uop.store(full.uop)]

def _ring_rows(S: int, start_pos: int | UOp) -> Tensor:
  """`[S]`: the row of a chunk starting at start_pos that each of a ring's S slots takes (>= the chunk's length: none)."""
  return (Tensor.arange(S) + (S - start_pos % S)) % S

def ring_read(ring: Tensor, slot: int | UOp, start_pos: int | UOp, T: int) -> Tensor:
  """Positions start_pos..start_pos + T - 1 of slot `slot`'s ring `[slots, S, F]` -> `[1, T, F]` (the ring order
  undone: a one-slot slice for a token, a one-hot selection for a chunk)."""
  S = ring.shape[1]
  if T == 1: return ring[slot:slot + 1, start_pos % S:start_pos % S + 1]
  hit = (Tensor.arange(T).reshape(T, 1) == _ring_rows(S, start_pos).reshape(1, S)).unsqueeze(-1)  # [T, S, 1]
  return hit.where(ring[slot:slot + 1, 0:S][0].unsqueeze(0), 0.0).sum(1).unsqueeze(0)

def ring_positions(S: int, last: int | UOp) -> Tensor:
  """Position held by each of the S slots of a ring whose last write was position `last` (negative: never written)."""
  return ((Tensor.arange(S) * -1 + (last % S + S)) % S) * -1 + last

def _grouped(w: Weight, G: int) -> Weight:
  """`[G * out, in]` weight viewed as G stacked `[out, in]` matrices (packed blocks stay packed)."""
  if isinstance(w, QTensor): return QTensor(w.blocks.reshape(G, w.shape[0] // G, *w.blocks.shape[1:]), w.qtype, (G, w.shape[0] // G, w.shape[1]))
  return w.reshape(G, w.shape[0] // G, w.shape[1])

# ---------------------------------------------------------------- hyper-connections

class HyperConn:
  """One hyper-connection site: `{name}_fn` `[mix, hc*D]`, `{name}_scale` (one per output kind), `{name}_base` `[mix]`.
  Sublayer sites mix pre (hc), post (hc) and comb (hc x hc, see `_hc_weights`); the head (`output_hc`) only pre."""
  gguf_flat = True
  def __init__(self, cfg: DS4Config, name: str, head: bool = False):
    self.cfg, self.name, self.n_mix = cfg, name, cfg.hc if head else (2 + cfg.hc) * cfg.hc
    setattr(self, f"{name}_fn", Linear(cfg.hc * cfg.dim, self.n_mix))
    setattr(self, f"{name}_scale", Params(weight=Param(1 if head else 3)))
    setattr(self, f"{name}_base", Params(weight=Param(self.n_mix)))

  def _mix(self, x: Tensor) -> tuple[Tensor, bool]:
    """`fn(rms_norm(streams))`, `[B*T, mix]`, as the projection of the raw streams with their mean square as one more
    output of the same reduce (`[B*T, mix + 1]`, one kernel instead of two; `_rms_after` applies it), or, when
    llama.cpp's rounding of a quantized fn's input is emulated (real files store fn F16), normalised first (flag True)."""
    B, T, hc, D = x.shape
    flat, w = x.reshape(B * T, hc * D), getattr(self, f"{self.name}_fn").weight
    if isinstance(w, QTensor) and activations.rounds(w.qtype.name, str(w.device)):
      return linear(rms0(flat, self.cfg.norm_eps), w, dtype=dtypes.float32), True
    rows = as_tensor(w).expand(B * T, *w.shape).cat(flat.unsqueeze(1) / (hc * D), dim=1)          # [B*T, mix+1, hc*D]
    return dot_lanes(flat.unsqueeze(1), rows).squeeze(1), False

  def head(self, x: Tensor) -> Tensor:
    """`[B, T, hc, D]` -> `[B, T, D]`: sigmoid-weighted sum of the streams."""
    B, T, hc, _ = x.shape
    w = _rms_after(*self._mix(x), self.cfg.norm_eps) * as_tensor(self.output_hc_scale.weight) + as_tensor(self.output_hc_base.weight)
    w = w.sigmoid() + self.cfg.hc_eps
    w = w.reshape(B, T, hc, 1)
    return sum((w[:, :, j] * x[:, :, j] for j in range(1, hc)), w[:, :, 0] * x[:, :, 0])

  def __call__(self, x: Tensor) -> tuple[Tensor, list[Tensor], list[list[Tensor]]]:
    """Streams `[B, T, hc, D]` -> (sublayer input `[B, T, D]`, post[k], comb[j][k] (source j, destination k))."""
    (B, T, hc, _), c = x.shape, self.cfg
    w = _hc_weights(*self._mix(x), as_tensor(getattr(self, f"{self.name}_scale").weight), as_tensor(getattr(self, f"{self.name}_base").weight),
                    hc, c.hc_iters, c.hc_eps, c.norm_eps).reshape(B, T, self.n_mix, 1)
    pre, post = [w[:, :, j] for j in range(hc)], [w[:, :, hc + k] for k in range(hc)]
    comb = [[w[:, :, 2 * hc + j * hc + k] for k in range(hc)] for j in range(hc)]
    return sum((p * x[:, :, j] for j, p in enumerate(pre[1:], 1)), pre[0] * x[:, :, 0]), post, comb

def _rms_after(mix: Tensor, normed: bool, eps: float) -> Tensor:
  return mix if normed else mix[:, :-1] * (mix[:, -1:] + eps).rsqrt()

@function(precompile=True)
def _hc_weights(mix: Tensor, normed: bool, scale: Tensor, base: Tensor, hc: int, iters: int, eps: float, norm_eps: float) -> Tensor:
  """`[N, (2 + hc) * hc]` mixes -> [pre (hc) | post (hc) | comb (hc x hc, source-major)] per token. Each weight is a
  separate 1-D tensor, so the Sinkhorn is plain elementwise arithmetic in one kernel (as a `[.., hc, hc]` tensor every
  normalisation would be a reduce, i.e. a kernel, 2 per iteration; 1-D scalars also schedule faster than `[N, 1]` ones
  or slices of a `[N, hc, hc]` one), and the body is a precompiled function, scheduled and compiled once for all sites
  with the same shapes (inline, its ~1400 ops would be rescheduled at every site)."""
  scale = scale[0:1].expand(hc).cat(scale[1:2].expand(hc), scale[2:3].expand(hc * hc))
  z = _rms_after(mix, normed, norm_eps) * scale + base
  z = [z[:, i] for i in range(z.shape[1])]
  pre, post = [v.sigmoid() + eps for v in z[:hc]], [v.sigmoid() * 2 for v in z[hc:2 * hc]]
  c = [z[2 * hc + j * hc:2 * hc + (j + 1) * hc] for j in range(hc)]
  rows = lambda c: [sum(r[1:], r[0]) for r in c]                                  # sum over destinations, per source
  cols = lambda c: [sum((r[k] for r in c[1:]), c[0][k]) for k in range(hc)]       # sum over sources, per destination
  # softmax over destinations, then Sinkhorn: alternately normalise over sources and destinations
  m = [functools.reduce(Tensor.maximum, r) for r in c]
  c = [[(v - m[j]).exp() for v in r] for j, r in enumerate(c)]
  c = [[v / s + eps for v in r] for r, s in zip(c, rows(c))]
  c = [[v / (s + eps) for v, s in zip(r, cols(c))] for r in c]
  for _ in range(iters - 1):
    c = [[v / (s + eps) for v in r] for r, s in zip(c, rows(c))]
    c = [[v / (s + eps) for v, s in zip(r, cols(c))] for r in c]
  return Tensor.stack(*pre, *post, *[v for r in c for v in r], dim=-1)

def hc_post(y: Tensor, x: Tensor, post: list[Tensor], comb: list[list[Tensor]]) -> Tensor:
  """New streams `[B, T, hc, D]`: `x'_k = post_k y + sum_j comb[j][k] x_j`."""
  hc = len(post)
  return Tensor.stack(*[sum((comb[j][k] * x[:, :, j] for j in range(hc)), post[k] * y) for k in range(hc)], dim=2)

# ---------------------------------------------------------------- compressed rows

class Compressor:
  """`{name}_kv`, `{name}_gate` (`[coff*D, dim]`), `{name}_ape` (`[ratio, coff*D]`), `{name}_norm`; its state ring and
  compressed-row cache (see the module docstring). coff = 2 for ratio 4 (overlapping windows), else 1."""
  gguf_flat = True
  def __init__(self, cfg: DS4Config, name: str, ratio: int, D: int):
    self.cfg, self.name, self.R, self.D, self.coff = cfg, name, ratio, D, 2 if ratio == 4 else 1
    setattr(self, f"{name}_kv", Linear(cfg.dim, self.coff * D))
    setattr(self, f"{name}_gate", Linear(cfg.dim, self.coff * D))
    setattr(self, f"{name}_ape", Params(weight=Param(ratio, self.coff * D)))
    setattr(self, f"{name}_norm", RMSNorm(D, cfg.norm_eps))

  def n_cand(self, T: int) -> int: return 1 if T == 1 else (T - 1) // self.R + 2  # windows a chunk of T tokens touches

  def init_cache(self, max_ctx: int, chunk: int, device: str, dtype: DType, slots: int = 1):
    R, F = self.R, self.coff * self.D
    S = R * (self.coff + -(-chunk // R))   # previous window (overlap), the pending one, and one chunk of slack
    # the state ring (pending projections, a fixed few rows) stays float32: its scores are softmax logits
    self.state = Tensor.zeros(slots, S, F, device=device).cat(Tensor.full((slots, S, F), NEG, device=device), dim=-1).contiguous().realize()
    self.rows = Tensor.zeros(slots, max_ctx // R + self.n_cand(chunk) + 1, self.D, dtype=dtype, device=device).contiguous().realize()

  def store(self, x: Tensor, rows: Rows, table: Tensor) -> Tensor:
    """x `[B, T, dim]` (the attention input; row b at position pos_b in cache slot slot_b) -> the whole compressed-row
    caches `[slots, max_rows, D]` after each row's candidate rows are stored in its slot. A row's windows
    `[0, pos_b // ratio + n_cand(T))` are the ones its queries may see."""
    R, D, coff, T = self.R, self.D, self.coff, x.shape[1]
    ape = as_tensor(getattr(self, f"{self.name}_ape").weight).repeat(-(-T // R) + 1, 1)
    ape = Tensor.stack(*[ape[p % R:p % R + T] for p in rows.pos]) if len(rows) > 1 else ape[rows.pos[0] % R:rows.pos[0] % R + T]  # by position % R
    # each GEMV its own kernel: a cat of the two lazy ones is one kernel running both reduces for every output (V4's
    # F16 attn compressor)
    new = getattr(self, f"{self.name}_kv")(x).contiguous().cat(getattr(self, f"{self.name}_gate")(x).contiguous() + ape, dim=-1)
    st = ring_write(self.state, new, rows)                                         # [slots, S, 2*coff*D]: kv | score
    nb, F, stores = st.shape[1] // R, coff * D, []
    # rows of one slot (a verify step's consecutive positions of one sequence) touch their windows as one chunk would:
    # each window's candidate pooled once from the post-store state ring, not stored by several rows
    runs: list[list] = []
    for b, (slot, start_pos) in enumerate(rows):
      if rows.continues(b): runs[-1][2] += T
      else: runs.append([slot, start_pos, T])
    for slot, start_pos, count in runs:
      w0 = start_pos // R
      block = lambda w, slot=slot: st[slot:slot + 1, (w % nb) * R:(w % nb) * R + R]  # the R state rows of window w
      vals, scores = [], []
      for i in range(n := self.n_cand(count)):
        cur = block(w0 + i)
        if coff == 1: vals.append(cur[..., :D]); scores.append(cur[..., F:F + D]); continue
        prev = block(w0 + i + nb - 1)
        first = (Tensor.arange(2 * R).reshape(1, 2 * R, 1) + (w0 + i) * R) < R  # window 0 has no previous window
        vals.append(prev[..., :D].cat(cur[..., D:F], dim=1))
        scores.append(first.where(NEG, prev[..., F:F + D].cat(cur[..., F + D:], dim=1)))
      v, s = Tensor.stack(*vals, dim=1), Tensor.stack(*scores, dim=1)             # [1, n, coff*R, D]
      pooled = (v * s.softmax(2)).sum(2)                                           # [1, n, D]
      windows = table.reshape(-1, R, *table.shape[1:])[:, 0]                       # cos/sin at each window's first position
      out = rope_tail(getattr(self, f"{self.name}_norm")(pooled), windows, w0)
      stores.append(self.rows[slot:slot + 1, w0:w0 + n].uop.store(out.cast(self.rows.dtype).uop))
    return Tensor(self.rows.uop.after(*stores))

class Indexer:
  """`indexer.attn_q_b` (queries from the Q LoRA latent) and `indexer.proj` (per-head weights)."""
  def __init__(self, cfg: DS4Config):
    self.attn_q_b, self.proj = Linear(cfg.q_lora_rank, cfg.idx_n_head * cfg.idx_head_dim), Linear(cfg.dim, cfg.idx_n_head)

# ---------------------------------------------------------------- attention

class DS4Attention:
  gguf_flat = True
  def __init__(self, cfg: DS4Config, ratio: int):
    self.cfg, self.ratio, H, D = cfg, ratio, cfg.n_head, cfg.head_dim
    self.attn_q_a, self.attn_q_a_norm = Linear(cfg.dim, cfg.q_lora_rank), RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
    self.attn_q_b = Linear(cfg.q_lora_rank, H * D)
    self.attn_kv, self.attn_kv_a_norm = Linear(cfg.dim, D), RMSNorm(D, cfg.norm_eps)
    self.attn_sinks = Params(weight=Param(H))
    self.attn_output_a = Linear(H * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
    self.attn_output_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim)
    self.compressor = Compressor(cfg, "attn_compressor", ratio, D) if ratio else None
    # ratio-4 layers: a top-k indexer over compressed keys of its own
    self.indexer, self.idx_compressor = (Indexer(cfg), Compressor(cfg, "indexer_compressor", ratio, cfg.idx_head_dim)) if ratio == 4 else (None, None)

  def init_cache(self, max_ctx: int, chunk: int, device: str, dtype: DType, slots: int = 1):
    # raw rows carry their position in the first two of POS_COLS extra columns written with the row, `p % POS_BASE`
    # and `p // POS_BASE` (each exact in float16): only for `check_resume` (masks are arithmetic on start_pos); -1 =
    # never written
    assert max_ctx + chunk < POS_BASE ** 2, f"context {max_ctx} beyond the raw ring's position columns"
    S = self.cfg.window + chunk
    never = Tensor.full((slots, S, 1), -1.0, device=device).cat(Tensor.zeros(slots, S, POS_COLS - 1, device=device), dim=-1)
    self.raw = Tensor.zeros(slots, S, self.cfg.head_dim, device=device).cat(never, dim=-1).cast(dtype).contiguous().realize()
    if self.compressor is not None: self.compressor.init_cache(max_ctx, chunk, device, dtype, slots)
    # the indexer's keys stay float32: its scores make a discrete choice (top-k), like the router's
    if self.idx_compressor is not None:
      self.idx_compressor.init_cache(max_ctx, chunk, device, dtypes.float32, slots)
      # the indexer's choice per query row and compressed row, per slot, as nn/attention_kernel.py's attention_sinks reads it
      self.chosen = Tensor.zeros(slots, chunk, self.idx_compressor.rows.shape[1], dtype=dtypes.uint8, device=device).contiguous().realize()

  def select(self, x: Tensor, qr: Tensor, keys: Tensor, rows: Rows, tabs: Tables, ok: list[Tensor]) -> list[Tensor]:
    """Indexer: which compressed rows the queries of each row attend, per row `[T, n_b]` bool (`ok[b]`: the rows they
    may see), `keys` the indexer's compressed keys of every slot `[slots, max_rows, Di]`. The projections run for all
    rows at once, the scores over each row's own slot. Float32 at any precision: the top-k is a discrete choice
    (half-rounded scores flip near-ties), like the router's."""
    cfg, (B, T, _) = self.cfg, x.shape
    with settings.override(matmul=dtypes.float32):
      q = rope_tail(self.indexer.attn_q_b(qr).reshape(B, T, cfg.idx_n_head, cfg.idx_head_dim), tabs.comp, rows)
      w = self.indexer.proj(x) * (cfg.idx_head_dim * cfg.idx_n_head) ** -0.5                    # [B, T, Hi]
      out = []
      for b, ((slot, _), seen) in enumerate(zip(rows, ok)):
        score = (dot_lanes(q[b:b + 1], keys[slot:slot + 1, :seen.shape[1]][0]).relu() * w[b:b + 1].unsqueeze(-1)).sum(-2)  # [1, T, n]
        out.append(topk_mask(score[0], seen, cfg.idx_top_k, keys.shape[1]))
      return out

  def _attend(self, q: Tensor, raw: Tensor, rows: Tensor | None, seen: Tensor | None, start_pos: int | UOp) -> Tensor:
    """One sequence's queries `[1, T, H, D]` over its raw ring's keys `[S, D]` and its compressed rows `[n, D]` (the
    ones it may see: `seen` `[T, n]`) -> `[1, H, T, D]`, as tensor ops."""
    cfg, T, D, H = self.cfg, q.shape[1], self.cfg.head_dim, self.cfg.n_head
    qpos = (Tensor.arange(T) + start_pos).reshape(T, 1)
    held = ring_positions(raw.shape[0], start_pos + T - 1).reshape(1, -1)
    keys, ok = raw, (held >= 0) & (held <= qpos) & (held > qpos - cfg.window)                  # [T, S]
    if rows is not None:  # the symbolic-length part first: tinygrad cannot cat after a fixed one
      keys, ok = rows.cat(raw), seen.cat(ok, dim=1)
    scores = ok.where(dot_lanes(q.transpose(1, 2), keys) * D ** -0.5, NEG)                      # [1, H, T, S]
    sink = as_tensor(self.attn_sinks.weight).reshape(1, H, 1, 1)                              # a logit with no value
    m = scores.max(-1, keepdim=True).maximum(sink)
    # materialised: left lazy, the exp is recomputed for every value column of `e @ keys` (512 per score)
    e = (scores - m).exp().contiguous()
    return (e @ keys) / (e.sum(-1, keepdim=True) + (sink - m).exp())

  def _attend_kernel(self, q: Tensor, ring: Tensor, comp: Tensor | None, picks: list[Tensor] | None, rows: Rows,
                     unit: tuple[int, int]) -> Tensor:
    """The same as `_attend` as one C kernel per row (nn/attention_kernel.py's attention_sinks) over its slot of the
    static caches, the visibility arithmetic on the position there, the indexer's choice stored for it -> `[B, T, H, D]`."""
    cfg, T, R = self.cfg, q.shape[1], self.ratio
    chosen = None
    # rows of one slot (a verify step's consecutive positions of one sequence) keep their choices in rows of their own
    first = [0] * len(rows)
    for b in range(1, len(rows)): first[b] = first[b - 1] + T if rows.continues(b) else 0
    if picks is not None:
      stores = [self.chosen[s:s + 1, o:o + T, :pick.shape[1]].uop.store(pick.cast(dtypes.uint8).reshape(1, T, -1).uop)
                for (s, _), pick, o in zip(rows, picks, first)]
      chosen = Tensor(self.chosen.uop.after(*stores))
    keys = attention_kernel.SinkKeys(R, self.compressor.n_cand(T) if R else 0, ring.shape[1], ring.shape[2], cfg.window, R == 4)
    return Tensor.stack(*[attention_kernel.attention_sinks(q[b], ring, comp, chosen, as_tensor(self.attn_sinks.weight), s, p, keys,
                                                           cfg.head_dim ** -0.5, unit, first[b]) for b, (s, p) in enumerate(rows)])

  def raw_rows(self, x: Tensor, rows: Rows, tabs: Tables) -> Tensor:
    """The raw ring's new rows for x `[B, T, dim]`: `[B, T, D + POS_COLS]`, the K/V row (normed, RoPE on its tail) and
    its position columns."""
    (B, T, _), table = x.shape, tabs.comp if self.ratio else tabs.main
    kv = rope_tail(self.attn_kv_a_norm(self.attn_kv(x)), table, rows)                         # [B, T, D]: K and V
    qpos = [(Tensor.arange(T) + p).reshape(T, 1) for p in rows.pos]
    cols = [(qp % POS_BASE).cat(qp // POS_BASE, dim=-1).float().reshape(1, T, 2) for qp in qpos]
    return kv.cat((cols[0] if B == 1 else Tensor.cat(*cols)).pad((None, None, (0, POS_COLS - 2))), dim=-1)

  def __call__(self, x: Tensor, start_pos: int | UOp | Rows, tabs: Tables) -> Tensor:
    """x `[B, T, dim]`, row b at position pos_b in cache slot slot_b (nn/cache_rows.py's Rows; an int or variable: one
    sequence in slot 0): the projections and the output LoRA see every row at once, the caches and the attention are
    each row's own."""
    cfg, (B, T, _), rows = self.cfg, x.shape, Rows.of(start_pos)
    H, D, G, R = cfg.n_head, cfg.head_dim, cfg.o_groups, self.ratio
    table, inv = (tabs.comp, tabs.comp_inv) if R else (tabs.main, tabs.main_inv)
    qr = matmul_input(self.attn_q_a_norm(self.attn_q_a(x)))
    q = rope_tail(rms0(self.attn_q_b(qr).reshape(B, T, H, D), cfg.norm_eps), table, rows)
    qpos = [(Tensor.arange(T) + p).reshape(T, 1) for p in rows.pos]
    ring = ring_write(self.raw, self.raw_rows(x, rows, tabs), rows)                            # [slots, S, D + POS_COLS]
    comp = self.compressor.store(x, rows, tabs.comp) if R else None                            # [slots, max_rows, D]
    # per row: its compressed rows [0, n) and which of them its queries may see (complete windows only)
    n = [p // R + self.compressor.n_cand(T) for p in rows.pos] if R else []
    seen = [((arange(k) + 1) * R).reshape(1, -1) <= qp + 1 for k, qp in zip(n, qpos)]
    picks = None
    if R == 4:
      with settings.override(matmul=dtypes.float32): keys = self.idx_compressor.store(x, rows, tabs.comp)
      picks = self.select(x, qr, keys, rows, tabs, seen)
    unit = settings.current(x.device).caps.c_attention
    if all(attention_kernel.sink_applies(q[0], ring, comp, unit, s, p) for s, p in rows):
      o = self._attend_kernel(q, ring, comp, picks, rows, unit)
    else:
      o = Tensor.cat(*[self._attend(q[b:b + 1], ring[s:s + 1, :, :D][0], comp[s:s + 1, :n[b]][0] if R else None,
                                    (seen[b] & picks[b] if picks is not None else seen[b]) if R else None, p)
                       for b, (s, p) in enumerate(rows)]).transpose(1, 2)
    o = rope_tail(o, inv, rows)                                                                 # rotate V's RoPE back
    # materialised: left lazy, the attention output (and its inverse rope) is recomputed for every row of the GEMV
    o = o.reshape(B * T, G, H * D // G).transpose(0, 1).contiguous()                            # [G, BT, H*D/G]
    # one token per row (decode, batched or not): a GEMV per group, each row's sums as alone
    if T == 1: o = linear(o, _grouped(self.attn_output_a.weight, G)).transpose(0, 1).reshape(B, T, G * cfg.o_lora_rank)
    else:  # a chunk: a GEMM per group on its rows dequantized once (as nn/layers.py's Linear), joined in [B, T, G * rank] order so
      # that attn_output_b's reduce is one axis (the GEMM kernel opts need that)
      w, Rk = self.attn_output_a.weight, cfg.o_lora_rank
      o = Tensor.cat(*[matmul(o[g], w[g * Rk:(g + 1) * Rk]).contiguous() for g in range(G)], dim=-1).reshape(B, T, G * Rk).contiguous()
    return self.attn_output_b(o)

# ---------------------------------------------------------------- MoE

class DS4MoE(MoE):
  """moe.MoE with V4's parts: hash routing (`ffn_gate_tid2eid[token]` picks the experts, the gate still weights them)
  in the first `n_hash_layer` layers, and the SwiGLU clamp (gate <= limit, |up| <= limit) on routed and shared experts."""
  def __init__(self, cfg: DS4Config, i: int, has_bias: bool):
    super().__init__(cfg.dim, cfg.moe, has_bias=has_bias)
    self.limit, self.limit_shexp = cfg.swiglu_clamp[i], cfg.swiglu_clamp_shexp[i]
    # the first n_hash_layer layers route by token: `ffn_gate_tid2eid[token]` picks the experts
    self.ffn_gate_tid2eid = Params(weight=Param(cfg.n_vocab, cfg.moe.n_expert_used)) if i < cfg.n_hash_layer else None

  def route(self, x: Tensor, tokens: Tensor | UOp | list[UOp] | None = None) -> tuple[Tensor, Tensor]:
    if self.ffn_gate_tid2eid is None: return super().route(x)
    with settings.override(matmul=dtypes.float32): logits = self.ffn_gate_inp(x)  # float32 at any precision, as MoE.route
    cfg, probs = self.cfg, logits.softplus().sqrt()
    t = self.ffn_gate_tid2eid.weight
    as_ids = lambda r: r.dequant(dtypes.int32) if isinstance(r, QTensor) else r.cast(dtypes.int32)
    if isinstance(tokens, list): ids = Tensor.cat(*[as_ids(t[u:u + 1]) for u in tokens])  # a batched step: a variable per row
    else: ids = as_ids(t[tokens:tokens + 1] if isinstance(tokens, UOp) else t[tokens])
    ids = ids.reshape(*x.shape[:-1], cfg.n_expert_used)
    w = probs.gather(-1, ids)
    if cfg.weights_norm: w = w / w.sum(-1, keepdim=True).maximum(6.103515625e-5)
    return ids, w * cfg.weights_scale

  def _swiglu(self, g: Tensor, u: Tensor, limit: float) -> Tensor:
    """Clamped SwiGLU, materialised with the same barriers as moe._swiglu (gate GEMV alone, activation in the up GEMV)."""
    g = g.contiguous()
    return (g.minimum(limit).silu() * u.clip(-limit, limit) if limit > 0 else g.silu() * u).contiguous()

  def _act(self, g: Tensor, u: Tensor) -> Tensor: return self._swiglu(g, u, self.limit)

  def __call__(self, x: Tensor, tokens: Tensor | UOp | list[UOp] | None = None) -> Tensor:
    y = self.experts(x, *self.route(x, tokens))
    if self.shexp is None: return y
    s = self.shexp
    return y + s.ffn_down_shexp(self._swiglu(s.ffn_gate_shexp(x), s.ffn_up_shexp(x), self.limit_shexp))

# ---------------------------------------------------------------- model

class DS4Block:
  def __init__(self, cfg: DS4Config, i: int):
    self.hc_attn, self.hc_ffn = HyperConn(cfg, "hc_attn"), HyperConn(cfg, "hc_ffn")
    self.attn_norm, self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps), RMSNorm(cfg.dim, cfg.norm_eps)
    self.attn = DS4Attention(cfg, cfg.compress_ratios[i])
    self.ffn = DS4MoE(cfg, i, has_bias=cfg.expert_bias[i])

  def __call__(self, x: Tensor, tokens: Tensor | UOp | list[UOp], start_pos: int | UOp | Rows, tabs: Tables) -> Tensor:
    # over a chunk each sublayer's output is materialised: left lazy, hc_post fuses it into the streams' kernel, which
    # recomputes the output projection (a whole GEMM) once per stream. The streams after attention are materialised
    # too: left lazy, the ffn site's mix recomputes them for each of its outputs
    done = (lambda y: y.contiguous()) if x.shape[0] * x.shape[1] > 1 else (lambda y: y)
    h, post, comb = self.hc_attn(x)
    x = hc_post(done(self.attn(matmul_input(self.attn_norm(h)), start_pos, tabs)), x, post, comb).contiguous()
    h, post, comb = self.hc_ffn(x)
    return hc_post(done(self.ffn(matmul_input(self.ffn_norm(h)), tokens)), x, post, comb).contiguous()  # one barrier per block, as model.Block

class NextNRoot(Root):
  """The root tensors of a multi-token-prediction block's file that the block reads, as llama.cpp's graph_mtp reads
  them: nextn.Root's, and the hyper head (`output_hc_*`; a draft file written by convert_hf_to_gguf.py --mtp holds the
  block's own there)."""
  def __init__(self, cfg: DS4Config):
    super().__init__(cfg)
    self.output_hc = HyperConn(cfg, "output_hc", head=True)

class DS4NextN:
  """DeepSeek V4's multi-token-prediction block (`blk.{n_layer}`, llama.cpp's deepseek4 graph_mtp): models/nextn.py's
  semantics with V4's residual. h is the target's hyper-connection streams after its last layer (the hyper head's
  input, `[hc, D]` per position); the block's input streams are `eh_proj([enorm(embed(token)) ; hnorm(h_s)])` for each
  stream s (the token's half the same in every stream), it runs as a ratio-0 (sliding-window) block with routed experts,
  and its output streams go through the file's hyper head, the head norm and the head. Its own h' is those output streams.
  The hidden states sit in a ring like the raw rows' (position p in slot p % S, S = 2 * PREFILL_CHUNK: a step reads
  position start - 1 and writes at most PREFILL_CHUNK rows from start), the block's raw ring is the ordinary one."""
  def __init__(self, cfg: DS4Config):
    """`cfg`: the config of the file that holds the block (a target's own, or a draft file's)."""
    self.cfg, i = cfg, cfg.n_layer
    self.block = DS4Block(cfg, i)
    self.block.nextn = NextNParams(cfg)
    self.root = NextNRoot(cfg)

  def load(self, gf: GGUFFile, device: str, max_ctx: int, dtype: DType, slots: int) -> None:
    load_weights(self.block, gf, device, prefix=f"blk.{self.cfg.n_layer}.")
    load_weights(self.root, gf, device)
    C = DS4Transformer.PREFILL_CHUNK
    self.block.attn.init_cache(max_ctx, C, device, dtype, slots)
    self.hidden = Tensor.zeros(slots, 2 * C, self.cfg.hc * self.cfg.dim, device=device).contiguous().realize()

  def _prev(self, slot: int | UOp, p: int | UOp) -> Tensor:
    """h at position p - 1 of `slot` `[1, 1, hc * D]`: zeros at p = 0."""
    S = self.hidden.shape[1]
    h = self.hidden[slot:slot + 1, (p + S - 1) % S:(p + S - 1) % S + 1]
    return ((Tensor.arange(1) + p) > 0).reshape(1, 1, 1).where(h, 0.0)

  def _input(self, tokens, h_prev: Tensor) -> Tensor:
    """The block's input streams `[B, T, hc, D]` from the tokens and h at the position before each `[B, T, hc * D]`."""
    p, c, (B, T, _) = self.block.nextn, self.cfg, h_prev.shape
    e = p.enorm(p.embed_tokens(tokens) if p.embed_tokens.weight is not None else self.root.token_embd(tokens))
    e = e.reshape(B, T, 1, c.dim).expand(B, T, c.hc, c.dim)
    x = e.cat(p.hnorm(h_prev.reshape(B, T, c.hc, c.dim)), dim=-1).reshape(B * T * c.hc, 1, 2 * c.dim)  # one GEMV row per stream
    return p.eh_proj(matmul_input(x)).reshape(B, T, c.hc, c.dim)

  def follow(self, tokens, x: Tensor, start_pos: int | UOp | Rows, tabs: Tables) -> Tensor:
    """A target step's part: store its rows' streams `x` `[B, T, hc, D]` as hidden states and the block's raw rows for
    them (the block's input, its attention site's collapse and K/V only: no attention, no experts, no head); returns `x`
    read back after both stores, so that they are part of whatever reads the logits."""
    rows, (B, T, hc, D) = Rows.of(start_pos), x.shape
    flat = x.reshape(B, T, hc * D)
    prev = []
    for b, (s, p) in enumerate(rows):  # h of each row's position - 1: this step's previous row, or the stored one
      first = flat[b - 1:b, -1:] if rows.continues(b) else self._prev(s, p)
      prev.append(first if T == 1 else first.cat(flat[b:b + 1, :-1], dim=1))
    blk = self.block
    h, _, _ = blk.hc_attn(self._input(tokens, prev[0] if B == 1 else Tensor.cat(*prev)))
    new = blk.attn.raw_rows(matmul_input(blk.attn_norm(h)), rows, tabs)
    after = Tensor(self.hidden.uop.after(*ring_stores(self.hidden, flat, rows), *ring_stores(blk.attn.raw, new, rows)))
    back = [ring_read(after, s, p, T) for s, p in rows]
    return (back[0] if B == 1 else Tensor.cat(*back)).reshape(B, T, hc, D)

  def draft(self, token: UOp, start_pos: UOp | Rows, tabs: Tables) -> Tensor:
    """One draft step: the token at position p (a bound variable) -> logits `[1, 1, vocab]` of the token at p + 2, with
    the block's raw row and hidden state of p stored."""
    rows = Rows.of(start_pos)
    (s, p), = rows
    x = self.block(self._input(token, self._prev(s, p)), token, start_pos, tabs)
    after = Tensor(self.hidden.uop.after(*ring_stores(self.hidden, x.reshape(1, 1, -1), rows)))
    x = ring_read(after, s, p, 1).reshape(x.shape)
    pn, root = self.block.nextn, self.root
    h = (pn.shared_head_norm if pn.shared_head_norm.weight is not None else root.output_norm)(root.output_hc.head(x))
    return (pn.shared_head_head if pn.shared_head_head.weight is not None else root.output)(matmul_input(h))

  def cache_tensors(self, one: Callable[[Tensor], Tensor]) -> list[tuple[str, Tensor, int, Callable[[int], int]]]:
    whole = lambda t: lambda n, k=t.shape[1]: k
    a = self.block.attn
    return [(f"blk.{self.cfg.n_layer}.attn.raw", one(a.raw), 1, whole(a.raw)), ("nextn.hidden", one(self.hidden), 1, whole(self.hidden))]

def nextn_unsupported(cfg: DS4Config) -> str | None:
  """Why the block of a deepseek4 file with `cfg` cannot draft here (llama.cpp's graph_mtp takes the same), or None."""
  if cfg.n_nextn != 1: return f"{cfg.n_nextn} multi-token-prediction blocks (one is supported)"
  if cfg.compress_ratios[cfg.n_layer] != 0: return "the multi-token-prediction block has compressed attention (ratio 0 expected)"
  if cfg.n_layer < cfg.n_hash_layer: return "the multi-token-prediction block routes by hash"
  return None

class DS4Transformer:
  """The deepseek4 model (arch.Model). Unlike model.Transformer's row-per-position caches, the rings only let a new run
  start at position 0 or up to `max_rewind` positions before the last one written (see `check_resume`), and one forward
  takes at most PREFILL_CHUNK tokens. With several slots every cache (raw ring, compressor state and rows, the
  indexer's keys and choice) has one per slot, `[slots, ...]`, as nn/cache_rows.py lays out the others'."""
  PREFILL_CHUNK = 32  # the most tokens one forward takes (the rings' slack), and the captured prefill chunk
  PREFILL_CHUNKS = (PREFILL_CHUNK,)
  MAX_FORWARD_TOKENS: int | None = PREFILL_CHUNK
  max_rewind: int | None = PREFILL_CHUNK
  slots = 1            # sequences whose caches sit side by side (nn/cache_rows.py)
  nextn: DS4NextN | None = None  # the multi-token-prediction block, loaded for drafting

  def __init__(self, cfg: DS4Config):
    self.cfg = cfg
    self.token_embd = Embedding(cfg.n_vocab, cfg.dim)
    self.blk = [DS4Block(cfg, i) for i in range(cfg.n_layer)]
    self.output_hc = HyperConn(cfg, "output_hc", head=True)
    self.output_norm = RMSNorm(cfg.dim, cfg.norm_eps)
    self.output = Linear(cfg.dim, cfg.n_vocab)

  @classmethod
  def load(cls, cfg: DS4Config, gf: GGUFFile, device: str, max_ctx: int, numerics: str, slots: int = 1,
           mtp: bool | GGUFFile = False) -> DS4Transformer:
    """Weights, rope tables and caches (`slots` sequences side by side). `mtp`: also the multi-token-prediction block
    (DS4NextN), which every step then follows: this file's (True) or a draft file's (convert_hf_to_gguf.py --mtp)."""
    model = cls(cfg)
    load_weights(model, gf, device)
    model.max_ctx, model.settings = max_ctx, settings.Settings.for_model(device, numerics)
    C = cls.PREFILL_CHUNK
    rows = -(-(max_ctx + 2 * C + 128 * 2) // 128) * 128   # padded chunks, candidate windows; a multiple of every ratio
    main, comp = rope_table(cfg.rope, rows, device), rope_table(cfg.rope_comp, rows, device)
    conj = Tensor([1.0, -1.0], device=device)
    model.tabs = Tables(main, comp, (main * conj).realize(), (comp * conj).realize())
    for b in model.blk: b.attn.init_cache(max_ctx, C, device, model.settings.cache, slots)
    if mtp:  # families.mtp_unavailable has checked that the block's file has one this class runs
      bf = gf if mtp is True else mtp
      model.nextn = DS4NextN(cfg if bf is gf else DS4Config.from_gguf(bf))
      model.nextn.load(bf, device, max_ctx, model.settings.cache, slots)
    model.slots = slots
    return model

  @staticmethod
  def draft_mismatch(cfg: DS4Config, d: DS4Config) -> str | None:
    """Why the multi-token-prediction block of a draft file with config `d` does not fit a target with `cfg`, or None."""
    for f in ("n_layer", "dim", "n_vocab", "n_head", "head_dim", "hc", "window", "rope", "q_lora_rank", "o_groups", "o_lora_rank"):
      if getattr(d, f) != getattr(cfg, f):
        return f"its multi-token-prediction block does not fit the model ({f} {getattr(d, f)}, the model's {getattr(cfg, f)})"
    return None

  def forward(self, tokens: Tensor | UOp | list[UOp], start_pos: int | UOp | Rows, last_only: bool = False,
              select: Tensor | None = None) -> Tensor:
    """tokens `[1, T]` int32 (T <= PREFILL_CHUNK) or one token as a bound variable, at positions start_pos.. (with slots:
    nn/cache_rows.py's Rows) -> logits `[1, T, vocab]` (or `[1, 1, vocab]` for the last / the one-hot `select`ed
    position). A batched step: one token per row as bound variables, and `start_pos` the rows' slots and positions ->
    `[B, 1, vocab]`."""
    with self.settings.active():
      e = self.token_embd(tokens)
      B, T, D = e.shape
      assert T <= self.PREFILL_CHUNK, f"{T} tokens in one forward, at most {self.PREFILL_CHUNK}"
      x = e.unsqueeze(2).expand(B, T, self.cfg.hc, D)                              # every stream starts as the embedding
      for b in self.blk: x = b(x, tokens, start_pos, self.tabs)
      if self.nextn is not None: x = self.nextn.follow(tokens, x, start_pos, self.tabs)
      if last_only: x = x[:, -1:]
      if select is not None: x = (x * select.unsqueeze(-1)).sum(1, keepdim=True)
      return self.head(x)

  def head(self, x: Tensor) -> Tensor: return self.output(matmul_input(self.output_norm(self.output_hc.head(x))))  # the streams collapsed first

  def draft(self, token: UOp, start_pos: UOp | Rows) -> Tensor:
    """The multi-token-prediction block's draft step (DS4NextN): logits `[1, 1, vocab]`."""
    with self.settings.active(): return self.nextn.draft(token, start_pos, self.tabs)

  def check_resume(self, start_pos: int) -> None:
    """Raise unless the caches hold what a run from `start_pos` needs: position 0, or the raw rows of the `window`
    positions before it still in the ring (true up to PREFILL_CHUNK positions behind the last one written; the
    compressor state has the same slack). Deeper rewinds must prefill from 0."""
    if start_pos == 0: return
    a = self.blk[0].attn
    D, S = self.cfg.head_dim, a.raw.shape[1]
    cols = a.raw[0, :, D:D + 2].float().numpy().astype(np.int64)
    held = cols[:, 0] + cols[:, 1] * POS_BASE
    if any(held[p % S] != p for p in range(max(0, start_pos - self.cfg.window), start_pos)):
      raise ValueError(f"deepseek4 cannot resume at position {start_pos}: its ring caches no longer hold the {self.cfg.window} positions "
                       f"before it (resuming works up to {self.max_rewind} positions back); prefill from position 0")

  def cache_tensors(self, slot: int = 0) -> list[tuple[str, Tensor, int, Callable[[int], int]]]:
    """Every cache tensor of one slot whose contents are the state after n tokens, as (name, tensor `[1, rows, ...]`,
    row axis, rows(n)): the whole raw ring and compressor state rings (rows(n) their length), and the compressed rows of
    the windows complete after n tokens (n // ratio; the pending window's row is recomputed from the state ring by the
    step that next touches it). The state holds only the last positions written, so a saved state resumes at its own
    length (`max_rewind`), as a slot does in memory. The indexer's choice is per step, not state."""
    one = lambda t: t if self.slots == 1 else t[slot:slot + 1]
    whole = lambda t: lambda n, k=t.shape[1]: k
    out = []
    for i, b in enumerate(self.blk):
      a = b.attn
      out.append((f"blk.{i}.attn.raw", one(a.raw), 1, whole(a.raw)))
      for c in (a.compressor, a.idx_compressor):
        if c is None: continue
        out += [(f"blk.{i}.{c.name}.state", one(c.state), 1, whole(c.state)),
                (f"blk.{i}.{c.name}.rows", one(c.rows), 1, lambda n, R=c.R: n // R)]
    return out + (self.nextn.cache_tensors(one) if self.nextn is not None else [])
