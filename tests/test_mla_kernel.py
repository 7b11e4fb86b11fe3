"""nn/mla_kernel.py: MLA's attention over the latent cache (scores, softmax, attn·v) as one C kernel. Held to numpy's
float64 attention over exactly the cache rows each query may see (rows past them hold other values, so reading one too
many or too few moves the result by far more than the tolerance), for each CPU kind's statement shape, head counts that
fill a statement or not, a decode step and chunks, positions on and across the softmax blocks' edges, peaked and flat
softmaxes, and a captured step whose start position and slot are variables."""
import numpy as np
import pytest
from tinygrad import Tensor, TinyJit, UOp

from tg_ds4 import backend
from tg_ds4.nn import mla_kernel

pytestmark = pytest.mark.skipif(backend.capabilities("CPU").c_attention is None,
                                reason="needs an x86 CPU with AVX2 and clang, tinygrad 0.14's internals")

L, D, MAX, SCALE = 64, 80, 150, 0.125  # V2-Lite's shape in small: a latent of L values and D - L rope columns

def _reference(q: np.ndarray, cache: np.ndarray, slot: int, pos: int) -> tuple[np.ndarray, float]:
  """The attention in float64, and the tolerance float32 scores leave it: a score of size s is off by ~s * 1e-7, which
  moves its probability by that fraction (2e-6 of the output's size where the scores are of order 1)."""
  out, big = np.zeros((q.shape[0], q.shape[1], L)), 1.0
  for t in range(q.shape[0]):
    k = cache[slot, :pos + t + 1].astype(np.float64)
    s = q[t].astype(np.float64) @ k.T * np.float32(SCALE)
    p, big = np.exp(s - s.max(-1, keepdims=True)), max(big, np.abs(s).max())
    out[t] = (p / p.sum(-1, keepdims=True)) @ k[:, :L]
  return out, 2e-6 * big * np.abs(out).max()

@pytest.mark.parametrize("unit", [(8, 32), (8, 16)], ids=["avx512", "avx2"])
@pytest.mark.parametrize("H,T", [(16, 1), (16, 5), (6, 3), (20, 1)])
def test_attention_is_softmax_over_the_visible_rows(unit, H, T):
  rng = np.random.default_rng(H * 10 + T)
  cache_np = rng.standard_normal((2, MAX, D)).astype(np.float32)
  cache = Tensor(cache_np).realize()
  pos_var, slot_var = UOp.variable("start_pos", 0, MAX - 1), UOp.variable("slot", 0, 1)
  step = TinyJit(lambda q, s, p: mla_kernel.attention(q, cache, s, p, L, SCALE, unit).realize())
  for peak in (1.0, 30.0):  # a flat softmax over many rows, and one where most probabilities underflow
    q_np = (rng.standard_normal((T, H, D)) * peak).astype(np.float32)
    q = Tensor(q_np).realize()
    for slot, pos in [(1, 0), (0, 62), (1, 63), (0, 64), (1, 127 - T), (0, MAX - T)]:
      ref, tol = _reference(q_np, cache_np, slot, pos)
      ours = step(q, slot_var.bind(slot), pos_var.bind(pos)).numpy()
      np.testing.assert_allclose(ours, ref, rtol=0, atol=tol, err_msg=f"slot {slot} pos {pos} peak {peak}")
  ref, tol = _reference(q_np, cache_np, 1, 70)  # an int position and slot: constants in the kernel
  np.testing.assert_allclose(mla_kernel.attention(q, cache, 1, 70, L, SCALE, unit).numpy(), ref, rtol=0, atol=tol)

def test_applies_only_where_the_vectors_tile_a_float32_cache():
  cache = Tensor.empty(1, 8, 576)
  assert mla_kernel.applies(576, 512, cache, (8, 32)) and not mla_kernel.applies(576, 512, cache, None)
  assert not mla_kernel.applies(576, 512, cache.half(), (8, 32)) and not mla_kernel.applies(580, 512, cache, (8, 32))
