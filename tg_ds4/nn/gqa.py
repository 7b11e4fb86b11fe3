"""Grouped-query attention for the dense families (llama, qwen2/3, gemma3): a K/V cache per layer, RoPE, optional
q/k/v biases (qwen2), per-head q/k RMS norms and a sliding window (gemma3), a norm before the output projection (bitnet)."""
from __future__ import annotations

from tinygrad import Device, Tensor, UOp, dtypes

from tg_ds4.backend.buffers import zeros
from tg_ds4.config import ModelConfig
from tg_ds4.nn import attention_kernel
from tg_ds4.nn.cache_rows import Rows, slot_rows, store_rows
from tg_ds4.nn.layers import Linear, RMSNorm
from tg_ds4.nn.mla import causal_mask
from tg_ds4.nn.rope import apply_rope
from tg_ds4.quant import ckernel, settings


class GQA:
  gguf_flat = True
  def __init__(self, cfg: ModelConfig, bias: bool = False, qk_norm: bool = False, window: int = 0, index: int = 0,
               kv_from: int | None = None, v_from_k: bool = False):
    """cfg as this layer sees it (ModelConfig.layer); `index` its layer; `kv_from` the layer whose KV it attends over
    instead of its own (gemma4's shared-KV layers: no k/v projections, no cache); `v_from_k`: V is the raw K projection."""
    self.cfg, self.window, self.index, self.kv_from, self.v_from_k = cfg, window, index, kv_from, v_from_k
    H, KV, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    own_kv, s = kv_from is None, cfg.weight_scales
    self.attn_q_norm = RMSNorm(D, cfg.norm_eps) if qk_norm else None
    self.attn_k_norm = RMSNorm(D, cfg.norm_eps) if qk_norm and own_kv else None
    # gpt2: q|k|v rows in one tensor; the others one projection each (none for k/v in a layer over another's KV)
    self.attn_qkv = Linear(cfg.dim, (H + KV) * D + KV * cfg.v_head_dim, bias) if cfg.fused_qkv else None
    self.attn_q = None if cfg.fused_qkv else Linear(cfg.dim, H * D, bias, s)
    self.attn_k = Linear(cfg.dim, KV * D, bias, s) if not cfg.fused_qkv and own_kv else None
    self.attn_v = Linear(cfg.dim, KV * cfg.v_head_dim, bias, s) if not cfg.fused_qkv and own_kv and not v_from_k else None
    self.attn_sub_norm = RMSNorm(H * cfg.v_head_dim, cfg.norm_eps) if cfg.sub_norm else None  # bitnet
    self.attn_output = Linear(H * cfg.v_head_dim, cfg.dim, cfg.out_bias, s)
    self.cache: Tensor | None = None
    self.attn_qk: Linear | None = None  # q|k stacked at load (models/transformer.py's Block.fuse)

  def init_cache(self, max_ctx: int, device: str | None = None, dtype=dtypes.float32, slots: int = 1):
    c = self.cfg
    if self.kv_from is None: self.cache = zeros((slots, max_ctx, c.n_kv_head, c.head_dim + c.v_head_dim), dtype, device or Device.DEFAULT)

  def __call__(self, x: Tensor, start_pos: int | UOp | Rows, rope: Tensor, kvs: dict[int, Tensor] | None = None) -> Tensor:
    """`kvs`: layer -> its cache as this forward wrote it, for layers that attend over another's (kv_from)."""
    cfg, (B, T, _), rows = self.cfg, x.shape, Rows.of(start_pos)
    H, KV, D, R = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.rope.dim
    rot = lambda t: apply_rope(t[..., :R], rope, start_pos, cfg.rope.type).cat(t[..., R:], dim=-1) if 0 < R < D else \
      apply_rope(t, rope, start_pos, cfg.rope.type) if R else t
    if self.kv_from is not None:  # gemma4's shared-KV layers: q only, over the cache the source layer wrote in this forward
      if kvs is None or self.kv_from not in kvs: raise ValueError(f"layer {self.index} attends over layer {self.kv_from}'s KV: run that layer first")
      q = self.attn_q(x).reshape(B, T, H, D)
      q = rot(self.attn_q_norm(q) if self.attn_q_norm is not None else q)
      return self._attend_rows(q, kvs[self.kv_from], rows)
    if self.attn_qkv is not None: q, k, v = self.attn_qkv(x).split([H * D, KV * D, KV * cfg.v_head_dim], dim=-1)
    elif self.attn_qk is not None: (q, k), v = self.attn_qk(x).split([H * D, KV * D], dim=-1), self.attn_v(x)  # fused at load (Block.fuse)
    else:
      q, k = self.attn_q(x), self.attn_k(x)
      v = k if self.v_from_k else self.attn_v(x)
    q, k, v = q.reshape(B, T, H, D), k.reshape(B, T, KV, D), v.reshape(B, T, KV, cfg.v_head_dim)
    if self.attn_q_norm is not None: q, k = self.attn_q_norm(q), self.attn_k_norm(k)
    if cfg.v_norm: v = v.float() * (v.float().square().mean(-1, keepdim=True) + cfg.norm_eps).rsqrt()  # gemma4: no weight
    q, k = rot(q), rot(k)
    # a chunk's v GEMM as its own kernel: fused into the cache write (beside k's RoPE) it gets no GEMM opts (kernel_opts
    # takes only a kernel shaped as a GEMM); one token's GEMV fuses fine and saves a launch
    cache = store_rows(self.cache, k.cat(v.contiguous() if T > 1 else v, dim=-1), rows)           # [slots,S,KV,D+Dv]
    if kvs is not None: kvs[self.index] = cache
    return self._attend_rows(q, cache, rows)

  def _attend_rows(self, q: Tensor, cache: Tensor, rows: Rows) -> Tensor:
    """q `[B,T,H,D]` (normed, rotated), row b over its slot's rows of `cache` -> the output projection's result."""
    o = [self._attend(q if len(rows) == 1 else q[b:b + 1], cache, s, p) for b, (s, p) in enumerate(rows)]
    # several rows: each row's output a kernel of its own; fused into their concatenation, every output element ran
    # all the rows' reductions, not just its own row's
    o = o[0] if len(o) == 1 else Tensor.cat(*(r.contiguous() for r in o))
    return self.attn_output(self.attn_sub_norm(o) if self.attn_sub_norm is not None else o)

  def _attend(self, q: Tensor, cache: Tensor, slot: int | UOp, start_pos: int | UOp) -> Tensor:
    """q `[B,T,H,D]` (normed, rotated) over rows [0, start_pos + T) of one slot of `cache` `[slots,max_ctx,KV,D+Dv]` -> `[B,T,H*Dv]`."""
    cfg, (B, T, H, D), KV, Dv = self.cfg, q.shape, cache.shape[2], self.cfg.v_head_dim
    lay, unit = attention_kernel.Layout.kv(KV, D, Dv), settings.current(cache.device).caps.c_attention
    if B == 1 and attention_kernel.applies(lay, H, cache, unit) and ckernel.bound_variable(slot) and ckernel.bound_variable(start_pos):
      # scores, softmax and attn·v in one pass over the slot's cache rows (nn/attention_kernel.py)
      return attention_kernel.attention(q[0], cache, slot, start_pos, lay, cfg.kq_scale, unit, self.window).reshape(1, T, H * Dv)
    q = q.transpose(1, 2).reshape(B, KV, H // KV, T, D)                  # heads grouped by the KV head they share
    mask = causal_mask(T, start_pos, self.window)
    if T == 1 and D % 16 == 0 and Dv % 16 == 0:
      # decode: 16 lane accumulators per score, as in quant/formats.py's linear (vector multiply-adds). No reshape touches the
      # symbolic length: the cache is split into lanes before the slot's slice, and the scores get their trailing axis
      # from q's shape, not from a reshape; across the length tinygrad indexes with an integer division and modulo by
      # it per key. Rotated q is stored once where the device's capabilities say so (rotated_q_stored), instead of rotated per key.
      S = start_pos + T
      k = slot_rows(cache.reshape(*cache.shape[:3], (D + Dv) // 16, 16), slot, S)[..., :D // 16, :]
      q16 = (q.contiguous() if settings.current(cache.device).caps.rotated_q_stored else q).reshape(B, KV, H // KV, T, 1, D // 16, 16, 1)
      k16 = k.permute(0, 2, 1, 3, 4).unsqueeze(2).unsqueeze(3).unsqueeze(-1)                                  # [1,KV,1,1,S,D/16,16,1]
      scores = (q16 * k16).sum(-3).sum(-2) * cfg.kq_scale                                                      # [B,KV,G,T,S,1]
      if mask is not None: scores = scores + mask.T
      v = slot_rows(cache, slot, S)[..., D:].permute(0, 2, 1, 3).unsqueeze(2).unsqueeze(3)                    # [1,KV,1,1,S,Dv]
      o = (scores.softmax(-2).contiguous() * v).sum(-2)                                                        # [B,KV,G,T,Dv]
      return o.reshape(B, H, T, Dv).transpose(1, 2).reshape(B, T, H * Dv)
    kv = slot_rows(cache, slot, start_pos + T)
    k, v = kv[..., :D].transpose(1, 2), kv[..., D:].transpose(1, 2)                                               # [B,KV,S,*]
    # a chunk: q is used by every key position, so materialize it once instead of recomputing its RoPE per key
    scores = (q.contiguous() @ k.unsqueeze(2).transpose(-1, -2)) * cfg.kq_scale  # [B,KV,G,T,S]
    if mask is not None: scores = scores + mask
    # stored in its own order before the heads are interleaved: a rounded input (quant/activations.py) stores it otherwise,
    # as the rows of 32-blocks its rounding reads, and the kernel then writes across heads instead of in runs
    o = (scores.softmax(-1) @ v.unsqueeze(2)).contiguous()
    return o.reshape(B, H, T, Dv).transpose(1, 2).reshape(B, T, H * Dv)
