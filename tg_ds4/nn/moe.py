"""Feed-forward blocks: dense SwiGLU and DeepSeek-style mixture of experts, routed entirely on the device.

Routing follows llama.cpp's build_moe_ffn: gating (softmax / sigmoid / softmax-over-selected / sqrt-softplus), the
`exp_probs_b` bias for selection only, group-limited selection (top-2 sum per group), optional weight normalisation and
scale. Top-k is a rank count (a constant number of small kernels, no sort, no host round trip); the selected ids
index the packed expert tensors, so only the chosen experts' bytes are read."""
from __future__ import annotations

from tinygrad import Tensor, dtypes

from tg_ds4.config import Gating, MoEConfig
from tg_ds4.nn.layers import Linear, Param, Params, RMSNorm
from tg_ds4.quant import intdot, settings
from tg_ds4.quant.formats import as_tensor, linear


def _rank(x: Tensor) -> Tensor:
  """Rank of each entry along the last axis: how many entries beat it (0 = largest; ties go to the lower index)."""
  n = x.shape[-1]
  i, j = Tensor.arange(n).reshape(n, 1), Tensor.arange(n).reshape(1, n)
  xi, xj = x.unsqueeze(-1), x.unsqueeze(-2)
  return ((xj > xi) | ((xj == xi) & (j < i))).sum(-1)

def _topk_onehot(x: Tensor, k: int) -> Tensor:
  """`[..., k, n]` bool: entry i of the last axis has rank r."""
  return _rank(x).unsqueeze(-2) == Tensor.arange(k).reshape(k, 1)

def topk_ids(x: Tensor, k: int) -> Tensor:
  """Indices `[..., k]` of the k largest values along the last axis, largest first; ties go to the lower index."""
  return _topk_onehot(x, k).where(Tensor.arange(x.shape[-1]), 0).sum(-1).cast(dtypes.int32)

def topk_ids_values(x: Tensor, k: int, values: Tensor) -> tuple[Tensor, Tensor]:
  """topk_ids(x, k) and `values` at those ids, from one reduce: the one-hot selects (id, value) pairs together, so the
  gather costs no kernel of its own. Ids pass through float32, exact below 2**24."""
  pairs = Tensor.arange(x.shape[-1]).float().expand(values.shape).stack(values.float(), dim=-1)  # [..., n, 2]
  sel = _topk_onehot(x, k).unsqueeze(-1).where(pairs.unsqueeze(-3), 0.0).sum(-2)                 # [..., k, 2]
  return sel[..., 0].cast(dtypes.int32), sel[..., 1]

TILE_ROWS = 4  # tokens per expert tile of a chunk: kernel_opts holds up to GEMV_ROWS rows of a packed GEMV in registers
# what a tile's GEMVs cost in one-pair GEMVs (a tile reads its expert's packed bytes once, but multiplies every unpacked
# value into TILE_ROWS rows), as measured on V2-Lite's Q4_0 experts over a 128-token chunk
TILE_COST = 2

# integer-dot tiles cost no more than their pairs' GEMVs, but grouping the pairs by expert takes a few kernels more and
# the tiles' padding rows pass through the row-wise kernels between the GEMVs: chunks only, not a decode step nor a
# batched one (serve's at most 8 slots), whose captures would compile them for every slot count
TILED_TOKENS = 16

def expert_tiles(pairs: int, n_expert: int) -> int:
  """Tiles of TILE_ROWS rows that hold `pairs` (token, expert) pairs grouped by expert, whatever the routing: each
  expert's pairs fill whole tiles but its last, and every tile holds a pair (so at most one tile per pair)."""
  return min(pairs, -(-pairs // TILE_ROWS) + n_expert)

def _tiles_each(e: Tensor, n_expert: int) -> tuple[Tensor, Tensor]:
  """(each pair's expert one-hot `[P, E]`, the tiles each expert's pairs fill `[E]`)."""
  onehot = e.unsqueeze(-1) == Tensor.arange(n_expert)
  return onehot, (onehot.sum(0) + TILE_ROWS - 1) // TILE_ROWS

def group_by_expert(e: Tensor, n_expert: int, n_tiles: int) -> tuple[Tensor, Tensor, Tensor]:
  """A chunk's (token, expert) pairs (`e` `[P]`: each pair's expert) grouped by expert into `n_tiles` tiles of TILE_ROWS
  rows, on the device with static shapes (counts, ranks and prefix sums as compares and sums): expert e's pairs fill
  tiles start_e .. in pair order, so each tile holds one expert. -> (each tile's expert `[n_tiles]`, each tile row's pair
  `[n_tiles, TILE_ROWS]`, each pair's row `[P]`). A row no pair fills reads pair 0 and is never read back; the tiles
  after the last used one take expert n_expert - 1 (their bytes come from memory once, then from cache)."""
  R, ar = TILE_ROWS, Tensor.arange(e.shape[0])
  onehot, tiles = _tiles_each(e, n_expert)                                                    # [P, E], [E]
  ex = Tensor.arange(n_expert)
  end = (ex.unsqueeze(1) >= ex.unsqueeze(0)).where(tiles.unsqueeze(0), 0).sum(-1)            # [E]: inclusive prefix sums
  rank = ((e.unsqueeze(0) == e.unsqueeze(1)) & (ar.unsqueeze(0) < ar.unsqueeze(1))).sum(-1)  # [P]: earlier pairs of its expert
  slot = onehot.where((end - tiles).unsqueeze(0), 0).sum(-1) * R + rank                      # [P]
  tile_expert = (end.unsqueeze(0) <= Tensor.arange(n_tiles).unsqueeze(1)).sum(-1).minimum(n_expert - 1)
  pair = (slot.unsqueeze(0) == Tensor.arange(n_tiles * R).unsqueeze(1)).where(ar, 0).sum(-1)  # [n_tiles * R]
  return tile_expert.cast(dtypes.int32), pair.reshape(n_tiles, R).cast(dtypes.int32), slot.cast(dtypes.int32)

def tile_rows(slot: Tensor, n_tiles: int) -> Tensor:
  """`[n_tiles]` int32: how many of each tile's TILE_ROWS rows hold a pair (group_by_expert's `slot`: each pair's row;
  an expert's pairs fill its tiles' rows in order), 0 for the tiles that only pad the static tile count."""
  filled = (slot.unsqueeze(0) == Tensor.arange(n_tiles * TILE_ROWS).unsqueeze(1)).any(-1)                 # [n_tiles * R]
  return filled.reshape(n_tiles, TILE_ROWS).cast(dtypes.int32).sum(-1).cast(dtypes.int32)

def _swiglu(g: Tensor, u: Tensor, act: str = "silu") -> Tensor:
  """act(gate) * up as three kernels' worth of barriers: the gate GEMV alone, the up GEMV with the activation as its
  epilogue, materialised for the down projection (which would otherwise recompute it per output row). Left to itself
  tinygrad fuses the gate and up GEMVs into one kernel with two reductions, which keeps vector accumulators for only
  one of them (V2-Lite's dense FFN, shared and routed experts alike), where each GEMV alone keeps them for its whole
  reduction."""
  g = g.contiguous()
  return ((g.gelu() if act == "gelu" else g.silu()) * u).contiguous()

class FFN:
  """SwiGLU: down(silu(gate(x)) * up(x)) (GeGLU with gelu-tanh for gemma). Also the shared expert (`*_shexp`).
  bitnet: down(ffn_sub_norm(silu(gate(x)) * up(x))), each projection optionally times its own `.scale`."""
  gguf_flat = True
  def __init__(self, dim: int, hidden: int, suffix: str = "", act: str = "silu", gated: bool = True, sub_norm_eps: float | None = None,
               scaled: bool = False):
    self.suffix, self.act, self.gated = suffix, act, gated
    if not gated:  # gpt2: down(gelu(up(x))), both with biases
      self.ffn_up, self.ffn_down = Linear(dim, hidden, bias=True), Linear(hidden, dim, bias=True)
    else:
      for n, (i, o) in {"gate": (dim, hidden), "up": (dim, hidden), "down": (hidden, dim)}.items():
        setattr(self, f"ffn_{n}{suffix}", Linear(i, o, scale=scaled))
    self.ffn_sub_norm = RMSNorm(hidden, sub_norm_eps) if sub_norm_eps is not None else None  # bitnet
    self.ffn_gate_up: Linear | None = None  # gate|up stacked at load (models/transformer.py's Block.fuse)
  def __call__(self, x: Tensor) -> Tensor:
    s = self.suffix
    if not self.gated: return self.ffn_down(self.ffn_up(x).gelu().contiguous())  # materialised: see _swiglu
    if self.ffn_gate_up is not None:  # fused at load (Block.fuse): one GEMV, then the activation as its own kernel,
      g, u = self.ffn_gate_up(x).split(2 * [self.ffn_up.weight.shape[0]], dim=-1)  # else ffn_down recomputes it per row
      h = ((g.gelu() if self.act == "gelu" else g.silu()) * u).contiguous()
    else: h = _swiglu(getattr(self, f"ffn_gate{s}")(x), getattr(self, f"ffn_up{s}")(x), self.act)
    return getattr(self, f"ffn_down{s}")(self.ffn_sub_norm(h) if self.ffn_sub_norm is not None else h)

class MoE:
  gguf_flat = True
  def __init__(self, dim: int, cfg: MoEConfig, fused_gate_up: bool = False, has_bias: bool = False):
    E, D, F = cfg.n_expert, dim, cfg.expert_ff_dim
    self.cfg = cfg
    self.ffn_gate_inp = Linear(D, E)
    self.exp_probs_b = Params(bias=Param(E)) if has_bias else None  # V3-style selection bias
    self.ffn_gate_up_exps = Params(weight=Param(E, 2 * F, D)) if fused_gate_up else None
    self.ffn_gate_exps, self.ffn_up_exps = (None, None) if fused_gate_up else (Params(weight=Param(E, F, D)), Params(weight=Param(E, F, D)))
    self.ffn_down_exps = Params(weight=Param(E, D, F))
    self.shexp = FFN(D, F * cfg.n_expert_shared, "_shexp") if cfg.n_expert_shared else None

  def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
    """x `[B,T,D]` -> (expert ids `[B,T,k]` int32, weights `[B,T,k]`)."""
    with settings.override(matmul=dtypes.float32): logits = self.ffn_gate_inp(x)  # the expert choice in float32 at any precision
    cfg = self.cfg
    probs = {Gating.SOFTMAX: lambda: logits.softmax(-1), Gating.SIGMOID: lambda: logits.sigmoid(), Gating.SOFTMAX_WEIGHT: lambda: logits,
             Gating.SQRT_SOFTPLUS: lambda: logits.softplus().sqrt()}[cfg.gating]()
    sel = probs + as_tensor(self.exp_probs_b.bias) if self.exp_probs_b is not None else probs
    if cfg.n_group > 1:
      G = cfg.n_group
      grouped = sel.reshape(*sel.shape[:-1], G, cfg.n_expert // G)
      top2 = topk_ids_values(grouped, 2, grouped)[1].sum(-1)                       # group score: sum of its best two
      keep = _rank(top2) < cfg.n_group_used                                       # [B,T,G]: the best groups
      sel = keep.unsqueeze(-1).where(grouped, float("-inf")).reshape(sel.shape)
    ids, w = topk_ids_values(sel, cfg.n_expert_used, probs)
    if cfg.gating == Gating.SOFTMAX_WEIGHT: w = w.softmax(-1)
    # the k-term sum recomputed per weight (k^2 adds) fuses into the consumer instead of being a broadcast reduce kernel
    if cfg.weights_norm: w = w / w.unsqueeze(-2).expand(*w.shape, w.shape[-1]).sum(-1).maximum(6.103515625e-5)
    if cfg.weights_scale != 1.0: w = w * cfg.weights_scale
    return ids, w

  def _act(self, g: Tensor, u: Tensor) -> Tensor: return _swiglu(g, u)

  def _exps_weights(self) -> list:
    names = ("ffn_gate_up_exps", "ffn_down_exps") if self.ffn_gate_up_exps is not None else ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    return [getattr(self, n).weight for n in names]

  def _ffn_exps(self, h: Tensor, idx: Tensor, affine: bool = True, live: Tensor | None = None) -> Tensor:
    """The routed experts' SwiGLU on rows `h` `[*lead, rows, D]` with the experts `idx` (shape `lead`) -> `[*lead, rows, D]`.
    `live` (integer dot tiles only): per tile, 0 where it only pads the tile count (its rows are never read)."""
    lin = lambda x, w: intdot.linear(x, w, live) if live is not None and intdot.applies(x, w) else linear(x, w, affine=affine)
    if self.ffn_gate_up_exps is not None:
      gu = lin(h, self.ffn_gate_up_exps.weight[idx])
      F = gu.shape[-1] // 2
      act = (gu[..., :F].silu() * gu[..., F:]).contiguous()
    else: act = self._act(lin(h, self.ffn_gate_exps.weight[idx]), lin(h, self.ffn_up_exps.weight[idx]))
    # materialised: the weighted sum over experts then fuses into the residual add instead of into the down GEMV,
    # whose reduction over experts and rows together ran far slower than the down GEMV alone
    return lin(act, self.ffn_down_exps.weight[idx]).contiguous()

  def experts(self, x: Tensor, ids: Tensor, w: Tensor) -> Tensor:
    """`sum_j w[..., j] * expert_{ids[..., j]}(x)` for x `[B,T,D]`, reading only the selected experts' bytes: a GEMV per
    token and selected expert, or (`tiled`) the chunk's pairs grouped by expert, each tile a GEMV over TILE_ROWS tokens.
    For a chunk the sum is materialised: left lazy, it fuses into the shared expert's down GEMM as a second reduction of
    the same kernel."""
    B, T, D = x.shape
    if not self.tiled(B * T * ids.shape[-1], x.device):
      y = self._ffn_exps(x.unsqueeze(-2).unsqueeze(-2), ids).squeeze(-2)                              # [B,T,k,D]
    else:
      n_tiles = expert_tiles(B * T * ids.shape[-1], self.cfg.n_expert)
      tile_expert, pair, slot = group_by_expert(ids.flatten(), self.cfg.n_expert, n_tiles)
      # the tile's expert broadcast over its rows before the gather, not the gathered weight after it: tinygrad realizes
      # a gather (a one-hot reduce) that is broadcast, here every tile's weights unpacked to float32 (25 GB a V2-Lite-
      # shaped chunk); gathered per row with one index, every row's loads are one load, which kernel_opts holds in
      # registers. Each value unpacked whole (not quant/formats.py's per-block affine sums, which cost a multiply and an
      # add per row and value): the tile's rows then cost one multiply-add each per value.
      h = x.reshape(B * T, D)[pair // ids.shape[-1]]                                                 # [tiles, TILE_ROWS, D]
      # llama.cpp's integer dots (quant/intdot.py) take a tile's rows as rows of x against its one gathered
      # weight, each block unpacked once for the rows its pairs fill; the tiles past the used ones compute nothing
      if intdot.takes_all(*self._exps_weights()): rows = self._ffn_exps(h, tile_expert, live=tile_rows(slot, n_tiles))
      else: rows = self._ffn_exps(h.unsqueeze(-2), tile_expert.unsqueeze(-1).expand(pair.shape), affine=False)
      y = rows.reshape(-1, D)[slot].reshape(*ids.shape, D)                                          # each pair's row
    y = (y * w.unsqueeze(-1)).sum(-2)                                                               # [B,T,D]
    return y.contiguous() if B * T > 1 else y

  def tiled(self, pairs: int, device: str) -> bool:
    """Whether `pairs` (token, expert) pairs run as expert tiles: where the device's capabilities ask for them
    (backend.Capabilities.expert_tiles) and the tiles cost less than the pairs' own GEMVs: with integer dots, whose
    tiles unpack each weight block once and take a dot per pair they hold, every chunk of at least TILED_TOKENS
    tokens; else where the tiles, each costing TILE_COST one-pair GEMVs, cost less."""
    if not settings.current(device).caps.expert_tiles: return False
    if intdot.takes_all(*self._exps_weights()): return pairs >= TILED_TOKENS * self.cfg.n_expert_used
    return TILE_COST * expert_tiles(pairs, self.cfg.n_expert) < pairs  # never one token: k < experts

  def __call__(self, x: Tensor) -> Tensor:
    y = self.experts(x, *self.route(x))
    return y + self.shexp(x) if self.shexp is not None else y
