"""The multi-token-prediction block (`nextn`) of deepseek2-family files: a draft head that proposes the token after next.

GGUF layout (llama.cpp's deepseek2 loader and `graph_mtp`): the block is `blk.{n_layer}`, appended after the layers
the forward runs (`{arch}.nextn_predict_layers` = 1 counts it in block_count). It is an MLA + MoE block like the others
(`attn_*`, `ffn_*`, its own latent cache), plus `blk.N.nextn.{eh_proj,enorm,hnorm}` and optionally its own
`nextn.embed_tokens` (else token_embd), `nextn.shared_head_norm` (else output_norm) and `nextn.shared_head_head` (else
output).

Semantics, as llama.cpp's MTP context runs it: the row of position p takes the token at p and the hidden state h of
position p - 1 (a zero vector at p = 0):

    x = eh_proj([enorm(embed(token_p)) ; hnorm(h_{p-1})]);   out = block(x);   h'_p = shared_head_norm(out)
    logits_p = head(h'_p)   -> the draft of the token at p + 2 (position p + 1's token is the one just fed)

h is the target's final normed hidden state (the head's input) for rows the target computed, and the block's own h'
for the drafts that follow the first. The block may come from a file of its own (convert_hf_to_gguf.py --mtp: only
`blk.N.*` and copies of the model's token_embd, output_norm and output): it then reads that file's copies (`Root`), as
llama.cpp's draft model does. The block's cache rows at the target's positions hold what the target's h gives
them, so every target step also computes this block's cache rows for its own rows (eh_proj and the cache projection
only: no attention, no experts, no head), and stores its h rows in `hidden`. A draft step then reads `hidden` at p - 1
(the target's row, or the previous draft's), runs the whole block and the head, and stores its h' at p. The target's
next step at those positions overwrites both, as it overwrites stale KV rows."""
from __future__ import annotations

from tinygrad import Tensor, UOp

from tg_ds4.config import ModelConfig
from tg_ds4.nn.cache_rows import Rows, row_stores
from tg_ds4.nn.layers import Embedding, Linear, Param, RMSNorm, matmul_input


def _optional(layer):
  """`layer` whose weight the file may leave out (the block then uses the main model's)."""
  layer.weight = Param(*layer.weight.shape, optional=True)
  return layer

class NextNParams:
  """`blk.N.nextn.*`: the projection of the normed embedding and hidden state into the block, and its own head."""
  def __init__(self, cfg: ModelConfig):
    D = cfg.dim
    self.eh_proj, self.enorm, self.hnorm = Linear(2 * D, D), RMSNorm(D, cfg.norm_eps), RMSNorm(D, cfg.norm_eps)
    self.embed_tokens = _optional(Embedding(cfg.n_vocab, D))
    self.shared_head_norm = _optional(RMSNorm(D, cfg.norm_eps))
    self.shared_head_head = _optional(Linear(D, cfg.n_vocab))

class Root:
  """The embedding, head norm and head of a file holding only the block, read where the block has no `nextn.*` copy."""
  def __init__(self, cfg):
    self.token_embd, self.output_norm, self.output = Embedding(cfg.n_vocab, cfg.dim), RMSNorm(cfg.dim, cfg.norm_eps), Linear(cfg.dim, cfg.n_vocab)

def supported(cfg: ModelConfig) -> str | None:
  """Why this config's MTP block cannot draft here, or None."""
  if not cfg.mla or cfg.idx_top_k: return "multi-token-prediction drafting runs deepseek2 files with MLA (not DSA)"
  if cfg.moe is None or not cfg.is_moe_layer(cfg.n_layer): return "the multi-token-prediction block is expected to have experts"
  return None

class NextN:
  """The block and its `nextn` parameters; `block` is a models/transformer.py Block (attention, experts, norms)."""
  def __init__(self, block, cfg: ModelConfig, root: Root | None = None):
    """`root`: the block's file's own embedding and head (a file holding only the block); None: the model's."""
    self.block, self.root = block, root
    self.block.nextn = NextNParams(cfg)

  @property
  def p(self) -> NextNParams: return self.block.nextn

  def _input(self, model, tokens, h_prev: Tensor, emb: Tensor | None = None) -> Tensor:
    """eh_proj([enorm(embed(tokens)) ; hnorm(h_prev)]) `[B, T, D]`; `emb`: the main embedding of `tokens`, if computed."""
    p, root = self.p, self.root
    if p.embed_tokens.weight is not None: e = p.embed_tokens(tokens)
    else: e = root.token_embd(tokens) if root is not None else model.token_embd(tokens) if emb is None else emb
    return p.eh_proj(matmul_input(p.enorm(e).cat(p.hnorm(h_prev), dim=-1)))

  def follow(self, model, tokens, emb: Tensor, h: Tensor, start_pos: int | UOp | Rows) -> Tensor:
    """A target step's part: store its rows' hidden states `h` `[B, T, D]` (the head's input) and the block's cache rows
    for them; returns `h` read back after both stores, so that the stores are part of whatever reads the logits."""
    rows, (B, T, _) = Rows.of(start_pos), h.shape
    prev = []
    for b, (s, p) in enumerate(rows):  # h of each row's position - 1: this step's previous row, or the stored one
      first = h[b - 1:b, -1:] if rows.continues(b) else model.hidden[s:s + 1, p:p + 1]
      prev.append(first if T == 1 else first.cat(h[b:b + 1, :-1], dim=1))
    h_prev = prev[0] if B == 1 else Tensor.cat(*prev)
    k_new = self.block.attn.new_rows(matmul_input(self.block.attn_norm(self._input(model, tokens, h_prev, emb))), start_pos, model.rope)
    stored = model.hidden[:, 1:]  # row r + 1 holds position r's hidden state; row 0 stays zero (position -1)
    after = Tensor(model.hidden.uop.after(*row_stores(stored, h, rows), *row_stores(self.block.attn.cache, k_new, rows)))[:, 1:]
    back = [after[s:s + 1, p:p + T] for s, p in rows]
    return back[0] if B == 1 else Tensor.cat(*back)

  def draft(self, model, token: UOp, start_pos: UOp | Rows) -> Tensor:
    """One draft step: the token at position p (a bound variable) -> logits `[1, 1, vocab]` of the token at p + 2,
    with this block's cache row and hidden state of p stored."""
    (s, p), = Rows.of(start_pos)
    x = self.block(self._input(model, token, model.hidden[s:s + 1, p:p + 1]), start_pos, model.rope)
    pn, root = self.p, self.root or model
    h = pn.shared_head_norm(x) if pn.shared_head_norm.weight is not None else root.output_norm(x)
    after = Tensor(model.hidden.uop.after(*row_stores(model.hidden[:, 1:], h, Rows.of(start_pos))))[:, 1:]
    h = matmul_input(after[s:s + 1, p:p + 1])
    return pn.shared_head_head(h) if pn.shared_head_head.weight is not None else root.output(h)
