"""Grouped-query attention for the dense families (llama, qwen2/3, gemma3): a K/V cache per layer, RoPE, optional
q/k/v biases (qwen2), per-head q/k RMS norms and a sliding window (gemma3), a norm before the output projection (bitnet)."""
from __future__ import annotations

from tinygrad import Device, Tensor, UOp, dtypes

from tg_ds4.config import ModelConfig
from tg_ds4.layers import Linear, RMSNorm, zeros
from tg_ds4.mla import causal_mask, write_cache
from tg_ds4.rope import apply_rope


class GQA:
  gguf_flat = True
  def __init__(self, cfg: ModelConfig, bias: bool = False, qk_norm: bool = False, window: int = 0):
    self.cfg, self.window, H, KV, D = cfg, window, cfg.n_head, cfg.n_kv_head, cfg.head_dim
    if qk_norm: self.attn_q_norm, self.attn_k_norm = RMSNorm(D, cfg.norm_eps), RMSNorm(D, cfg.norm_eps)
    s = cfg.weight_scales
    if cfg.fused_qkv: self.attn_qkv = Linear(cfg.dim, (H + KV) * D + KV * cfg.v_head_dim, bias)  # gpt2: q|k|v rows in one tensor
    else:
      self.attn_q, self.attn_k = Linear(cfg.dim, H * D, bias, s), Linear(cfg.dim, KV * D, bias, s)
      self.attn_v = Linear(cfg.dim, KV * cfg.v_head_dim, bias, s)
    if cfg.sub_norm: self.attn_sub_norm = RMSNorm(H * cfg.v_head_dim, cfg.norm_eps)  # bitnet
    self.attn_output = Linear(H * cfg.v_head_dim, cfg.dim, cfg.out_bias, s)
    self.cache: Tensor | None = None

  def init_cache(self, max_ctx: int, device: str | None = None, dtype=dtypes.float32):
    c = self.cfg
    self.cache = zeros((1, max_ctx, c.n_kv_head, c.head_dim + c.v_head_dim), dtype, device or Device.DEFAULT)

  def __call__(self, x: Tensor, start_pos: int | UOp, rope: Tensor) -> Tensor:
    cfg, (B, T, _) = self.cfg, x.shape
    H, KV, D, R = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.rope.dim
    if hasattr(self, "attn_qkv"): q, k, v = self.attn_qkv(x).split([H * D, KV * D, KV * cfg.v_head_dim], dim=-1)
    elif hasattr(self, "attn_qk"): (q, k), v = self.attn_qk(x).split([H * D, KV * D], dim=-1), self.attn_v(x)  # fused at load (Block.fuse)
    else: q, k, v = self.attn_q(x), self.attn_k(x), self.attn_v(x)
    q, k, v = q.reshape(B, T, H, D), k.reshape(B, T, KV, D), v.reshape(B, T, KV, cfg.v_head_dim)
    if hasattr(self, "attn_q_norm"): q, k = self.attn_q_norm(q), self.attn_k_norm(k)
    if 0 < R < D:
      q = apply_rope(q[..., :R], rope, start_pos, cfg.rope.type).cat(q[..., R:], dim=-1)
      k = apply_rope(k[..., :R], rope, start_pos, cfg.rope.type).cat(k[..., R:], dim=-1)
    elif R: q, k = apply_rope(q, rope, start_pos, cfg.rope.type), apply_rope(k, rope, start_pos, cfg.rope.type)
    # a chunk's v GEMM as its own kernel: fused into the cache write (beside k's RoPE) it gets no GEMM opts (qwen2.5,
    # 32 tokens: 3.8 ms -> 0.4 ms); one token's GEMV fuses fine and saves a launch
    kv = write_cache(self.cache, k.cat(v.contiguous() if T > 1 else v, dim=-1), start_pos)                     # [B,S,KV,D+Dv]
    k, v = kv[..., :D].transpose(1, 2), kv[..., D:].transpose(1, 2)                                               # [B,KV,S,*]
    q = q.transpose(1, 2).reshape(B, KV, H // KV, T, D)                  # heads grouped by the KV head they share
    if T == 1 and D % 16 == 0:  # decode: 16 lane accumulators per score, as in quant.linear (vector multiply-adds)
      prod = (q.unsqueeze(-2) * k.unsqueeze(2).unsqueeze(3)).reshape(B, KV, H // KV, T, k.shape[2], D // 16, 16)
      scores = prod.sum(-2).sum(-1) * cfg.kq_scale
    else:  # a chunk: q is used by every key position, so materialize it once instead of recomputing its RoPE per key
      scores = (q.contiguous() @ k.unsqueeze(2).transpose(-1, -2)) * cfg.kq_scale  # [B,KV,G,T,S]
    if (mask := causal_mask(T, start_pos, self.window)) is not None: scores = scores + mask
    o = (scores.softmax(-1) @ v.unsqueeze(2)).reshape(B, H, T, cfg.v_head_dim).transpose(1, 2).reshape(B, T, H * cfg.v_head_dim)
    return self.attn_output(self.attn_sub_norm(o) if hasattr(self, "attn_sub_norm") else o)
