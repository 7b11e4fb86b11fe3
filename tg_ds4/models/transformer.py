"""Transformer assembled from the config: token embedding, blocks (MLA or GQA attention; dense or MoE FFN), head.

Module attributes carry GGUF tensor names, so `load_weights` fills them with packed tensors straight from the file."""
from __future__ import annotations

import dataclasses, math
from collections.abc import Callable

import numpy as np

from tinygrad import Tensor, UOp, dtypes

from tg_ds4.backend import compat
from tg_ds4.backend.buffers import zeros
from tg_ds4.config import ModelConfig
from tg_ds4.io.gguf import GGUFError, GGUFFile
from tg_ds4.models import nextn, widen
from tg_ds4.nn.cache_rows import Rows
from tg_ds4.nn.dsa import DSA
from tg_ds4.nn.gqa import GQA
from tg_ds4.nn.layers import Embedding, LayerNorm, Linear, Param, Params, RMSNorm, fusable, fuse_rows, load_weights, matmul_input
from tg_ds4.nn.mla import MLA
from tg_ds4.nn.moe import FFN, MoE
from tg_ds4.nn.rope import rope_table
from tg_ds4.quant import settings
from tg_ds4.quant.formats import QTensor, as_tensor


class Block:
  def __init__(self, cfg: ModelConfig, i: int):
    self.swa, lc = cfg.is_swa_layer(i), cfg.layer(i)
    Norm = LayerNorm if cfg.layer_norm else RMSNorm
    self.attn_norm, self.ffn_norm = Norm(cfg.dim, cfg.norm_eps), Norm(cfg.dim, cfg.norm_eps)
    # gemma's sandwich norms: the sublayer outputs are normed before the residual add
    sandwich = (RMSNorm(cfg.dim, cfg.norm_eps), RMSNorm(cfg.dim, cfg.norm_eps)) if cfg.sandwich_norm else (None, None)
    self.post_attention_norm, self.post_ffw_norm = sandwich
    mla = (DSA(cfg, cfg.idx_full[i]) if cfg.idx_top_k else MLA(cfg)) if cfg.mla else None
    self.attn = mla or GQA(lc, bias=cfg.attn_bias, qk_norm=cfg.qk_norm, window=cfg.swa_window * self.swa, index=i,
                                             kv_from=cfg.kv_source(i), v_from_k=bool(cfg.v_from_k) and cfg.v_from_k[i])
    if cfg.is_moe_layer(i): self.ffn = MoE(cfg.dim, cfg.moe, fused_gate_up=cfg.fused_gate_up_exps, has_bias=cfg.expert_bias)
    else: self.ffn = FFN(cfg.dim, lc.ff_dim, act=cfg.ffn_act, gated=cfg.ffn_gated, sub_norm_eps=cfg.norm_eps if cfg.sub_norm else None,
                         scaled=cfg.weight_scales)
    # gemma4's per-layer embeddings, gated by the block's output and added after the FFN
    P = cfg.per_layer_dim
    self.inp_gate, self.proj, self.post_norm = (Linear(cfg.dim, P), Linear(P, cfg.dim), RMSNorm(cfg.dim, cfg.norm_eps)) if P else (None, None, None)
    self.layer_output_scale = Params(weight=Param(1)) if cfg.layer_output_scale else None

  def fuse(self) -> None:
    """Dense GQA blocks: q|k as one GEMV, gate|up as one GEMV. A fused kernel of the gate and up GEMVs (tinygrad's
    choice) keeps vector accumulators for only one of its two reductions; one GEMV over the stacked rows keeps them for
    every row but needs the activation as a kernel of its own. Fusing q|k pays that kernel back, so both happen or
    neither does (the block's kernel budget holds). MLA blocks stack their input projections where the device does (MLA.stack)."""
    if isinstance(self.attn, MLA): self.attn.stack()
    if self.attn.__class__ is not GQA or self.ffn.__class__ is not FFN or self.attn.attn_qkv is not None or not self.ffn.gated: return
    if self.attn.attn_v is None: return  # gemma4: a layer over another's KV, or with V from the K projection
    a, f = self.attn, self.ffn
    if fusable(a.attn_q, a.attn_k) and fusable(f.ffn_gate, f.ffn_up):
      a.attn_qk, f.ffn_gate_up = fuse_rows(a.attn_q, a.attn_k), fuse_rows(f.ffn_gate, f.ffn_up)

  def __call__(self, x: Tensor, start_pos: int | UOp, rope: Tensor, kvs: dict[int, Tensor] | None = None,
               per_layer: Tensor | None = None) -> Tensor:
    """`kvs`: what this forward's earlier layers hand to later ones (gemma4's KV by layer, DSA's selection);
    `per_layer`: this layer's per-layer embedding input `[B, T, per_layer_dim]` (gemma4)."""
    post = self.post_attention_norm is not None
    a = self.attn(matmul_input(self.attn_norm(x)), start_pos, rope, kvs)
    h = x + (self.post_attention_norm(a) if post else a)
    f = self.ffn(matmul_input(self.ffn_norm(h)))
    out = h + (self.post_ffw_norm(f) if post else f)
    if self.inp_gate is not None:
      if per_layer is None: raise ValueError("a block with per-layer embeddings needs its per-layer input")
      out = out + self.post_norm(self.proj((self.inp_gate(out).gelu() * per_layer).contiguous()))
    if self.layer_output_scale is not None: out = out * as_tensor(self.layer_output_scale.weight)
    # contiguous: one barrier per block keeps the residual stream materialised, so the scheduler partitions the graph
    # block by block instead of fusing across blocks (which explodes kernel count and recomputes norms)
    return out.contiguous()

class Transformer:
  """The deepseek2 and dense models (models/families.py's Model): one cache row per position, so any cached prefix can
  be resumed."""
  # tokens per captured prefill step, one capture per size: a prompt goes in chunks of the largest size and its tail
  # in the smallest size that holds it (padded). Bigger chunks reuse each unpacked weight for more tokens (one chunk of
  # 64 unpacks each weight once, two of 32 twice); a tail never pads to more than the next size up.
  PREFILL_CHUNKS = (32, 64, 128)
  PREFILL_CHUNK = PREFILL_CHUNKS[-1]  # the most tokens one chunk writes: the cache's slack rows past max_ctx
  MAX_FORWARD_TOKENS: int | None = None  # a forward takes any number of tokens
  max_rewind: int | None = None          # a run may start at any cached position
  slots = 1                              # sequences whose caches sit side by side (nn/cache_rows.py)
  nextn: nextn.NextN | None = None       # the multi-token-prediction block, loaded for drafting (models/nextn.py)

  def __init__(self, cfg: ModelConfig):
    self.cfg = cfg
    self.token_embd = Embedding(cfg.n_vocab, cfg.dim)
    if cfg.pos_embd: self.position_embd = Embedding(cfg.ctx_len, cfg.dim)
    self.blk = [Block(cfg, i) for i in range(cfg.n_layer)]
    if P := cfg.per_layer_dim:  # gemma4: each layer's slice of a per-token embedding, mixed with a projection of the input
      self.per_layer_token_embd = Embedding(cfg.n_vocab, cfg.n_layer * P)
      self.per_layer_model_proj, self.per_layer_proj_norm = Linear(cfg.dim, cfg.n_layer * P), RMSNorm(P, cfg.norm_eps)
    self.output_norm = (LayerNorm if cfg.layer_norm else RMSNorm)(cfg.dim, cfg.norm_eps)
    self.output = Linear(cfg.dim, cfg.n_vocab)

  @classmethod
  def load(cls, cfg: ModelConfig, gf: GGUFFile, device: str, max_ctx: int, numerics: str, slots: int = 1,
           mtp: bool | GGUFFile = False) -> Transformer:
    """Weights from the file (packed; see nn/layers.py's load_weights), CPU re-encodings, caches (`slots` sequences side by
    side: nn/cache_rows.py) and rope tables. `mtp`: also the multi-token-prediction block, which every step then
    follows (models/nextn.py): this file's (True) or that of a file holding only the block (convert_hf_to_gguf.py --mtp)."""
    model = cls(cfg)
    rename = {} if "output.weight" in gf else {"output.weight": "token_embd.weight"}  # tied embeddings
    for i, b in enumerate(model.blk):
      if cfg.mla and f"blk.{i}.attn_k_b.weight" not in gf: _split_kv_b(b.attn, gf, i, device)
    load_weights(model, gf, device, rename)
    if mtp:  # families.mtp_unavailable has checked that the block's file has one this class runs
      bf, n = gf if mtp is True else mtp, cfg.n_layer
      root = None if bf is gf else nextn.Root(cfg)
      model.nextn = nextn.NextN(Block(cfg, n), cfg, root)
      if f"blk.{n}.attn_k_b.weight" not in bf: _split_kv_b(model.nextn.block.attn, bf, n, device)
      load_weights(model.nextn.block, bf, device, prefix=f"blk.{n}.")
      if root is not None: load_weights(root, bf, device)
    model.settings = settings.Settings.for_model(device, numerics)
    widen.prepare(model, model.settings)
    for b in model.blk:
      b.fuse()
      compat.release_freed_buffers(device)  # the rows it replaced, if they were in memory (a quantized checkpoint)
    widen.interleave(model, model.settings, gf.release)
    model.max_ctx = max_ctx
    rows = max_ctx + cls.PREFILL_CHUNK  # slack for the padded tail of the last prefill chunk
    model.rope = rope_table(cfg.rope, rows, device, _rope_freqs(gf, cfg.rope.dim)) if cfg.rope.dim else None
    if cfg.pos_embd:  # float rows, with zero rows for a padded chunk's tail past the last position
      w = model.position_embd.weight
      w = w.dequant(dtypes.float32) if isinstance(w, QTensor) else w.float()
      model.pos_rows = w.pad(((0, rows - cfg.ctx_len), None)).contiguous().realize()
    # the sliding-window layers: their own base (and gemma4's own rotated dims), never the global layers' linear scaling
    # (llama.cpp's rope_freq_scale_train_swa stays 1 for gemma3/gemma4: Gemma 3 4B-27B files say factor 8 for the rest)
    rope_swa = dataclasses.replace(cfg.rope, base=cfg.rope_base_swa, dim=cfg.rope_dim_swa or cfg.rope.dim, freq_scale=1.0)
    model.rope_swa = rope_table(rope_swa, rows, device) if cfg.swa_layers else None
    for b in model.blocks(): b.attn.init_cache(rows, device, model.settings.cache, slots)
    if model.nextn is not None:  # row r + 1: position r's final hidden state; row 0 stays zero (models/nextn.py)
      model.hidden = zeros((slots, rows + 1, cfg.dim), dtypes.float32, device)
    model.slots = slots
    return model

  def blocks(self) -> list[Block]:
    """The blocks the forward runs, and the multi-token-prediction block when loaded."""
    return self.blk + ([self.nextn.block] if self.nextn is not None else [])

  def forward(self, tokens: Tensor | UOp | list[UOp], start_pos: int | UOp | Rows, last_only: bool = False,
              select: Tensor | None = None) -> Tensor:
    """tokens `[1, T]` int32 (or one token as a bound variable) at positions start_pos.. -> logits `[1, T, vocab]`;
    `[1, 1, vocab]` for the last position
    (last_only) or for the position picked by the one-hot `select` `[1, T, 1]` (a JIT input, unlike a Python index).
    A batched step: one token per row as bound variables, and `start_pos` the rows' slots and positions (nn/cache_rows.py's
    Rows) -> `[B, 1, vocab]`."""
    with self.settings.active():
      x = emb = self.token_embd(tokens)
      if self.cfg.embed_scale != 1.0: x = x * self.cfg.embed_scale
      if self.cfg.pos_embd: x = x + Rows.of(start_pos).table(self.pos_rows, x.shape[1])
      if self.cfg.per_layer_dim and isinstance(tokens, list): pl = Tensor.cat(*[self.per_layer_inputs(t, x[b:b + 1]) for b, t in enumerate(tokens)])
      else: pl = self.per_layer_inputs(tokens, x) if self.cfg.per_layer_dim else None
      kvs = {}
      for i, b in enumerate(self.blk): x = b(x, start_pos, self.rope_swa if b.swa else self.rope, kvs, None if pl is None else pl[:, :, i])
      h = self.output_norm(x)
      if self.nextn is not None: h = self.nextn.follow(self, tokens, emb, h, start_pos)
      if last_only: h = h[:, -1:]
      if select is not None: h = (h * select).sum(1, keepdim=True)
      return self.project(h)

  def per_layer_inputs(self, tokens: Tensor | UOp, x: Tensor) -> Tensor:
    """gemma4: every layer's per-layer input `[B, T, n_layer, P]` from the token's row of per_layer_token_embd and a
    normed projection of the scaled token embedding `x`, as llama.cpp's graph (and transformers) mix them."""
    L, P, D = self.cfg.n_layer, self.cfg.per_layer_dim, self.cfg.dim
    t = self.per_layer_token_embd(tokens) * math.sqrt(P)
    p = self.per_layer_proj_norm((self.per_layer_model_proj(x) * (1 / math.sqrt(D))).reshape(*x.shape[:2], L, P))
    return ((p + t.reshape(*x.shape[:2], L, P)) * (1 / math.sqrt(2))).contiguous()

  def head(self, x: Tensor) -> Tensor: return self.project(self.output_norm(x))

  def project(self, h: Tensor) -> Tensor:
    """The normed hidden state -> logits."""
    logits = self.output(matmul_input(h))
    return (logits / (c := self.cfg.logit_softcap)).tanh() * c if self.cfg.logit_softcap else logits

  def draft(self, token: UOp, start_pos: UOp | Rows) -> Tensor:
    """The multi-token-prediction block's draft step (models/nextn.py): logits `[1, 1, vocab]`."""
    with self.settings.active(): return self.nextn.draft(self, token, start_pos)

  def check_resume(self, start_pos: int) -> None: pass  # every row of a cached prefix stays in the cache

  def cache_tensors(self, slot: int = 0) -> list[tuple[str, Tensor, int, Callable[[int], int]]]:
    """Every KV-cache tensor of one slot as (name, tensor `[1, rows, ...]`, row axis, rows(n) = n): rows [0:n] along
    that axis are the state after n tokens, so a prefix can be saved and restored without knowing the attention class
    (nor the slot: the shapes are those of a model with one slot)."""
    one = lambda t: t if self.slots == 1 else t[slot:slot + 1]
    prefix = lambda n: n
    bs = self.blocks()
    return [(f"blk.{i}.attn.cache", one(b.attn.cache), 1, prefix) for i, b in enumerate(bs) if b.attn.cache is not None] + \
      [(f"blk.{i}.attn.idx_cache", one(b.attn.idx_cache), 1, prefix) for i, b in enumerate(bs)
       if getattr(b.attn, "idx_cache", None) is not None] + \
      ([("hidden", one(self.hidden), 1, lambda n: n + 1)] if self.nextn is not None else [])

def _rope_freqs(gf: GGUFFile, dim: int) -> np.ndarray | None:
  """The file's `rope_freqs.weight` (llama 3.1+: one divisor per rotated pair), or None."""
  if "rope_freqs.weight" not in gf: return None
  if (got := gf.infos["rope_freqs.weight"].shape) != (dim // 2,):
    raise GGUFError(f"{gf.path}: tensor 'rope_freqs.weight' has shape {list(got)}, expected {[dim // 2]}")
  return gf.tensor("rope_freqs.weight", "CPU").dequant(dtypes.float32).numpy()

def _split_kv_b(attn: MLA, gf: GGUFFile, i: int, device: str) -> None:
  """Old GGUFs store `attn_kv_b` [H*(nope+v), kv_lora]; split it into the absorbed k_b [H, kv_lora, nope] and
  v_b [H, v, kv_lora] once at load (lazily: the dequant fuses into the first consumer)."""
  name, cfg = f"blk.{i}.attn_kv_b.weight", attn.cfg
  if name not in gf: raise GGUFError(f"{gf.path}: missing tensor 'blk.{i}.attn_k_b.weight' (and no legacy {name!r} to split)")
  H, nope, v, L = cfg.n_head, cfg.qk_nope, cfg.v_head_dim, cfg.kv_lora_rank
  if (got := gf.infos[name].shape) != (H * (nope + v), L):
    raise GGUFError(f"{gf.path}: tensor {name!r} has shape {list(got)}, expected {[H * (nope + v), L]}")
  w = gf.tensor(name, device).dequant(dtypes.float32).reshape(H, nope + v, L)
  attn.attn_k_b.weight = w[:, :nope].transpose(1, 2).contiguous().realize()
  attn.attn_v_b.weight = w[:, nope:].contiguous().realize()
