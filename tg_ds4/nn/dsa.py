"""DeepSeek Sparse Attention (GGUF archs deepseek32: DeepSeek V3.2, glm-dsa: GLM-5): deepseek2's absorbed MLA where a
lightning indexer scores every cached position for each query and the query attends to the top-k only.

The indexer, as llama.cpp's graph computes it: queries `indexer.attn_q_b` of the MLA's normed Q LoRA latent (H_i heads of
D_i), one key per position `LayerNorm(indexer.attn_k(x))` (with bias), both rotated on their first rope.dim dims (NEOX for
deepseek32, NORM for glm-dsa) with the MLA's RoPE table; per-head weights `indexer.proj(x) / sqrt(D_i * H_i)`; score =
sum over heads of weight * relu(q . k); the k best positions among those the query may see (all of them when fewer).
llama.cpp's Hadamard rotation of q and k is orthogonal and leaves the scores unchanged, so it is not done; the keys are
cached in float32 (llama.cpp's F16 default rounds them and flips near-tied selections). glm-dsa's "shared" layers carry
no indexer and reuse the previous full layer's selection. The selection is a discrete choice, like the MoE router's: it
is computed in float32 at any precision and on the device (nn/topk.py: a fixed number of kernels, no sort)."""
from __future__ import annotations

from tinygrad import Device, Tensor, UOp, dtypes

from tg_ds4.backend.buffers import zeros
from tg_ds4.config import ModelConfig
from tg_ds4.nn.cache_rows import Rows, slot_rows, store_rows
from tg_ds4.nn.layers import LayerNorm, Linear
from tg_ds4.nn.mla import MLA
from tg_ds4.nn.rope import apply_rope
from tg_ds4.nn.topk import NEG, topk_mask
from tg_ds4.quant import settings
from tg_ds4.quant.formats import dot_lanes


class DSAIndexer:
  """`blk.i.indexer.*`: attn_q_b (queries from the Q LoRA latent), attn_k + k_norm (one key per position), proj (per-head
  weights)."""
  def __init__(self, cfg: ModelConfig):
    H, D = cfg.idx_n_head, cfg.idx_head_dim
    self.attn_q_b, self.attn_k, self.proj = Linear(cfg.q_lora_rank, H * D), Linear(cfg.dim, D), Linear(cfg.dim, H)
    self.k_norm = LayerNorm(D, cfg.idx_norm_eps)

COMPACT_BLOCK = 64  # positions per block when a decode step turns its selection into row indices (see compact)

def compact(mask: Tensor, k: int, blk: int = COMPACT_BLOCK) -> tuple[Tensor, Tensor]:
  """The positions of `mask`'s true entries `[n]` (at most k of them) as k indices, ascending, and which of the k are
  real: in-block counts, a prefix over blocks, then per slot its block (a count over the block ends) and its place in
  the block (a count in the gathered block row). Gathers and counts only, no sort or scatter: O(n*blk + k*n/blk + k*blk)."""
  n = mask.shape[0]
  nb = -(-n // blk)
  cs = mask.pad(((0, nb * blk - n),)).reshape(nb, blk).cast(dtypes.int32).cumsum(1)          # [nb, blk] inclusive counts
  ends = cs[:, -1].cumsum(0)                                                                  # [nb] entries up to each block
  j = Tensor.arange(k).reshape(k, 1)
  b = (ends.reshape(1, nb) <= j).sum(-1)                                                      # [k] the block of entry j
  bc = b.clip(0, nb - 1)
  start = (bc > 0).where(ends[(bc - 1).clip(0, nb - 1)], 0)                                    # entries before that block
  t = (cs[bc] <= (Tensor.arange(k) - start).reshape(k, 1)).sum(-1)                             # its place in the block
  return (bc * blk + t).clip(0, n - 1).cast(dtypes.int32), b < nb

class DSA(MLA):
  def __init__(self, cfg: ModelConfig, full: bool):
    super().__init__(cfg)
    self.indexer = DSAIndexer(cfg) if full else None  # glm-dsa's shared layers take the previous full layer's selection
    self.idx_cache: Tensor | None = None

  def init_cache(self, max_ctx: int, device: str | None = None, dtype=dtypes.float32, slots: int = 1):
    super().init_cache(max_ctx, device, dtype, slots)
    if self.indexer is not None: self.idx_cache = zeros((slots, max_ctx, self.cfg.idx_head_dim), dtypes.float32, device or Device.DEFAULT)

  def stored_keys(self, x: Tensor, rows: Rows, rope: Tensor) -> Tensor | None:
    """The indexer's keys of every row's new positions `LayerNorm(attn_k(x))`, rotated, stored in idx_cache at once."""
    if self.indexer is None: return None
    ix, (B, T, _), D = self.indexer, x.shape, self.cfg.idx_head_dim
    with settings.override(matmul=dtypes.float32):
      k = self._rope_head(ix.k_norm(ix.attn_k(x)).reshape(B, T, 1, D), rope, rows).reshape(B, T, D)
    return store_rows(self.idx_cache, k, rows)

  def rows(self, cache: Tensor, keys: Tensor | None, slot: int | UOp, x: Tensor, qr: Tensor | None, start_pos: int | UOp, rope: Tensor,
           shared: dict | None) -> tuple[Tensor, Tensor | None]:
    """A chunk attends over its causal rows with the unselected ones masked, as llama.cpp does. One token (decode)
    attends over the k selected rows only, gathered from the cache: its attention costs k rows, not the context."""
    T, cap, k = x.shape[1], cache.shape[1], self.cfg.idx_top_k
    if keys is not None:
      with settings.override(matmul=dtypes.float32): keep = self._select(x, qr, keys, slot, start_pos, rope)  # [T, S]
      sel = {"keep": keep}
      if T == 1 and cap > k:  # positions past the context are never selected: pad the symbolic row to the cache's rows
        sel["idx"], sel["valid"] = compact(keep[0].pad(((0, cap - keep.shape[1]),)), k)
      if shared is not None: shared["dsa"] = sel
    else:  # glm-dsa's shared layers: the previous full layer's selection
      if shared is None or "dsa" not in shared: raise ValueError("a shared DSA layer needs the previous full layer's selection")
      sel = shared["dsa"]
    if "idx" in sel: return cache[slot:slot + 1][:, sel["idx"]].unsqueeze(1), sel["valid"].where(0.0, NEG).reshape(1, k)
    return slot_rows(cache, slot, start_pos + T).unsqueeze(1), sel["keep"].where(0.0, NEG)

  def _rope_head(self, t: Tensor, rope: Tensor, start_pos: int | UOp | Rows) -> Tensor:
    """The indexer's rotation: its first rope.dim dims (the reverse of the MLA head's [nope | rope] layout)."""
    R = self.cfg.rope.dim
    return apply_rope(t[..., :R], rope, start_pos, self.cfg.idx_rope).cat(t[..., R:], dim=-1)

  def _select(self, x: Tensor, qr: Tensor, keys: Tensor, slot: int | UOp, start_pos: int | UOp, rope: Tensor) -> Tensor:
    """`[T, S]` bool: the top-k of the positions each query may see (all of them when fewer), by the indexer's `keys`
    (idx_cache with this forward's rows stored)."""
    cfg, ix, (B, T, _) = self.cfg, self.indexer, x.shape
    H, D = cfg.idx_n_head, cfg.idx_head_dim
    q = self._rope_head(ix.attn_q_b(qr).reshape(B, T, H, D), rope, start_pos)
    keys = slot_rows(keys, slot, start_pos + T)[0]                                               # [S, D]
    w = ix.proj(x) * (D * H) ** -0.5                                                              # [B, T, H]
    score = (dot_lanes(q, keys).relu() * w.unsqueeze(-1)).sum(-2)                                # [B, T, S]
    ok = Tensor.ones(T, keys.shape[0], dtype=dtypes.bool).tril(start_pos)                        # causal
    return topk_mask(score[0], ok, cfg.idx_top_k, self.idx_cache.shape[1])
