"""On-device sampling vs a numpy rendering of llama.cpp's top-k -> top-p -> min-p -> temperature chain."""
import numpy as np
import pytest
from tinygrad import Tensor, dtypes

from tg_ds4.runtime.sampling import SamplingParams, _kept, greedy, sample, uniform

def _allowed(l: np.ndarray, k: int, p: float, minp: float) -> np.ndarray:
  order = np.argsort(-l, kind="stable")
  keep = np.zeros(len(l), bool); keep[order[:k] if k else order] = True
  probs = np.where(keep, np.exp(l - l.max()), 0); probs /= probs.sum()
  if p < 1:
    srt = np.sort(probs)[::-1]; cum = np.cumsum(srt)
    cutoff = srt[min(np.searchsorted(cum, p), len(srt) - 1)]
    keep &= probs >= cutoff
  return keep & (probs >= minp * probs.max())

@pytest.mark.parametrize("k,p,minp,temp", [(0, 1.0, 0.0, 1.0), (5, 1.0, 0.0, 0.7), (0, 0.8, 0.0, 1.3), (0, 1.0, 0.1, 1.0), (10, 0.9, 0.05, 0.8)])
def test_sampling_distribution(k, p, minp, temp):
  rng = np.random.default_rng(k + int(10 * p))
  V, B = 40, 4000
  l = (2 * rng.standard_normal(V)).astype(np.float32)
  params = SamplingParams(temperature=temp, top_k=k, top_p=p, min_p=minp, seed=1)
  got = sample(Tensor(np.tile(l, (B, 1))), *params.tensors(), Tensor([7, 0], dtype=dtypes.uint32)).numpy()[:, 0]
  allowed = _allowed(l, k, p, minp)
  assert allowed[got].all(), f"sampled a filtered token: {sorted(set(got[~allowed[got]]))}"
  want = np.where(allowed, np.exp((l - l.max()) / temp), 0); want /= want.sum()
  freq = np.bincount(got, minlength=V) / B
  assert np.abs(freq - want).max() < 4 * np.sqrt(want.max() / B) + 1e-3, (freq.round(3), want.round(3))

def test_filters_keep_exactly_the_reference_set_per_row():
  """The threshold searches row by row (a batched step's per-row parameters), against the numpy chain on a realistic
  vocabulary: every row keeps exactly the reference's tokens, ties included (logits on a coarse grid make many)."""
  rng = np.random.default_rng(3)
  B, V = 48, 3000
  l = (3 * rng.standard_normal((B, V))).astype(np.float32)
  l[B // 2:] = np.round(l[B // 2:] * 4) / 4  # the second half full of exact ties
  k = rng.choice([0, 1, 2, 40, 999, V], B)
  p = rng.choice([1.0, 0.95, 0.5, 0.05], B).astype(np.float32)
  minp = rng.choice([0.0, 0.0, 0.02, 0.3], B).astype(np.float32)
  got = _kept(Tensor(l), Tensor(k.astype(np.int32)), Tensor(p), Tensor(minp)).numpy()
  for b in range(B):
    top = l[b] >= np.sort(l[b])[::-1][int(k[b]) - 1] if k[b] else np.ones(V, bool)  # every tie of the k-th logit
    want = top & _allowed(np.where(top, l[b], -np.inf).astype(np.float64), 0, float(p[b]), float(minp[b]))
    assert (got[b] == want).all(), (b, int(k[b]), float(p[b]), float(minp[b]), int(got[b].sum()), int(want.sum()))

def test_greedy_and_seed_determinism():
  l = Tensor([[0.1, 3.0, 2.9, -1.0]])
  assert greedy(l).numpy().tolist() == [[1]]
  a = uniform((3, 5), Tensor([42, 3], dtype=dtypes.uint32)).numpy()
  b = uniform((3, 5), Tensor([42, 3], dtype=dtypes.uint32)).numpy()
  c = uniform((3, 5), Tensor([42, 4], dtype=dtypes.uint32)).numpy()
  assert (a == b).all() and not (a == c).all() and ((a > 0) & (a < 1)).all()

@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=2.0)])
def test_out_of_range_parameters_are_named(bad):
  with pytest.raises(ValueError, match=list(bad)[0]): SamplingParams(**bad)
