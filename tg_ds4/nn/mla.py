"""Absorbed multi-head latent attention (DeepSeek V2/V3, GLM-4.7-Flash, youtu, Kimi): one latent cache per layer.

Per token the cache holds `[rms_norm(kv_cmpr) ; rope(k_pe)]` (kv_lora + rope wide) and serves as K for every head; V is
its first kv_lora columns. `attn_k_b` is folded into the query (q_nope @ k_b) and `attn_v_b` applied after attention,
so K/V are never expanded per head (llama.cpp's deepseek2 MLA graph, as MQA with one KV head)."""
from __future__ import annotations

from tinygrad import Device, Tensor, UOp, dtypes

from tg_ds4.backend import compat
from tg_ds4.backend.buffers import zeros
from tg_ds4.config import ModelConfig
from tg_ds4.nn.cache_rows import Rows, slot_rows, store_rows
from tg_ds4.nn import attention_kernel
from tg_ds4.nn.layers import Linear, Param, Params, RMSNorm, fusable, fuse_rows, matmul_input
from tg_ds4.nn.rope import apply_rope
from tg_ds4.quant.activations import round_activations
from tg_ds4.quant.formats import QTensor, Weight, dot_lanes, linear
from tg_ds4.quant import ckernel, settings


def causal_mask(T: int, start_pos: int | UOp, window: int = 0) -> Tensor | None:
  """Additive mask `[T, start_pos+T]` for a chunk at `start_pos`: causal, and with `window` also limited to the last
  `window` positions (llama.cpp's standard sliding window: query i sees key j iff 0 <= i - j < window). None when
  nothing is masked (one token, no window). The masked value is float32's min, not -inf, so even a fully masked row
  softmaxes to finite numbers."""
  if T == 1 and not window: return None
  ones = Tensor.ones(T, start_pos + T, dtype=dtypes.bool)
  keep = ones.tril(start_pos)
  if window: keep = keep & ~ones.tril(start_pos - window)
  return keep.where(0.0, -3.4028234663852886e38)  # float32 min

def chunked_attention(q: Tensor, cache: Tensor, slot: int | UOp, pos: UOp, C: int, L: int, scale: float) -> Tensor:
  """One token's attention `[1, H, 1, L]` over rows [0, pos] of its slot of the latent `cache` `[slots, max_ctx, L+R]`,
  read as a symbolic count of chunks of C rows (compat.chunk_count; the last one masked past `pos`): each reduction
  over the rows is then over a chunk axis and a static C axis, which tinygrad's heuristic splits over a GPU's threads,
  where one loop over the symbolic rows left each head's softmax to one thread. Rows of the last chunk past the
  cache's end read as zeros."""
  n = compat.chunk_count(pos, C)
  at = Tensor.arange(int(n.vmax)).to(cache.device)[:n].reshape(n, 1) * C + Tensor.arange(C).to(cache.device).reshape(1, C)  # row numbers
  keep = at <= pos
  # rows past pos masked where they are loaded: the loads under the mask read nothing
  rows = keep.unsqueeze(-1).where(cache[slot:slot + 1].pad(((0, 0), (0, C), (0, 0)))[:, :n * C].reshape(1, 1, n, C, cache.shape[-1]), 0)
  scores = (q.reshape(1, q.shape[1], 1, 1, -1) * rows).sum(-1, dtype=dtypes.float32) * scale                   # [1,H,n,C]
  scores = keep.where(scores, -float("inf"))
  e = (scores - scores.max((-2, -1), keepdim=True)).exp()
  p = (e / e.sum((-2, -1), keepdim=True)).contiguous()
  return (p.unsqueeze(-1) * rows[..., :L]).sum((-3, -2), dtype=dtypes.float32).unsqueeze(-2)               # [1,H,1,L]

def _absorb(x: Tensor, w: Weight, gemm: bool = False) -> Tensor:
  """`linear(x, w)` for the absorb weights. A chunk unpacks each once to float32 (1-5 MB per layer), as nn/layers.py's
  Linear does for the chunk GEMMs: contracted packed, every head's weight would be unpacked once per token. The input
  is still rounded as llama.cpp rounds it for the packed format, when asked to. `gemm`: the product is a kernel of its
  own, so where the device has kernel_opts' GEMM (the CPU) the copy is laid out `[H, in, out]` for it: a GEMM per head
  holding a vector of outputs per weight load (attn_v_b). attn_k_b's product is fused into the query's concatenation
  with its rope part, which is no GEMM shape; there the `[H, out, in]` copy is the faster one, each head's output a
  dot product along a contiguous row."""
  if x.shape[-2] == 1 or not (isinstance(w, QTensor) and w.qtype.quantized): return linear(x, w)
  x, wd = round_activations(x, w.qtype.name), w.dequant(settings.current(w.device).matmul)
  if not (gemm and settings.current(w.device).caps.absorb_gemm): return linear(x, wd.contiguous())
  return linear(x, wd.transpose(-1, -2).contiguous().transpose(-1, -2))

class MLA:
  gguf_flat = True
  def __init__(self, cfg: ModelConfig):
    self.cfg, H, L, R = cfg, cfg.n_head, cfg.kv_lora_rank, cfg.rope.dim
    if cfg.q_lora_rank:
      self.attn_q_a, self.attn_q_a_norm = Linear(cfg.dim, cfg.q_lora_rank), RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
      self.attn_q_b = Linear(cfg.q_lora_rank, H * cfg.head_dim)
    else: self.attn_q = Linear(cfg.dim, H * cfg.head_dim)
    self.attn_kv_a_mqa, self.attn_kv_a_norm = Linear(cfg.dim, L + R), RMSNorm(L, cfg.norm_eps)
    self.attn_k_b, self.attn_v_b = Params(weight=Param(H, L, cfg.qk_nope)), Params(weight=Param(H, cfg.v_head_dim, L))
    self.attn_output = Linear(H * cfg.v_head_dim, cfg.dim)
    self.attn_q_kv: Linear | None = None  # q (or q_a) | kv_a stacked at load (`stack`)
    self.cache: Tensor | None = None

  def stack(self) -> None:
    """The two projections of the normed input as one weight, q (or q_a) rows then kv_a rows, where the device stacks them
    (backend.Capabilities.stacked_projections) and they are one kind (nn/layers.py fusable): one GEMV a layer. Each
    keeps a view of its rows."""
    first = self.attn_q_a if self.cfg.q_lora_rank else self.attn_q
    if settings.current(first.weight.device).caps.stacked_projections and fusable(first, self.attn_kv_a_mqa):
      self.attn_q_kv = fuse_rows(first, self.attn_kv_a_mqa)

  def _projections(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """(q or q_a of x, kv_a of x or None where `new_rows` computes it)."""
    first = self.attn_q_a if self.cfg.q_lora_rank else self.attn_q
    if self.attn_q_kv is None: return first(x), None
    y = self.attn_q_kv(x)
    return y[..., :first.weight.shape[0]], y[..., first.weight.shape[0]:]

  def init_cache(self, max_ctx: int, device: str | None = None, dtype=dtypes.float32, slots: int = 1):
    self.cache = zeros((slots, max_ctx, self.cfg.kv_lora_rank + self.cfg.rope.dim), dtype, device or Device.DEFAULT)

  def __call__(self, x: Tensor, start_pos: int | UOp | Rows, rope: Tensor, shared: dict | None = None) -> Tensor:
    """`shared`: what this forward's layers hand to later ones (the selections of nn/dsa.py's DSA)."""
    cfg, (B, T, _), rows = self.cfg, x.shape, Rows.of(start_pos)
    H, L, nope = cfg.n_head, cfg.kv_lora_rank, cfg.qk_nope
    a, kv = self._projections(x)
    qr = matmul_input(self.attn_q_a_norm(a)) if cfg.q_lora_rank else None   # the Q LoRA latent
    q = (self.attn_q_b(qr) if cfg.q_lora_rank else a).reshape(B, T, H, cfg.head_dim)
    q_pe = apply_rope(q[..., nope:], rope, start_pos, cfg.rope.type)
    # absorb k_b into the query: [B,H,T,nope] @ [H,nope,L] -> [B,H,T,L]
    q_lat = _absorb(q[..., :nope].transpose(1, 2), self.attn_k_b.weight, gemm=T > 1)
    # a batched step's rows: the absorb as its own kernel; fused into the concatenation with the rope part, its GEMV
    # over several rows loads every packed byte under the concatenation's bounds check. A chunk's: a GEMM per head
    if B > 1 or T > 1: q_lat = q_lat.contiguous()
    q = q_lat.cat(q_pe.transpose(1, 2), dim=-1)                                         # [B,H,T,L+R]
    # several rows: the query materialized once; read through the concatenation, each row's scores kernel lost its 8 lanes
    if len(rows) > 1: q = q.contiguous()

    # every row's new cache rows stored at once (one store per cache buffer per forward), before any row reads them
    cache, keys, o = store_rows(self.cache, self.new_rows(x, start_pos, rope, kv), rows), self.stored_keys(x, rows, rope), []
    if (kernel := self.attention_kernel(rows)) is not None:  # each row's attention as one C kernel (nn/attention_kernel.py)
      o = [attention_kernel.attention(q[b].transpose(0, 1), cache, s, p, *kernel).transpose(0, 1).unsqueeze(0) for b, (s, p) in enumerate(rows)]
    chunk = settings.current(self.cache.device).caps.attention_chunk if T == 1 and type(self).rows is MLA.rows else None
    for b, (s, p) in enumerate(rows if kernel is None else ()):  # each row over its own slot's rows (nn/cache_rows.py)
      one = (lambda t: t) if len(rows) == 1 else (lambda t: None if t is None else t[b:b + 1])
      if chunk and isinstance(p, UOp):
        o.append(chunked_attention(one(q), cache, s, p, chunk, L, cfg.kq_scale))
        continue
      sh = shared if len(rows) == 1 or shared is None else shared.setdefault(("row", b), {})
      k, mask = self.rows(cache, keys, s, one(x), one(qr), p, rope, sh)                # [1,1,n,L+R], [T,n]
      # 8 lanes (one 256-bit accumulator); with 16, clang left V2-Lite's 576-wide scores scalar. A chunk's too: a plain
      # matmul renders each score as one chain of dependent adds, each waiting on the one before
      scores = dot_lanes(one(q), k, 8) * cfg.kq_scale                                  # [1,H,T,n]
      if mask is not None: scores = scores + mask
      p = scores.softmax(-1)
      # a chunk's heads and tokens as one axis of rows: through the 4-D matmul, the latent rows' (symbolic) count split
      # the probabilities' address into a division and a modulo per multiply-add
      o.append(p @ k[..., :L] if T == 1 else (p.reshape(H * T, p.shape[-1]) @ k[0, 0, :, :L]).reshape(1, H, T, L))   # V = latent part of K
    o = o[0] if len(o) == 1 else Tensor.cat(*(r.contiguous() for r in o))  # each row its own kernel: nn/gqa.py's GQA._attend_rows
    o = _absorb(o, self.attn_v_b.weight, gemm=True).transpose(1, 2).reshape(B, T, H * cfg.v_head_dim)              # [B,T,H*v_head]
    # a chunk's heads laid out token-major first: read through the transpose, the attn_output GEMM's reduction splits
    # into head and value axes and misses kernel_opts' GEMM shape
    return self.attn_output(o.contiguous() if T > 1 else o)

  def new_rows(self, x: Tensor, start_pos: int | UOp | Rows, rope: Tensor, kv: Tensor | None = None) -> Tensor:
    """The cache rows `[B, T, L+R]` of the normed input `x`: `[rms_norm(kv_cmpr) ; rope(k_pe)]` (`kv`: its kv_a
    projection where the caller has it)."""
    L = self.cfg.kv_lora_rank
    kv = self.attn_kv_a_mqa(x) if kv is None else kv
    return self.attn_kv_a_norm(kv[..., :L], per_element=True).cat(apply_rope(kv[..., L:], rope, start_pos, self.cfg.rope.type), dim=-1)

  def attention_kernel(self, rows: Rows) -> tuple | None:
    """(layout, scale, vector unit) for nn/attention_kernel.py's C kernel where the rows' attention takes it: on a device
    that has it, over all of a slot's cache rows (this class's `rows`; DSA's selected ones are not a prefix), at an int
    or variable position and slot; else None."""
    cfg, unit = self.cfg, settings.current(self.cache.device).caps.c_attention
    lay = attention_kernel.Layout.latent(cfg.kv_lora_rank + cfg.rope.dim, cfg.kv_lora_rank)
    ok = type(self).rows is MLA.rows and attention_kernel.applies(lay, cfg.n_head, self.cache, unit) and \
      all(ckernel.bound_variable(s) and ckernel.bound_variable(p) for s, p in rows)
    return (lay, cfg.kq_scale, unit) if ok else None

  def stored_keys(self, x: Tensor, rows: Rows, rope: Tensor) -> Tensor | None:
    """A second per-position cache some attentions keep (nn/dsa.py's DSA indexer keys) with this forward's rows stored; None."""
    return None

  def rows(self, cache: Tensor, keys: Tensor | None, slot: int | UOp, x: Tensor, qr: Tensor | None, start_pos: int | UOp, rope: Tensor,
           shared: dict | None) -> tuple[Tensor, Tensor | None]:
    """The latent rows one sequence's queries attend over `[1, 1, n, L+R]` (all of its slot of `cache` `[slots,
    max_ctx, L+R]` up to the last new position) and their additive mask `[T, n]` (causal; None when nothing is
    masked). nn/dsa.py's DSA picks fewer, by the indexer `keys` (stored_keys)."""
    T = x.shape[1]
    return slot_rows(cache, slot, start_pos + T).unsqueeze(1), causal_mask(T, start_pos)
