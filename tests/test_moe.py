"""MoE routing against a plain numpy rendering of llama.cpp's build_moe_ffn, for every gating function and option."""

import numpy as np
import pytest
from tinygrad import Tensor

from tg_ds4.config import Gating, MoEConfig
from tg_ds4.nn.moe import MoE, TILE_ROWS, expert_tiles, group_by_expert, topk_ids


DIM = 16

def _cfg(**kw) -> MoEConfig: return MoEConfig(**{**dict(n_expert=16, n_expert_used=4, expert_ff_dim=8), **kw})

def _ref_route(logits, bias, cfg):
  probs = {Gating.SOFTMAX: lambda z: np.exp(z - z.max(-1, keepdims=True)) / np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True),
           Gating.SIGMOID: lambda z: 1 / (1 + np.exp(-z)), Gating.SOFTMAX_WEIGHT: lambda z: z,
           Gating.SQRT_SOFTPLUS: lambda z: np.sqrt(np.log1p(np.exp(z)))}[cfg.gating](logits)
  sel = probs + bias if bias is not None else probs.copy()
  if cfg.n_group > 1:
    g = sel.reshape(*sel.shape[:-1], cfg.n_group, -1)
    score = np.sort(g, -1)[..., -2:].sum(-1)
    keep = np.argsort(-score, -1, kind="stable")[..., :cfg.n_group_used]
    mask = np.zeros(score.shape, bool); np.put_along_axis(mask, keep, True, -1)
    sel = np.where(mask[..., None], g, -np.inf).reshape(sel.shape)
  ids = np.argsort(-sel, -1, kind="stable")[..., :cfg.n_expert_used]
  w = np.take_along_axis(probs, ids, -1)
  if cfg.gating == Gating.SOFTMAX_WEIGHT: w = np.exp(w - w.max(-1, keepdims=True)); w /= w.sum(-1, keepdims=True)
  if cfg.weights_norm: w = w / np.maximum(w.sum(-1, keepdims=True), 6.103515625e-5)
  return ids, w * cfg.weights_scale

@pytest.mark.parametrize("gating", list(Gating))
@pytest.mark.parametrize("norm,scale,bias,groups", [(False, 1.0, False, 1), (True, 2.5, True, 1), (True, 1.8, True, 4), (False, 1.0, False, 4)])
def test_route_matches_llama_cpp_semantics(gating, norm, scale, bias, groups):
  cfg = _cfg(gating=gating, weights_norm=norm, weights_scale=scale, n_group=groups, n_group_used=2 if groups > 1 else 1)
  rng = np.random.default_rng(int(gating) * 10 + groups)
  x, wg = rng.standard_normal((1, 5, 16)).astype(np.float32), rng.standard_normal((16, 16)).astype(np.float32)
  b = (0.5 * rng.standard_normal(16)).astype(np.float32) if bias else None
  moe = MoE(DIM, cfg, has_bias=bias)
  moe.ffn_gate_inp.weight = Tensor(wg)
  if bias: moe.exp_probs_b.bias = Tensor(b)
  ids, w = moe.route(Tensor(x))
  ref_ids, ref_w = _ref_route(x @ wg.T, b, cfg)
  np.testing.assert_array_equal(ids.numpy(), ref_ids)
  np.testing.assert_allclose(w.numpy(), ref_w, rtol=1e-5, atol=1e-6)

def test_topk_ties_prefer_lower_index():
  x = Tensor([[3.0, 1.0, 3.0, 2.0, 3.0]])
  assert topk_ids(x, 3).numpy().tolist() == [[0, 2, 4]]
  assert topk_ids(x, 4).numpy().tolist() == [[0, 2, 4, 3]]

@pytest.mark.parametrize("T", [3, 24])  # 24 tokens x 4 experts: the pairs grouped by expert into tiles (group_by_expert)
def test_expert_ffn_matches_numpy(T):
  cfg = _cfg(gating=Gating.SIGMOID, weights_norm=True, weights_scale=1.5, n_expert_shared=1)
  rng = np.random.default_rng(7)
  E, D, F = 16, 16, 8
  ws = {k: rng.standard_normal(s).astype(np.float32) / np.sqrt(s[-1]) for k, s in
        dict(inp=(E, D), gate=(E, F, D), up=(E, F, D), down=(E, D, F), sg=(F, D), su=(F, D), sd=(D, F)).items()}
  moe = MoE(DIM, cfg)
  moe.ffn_gate_inp.weight, moe.ffn_gate_exps.weight, moe.ffn_up_exps.weight = Tensor(ws["inp"]), Tensor(ws["gate"]), Tensor(ws["up"])
  moe.ffn_down_exps.weight = Tensor(ws["down"])
  sh = moe.shexp
  sh.ffn_gate_shexp.weight, sh.ffn_up_shexp.weight, sh.ffn_down_shexp.weight = Tensor(ws["sg"]), Tensor(ws["su"]), Tensor(ws["sd"])
  x = rng.standard_normal((1, T, D)).astype(np.float32)
  assert moe.tiled(T * cfg.n_expert_used, Tensor(x).device) == (T > 3)
  ids, w = _ref_route(x @ ws["inp"].T, None, cfg)
  silu = lambda z: z / (1 + np.exp(-z))
  ref = np.zeros_like(x)
  for t in range(T):
    for e, we in zip(ids[0, t], w[0, t]):
      ref[0, t] += we * (ws["down"][e] @ (silu(ws["gate"][e] @ x[0, t]) * (ws["up"][e] @ x[0, t])))
    ref[0, t] += ws["sd"] @ (silu(ws["sg"] @ x[0, t]) * (ws["su"] @ x[0, t]))
  np.testing.assert_allclose(moe(Tensor(x)).numpy(), ref, rtol=1e-4, atol=1e-5)

@pytest.mark.parametrize("routing", ["random", "one expert", "two experts", "one pair each"])
def test_group_by_expert(routing):
  """Every (token, expert) pair lands in a row of a tile of its own expert, each row holds at most one pair, pairs keep
  their order within an expert, and the tiles fit whatever the routing (all pairs on one expert fill whole tiles; fewer
  pairs than experts, each on its own, take one tile per pair, the count expert_tiles allows)."""
  rng, E = np.random.default_rng(3), 16
  P = 12 if routing == "one pair each" else 96
  e = {"random": rng.integers(0, E, P), "one expert": np.full(P, 5), "two experts": rng.choice([2, 11], P),
       "one pair each": rng.permutation(E)[:P]}[routing]
  n_tiles = expert_tiles(P, E)
  tile_expert, pair, slot = (t.numpy() for t in group_by_expert(Tensor(e.astype(np.int32)), E, n_tiles))
  assert tile_expert.shape == (n_tiles,) and pair.shape == (n_tiles, TILE_ROWS) and slot.shape == (P,)
  assert len(set(slot.tolist())) == P and slot.max() < n_tiles * TILE_ROWS
  assert (tile_expert[slot // TILE_ROWS] == e).all() and (pair.reshape(-1)[slot] == np.arange(P)).all()
  for x in set(e.tolist()): assert (np.diff(slot[e == x]) > 0).all()
