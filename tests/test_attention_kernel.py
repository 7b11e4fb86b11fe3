"""nn/attention_kernel.py: attention over a KV cache (scores, softmax, attn·v) as one C kernel. Held to numpy's float64
attention over exactly the cache rows each query may see (rows past them, and before a sliding window, hold other
values, so reading one too many or too few moves the result by far more than the tolerance), for each CPU kind's
statement shape, MLA's latent rows and GQA's per-head keys and values, head groups that fill a statement or not, a
decode step and chunks, positions on and across the softmax blocks' edges, peaked and flat softmaxes, and a captured
step whose start position and slot are variables."""
import numpy as np
import pytest
from tinygrad import Tensor, TinyJit, UOp

from tg_ds4 import backend
from tg_ds4.nn.attention_kernel import Layout, SinkKeys, applies, attention, attention_sinks

pytestmark = pytest.mark.skipif(backend.capabilities("CPU").c_attention is None,
                                reason="needs an x86 CPU with AVX2 and clang, tinygrad 0.14's internals")

MAX, SCALE = 150, 0.125
LAYOUTS = {"latent": Layout.latent(80, 64), "gqa": Layout.kv(3, 32, 16)}  # MLA's (V2-Lite's in small), and a GQA cache's

def _reference(q: np.ndarray, cache: np.ndarray, lay: Layout, slot: int, pos: int, window: int) -> tuple[np.ndarray, float]:
  """The attention in float64, and the tolerance float32 scores leave it: a score of size s is off by ~s * 1e-7, which
  moves its probability by that fraction (2e-6 of the output's size where the scores are of order 1)."""
  T, H, _ = q.shape
  out, big, G = np.zeros((T, H, lay.value_dim)), 1.0, H // lay.kv_heads
  rows = cache[slot].reshape(MAX, lay.kv_heads, lay.head).astype(np.float64)
  for t in range(T):
    lo = max(0, pos + t + 1 - window) if window else 0
    for h in range(H):
      kv = rows[lo:pos + t + 1, h // G]
      k, v = kv[:, :lay.key_dim], kv[:, lay.value_offset:lay.value_offset + lay.value_dim]
      s = k @ q[t, h].astype(np.float64) * np.float32(SCALE)
      p, big = np.exp(s - s.max()), max(big, np.abs(s).max())
      out[t, h] = (p / p.sum()) @ v
  return out, 2e-6 * big * np.abs(out).max()

@pytest.mark.parametrize("unit", [(8, 32), (8, 16)], ids=["avx512", "avx2"])
@pytest.mark.parametrize("name,H,T,window", [("latent", 16, 1, 0), ("latent", 16, 5, 0), ("latent", 6, 3, 0), ("latent", 20, 1, 0),
                                             ("gqa", 21, 1, 0), ("gqa", 9, 4, 0), ("gqa", 9, 3, 40)])
def test_attention_is_softmax_over_the_visible_rows(unit, name, H, T, window):
  lay, rng = LAYOUTS[name], np.random.default_rng(H * 10 + T)
  cache_np = rng.standard_normal((2, MAX, lay.kv_heads * lay.head)).astype(np.float32)
  cache = Tensor(cache_np).realize()
  pos_var, slot_var = UOp.variable("start_pos", 0, MAX - 1), UOp.variable("slot", 0, 1)
  step = TinyJit(lambda q, s, p: attention(q, cache, s, p, lay, SCALE, unit, window).realize())
  for peak in (1.0, 30.0):  # a flat softmax over many rows, and one where most probabilities underflow
    q_np = (rng.standard_normal((T, H, lay.key_dim)) * peak).astype(np.float32)
    q = Tensor(q_np).realize()
    for slot, pos in [(1, 0), (0, 62), (1, 63), (0, 64), (1, 127 - T), (0, MAX - T)]:
      ref, tol = _reference(q_np, cache_np, lay, slot, pos, window)
      ours = step(q, slot_var.bind(slot), pos_var.bind(pos)).numpy()
      np.testing.assert_allclose(ours, ref, rtol=0, atol=tol, err_msg=f"slot {slot} pos {pos} peak {peak}")
  ref, tol = _reference(q_np, cache_np, lay, 1, 70, window)  # an int position and slot: constants in the kernel
  np.testing.assert_allclose(attention(q, cache, 1, 70, lay, SCALE, unit, window).numpy(), ref, rtol=0, atol=tol)

def test_applies_only_where_the_vectors_tile_a_float32_cache():
  cache, lay = Tensor.empty(1, 8, 576), Layout.latent(576, 512)
  assert applies(lay, 16, cache, (8, 32)) and not applies(lay, 16, cache, None) and not applies(lay, 16, cache.half(), (8, 32))
  assert not applies(Layout.latent(580, 512), 16, cache, (8, 32)) and not applies(Layout.kv(3, 64, 64), 8, cache, (8, 32))

def _sink_reference(q, rows, raw, chosen, sinks, pos, keys: SinkKeys) -> tuple[np.ndarray, float]:
  """V4's attention in float64 over exactly the keys each query sees (models/deepseek4.py's rules) in one cache slot's
  rows, ring and choice, the sink a denominator term."""
  T, H, D = q.shape
  out, big, last = np.zeros((T, H, D)), 1.0, pos + T - 1
  n = pos // keys.ratio + keys.candidates if keys.ratio else 0
  for t in range(T):
    qpos = pos + t
    held = [last - ((last % keys.slots + keys.slots - s) % keys.slots) for s in range(keys.slots)]
    vis = [rows[j] for j in range(n) if (j + 1) * keys.ratio <= qpos + 1 and (not keys.selected or chosen[t, j])]
    vis += [raw[s, :D] for s in range(keys.slots) if 0 <= held[s] <= qpos and held[s] > qpos - keys.window]
    k = np.array(vis, np.float64).reshape(-1, D)
    for h in range(H):
      s = k @ q[t, h].astype(np.float64) * np.float32(SCALE)
      m = max(s.max(initial=-np.inf), sinks[h])
      p = np.exp(s - m)
      out[t, h], big = (p @ k) / (p.sum() + np.exp(sinks[h] - m)), max(big, np.abs(s).max(initial=0))
  return out, 2e-6 * big * np.abs(out).max()

@pytest.mark.parametrize("unit", [(8, 32), (8, 16)], ids=["avx512", "avx2"])
@pytest.mark.parametrize("ratio,T", [(4, 1), (4, 5), (0, 3), (16, 2)])
def test_sink_attention_is_softmax_over_the_keys_each_query_sees(unit, ratio, T):
  """Compressed rows past the count, raw slots outside the window and unchosen rows hold values that would move the
  result; positions before the ring wraps, across it, and with whole blocks of compressed rows hidden; each cache slot
  (a symbolic one) reads its own rows, ring and choice."""
  rng, D, H, max_rows = np.random.default_rng(ratio * 10 + T), 32, 16, 80
  keys = SinkKeys(ratio, (T - 1) // ratio + 2 if ratio and T > 1 else 1 if ratio else 0, 24, D + 8, 17, ratio == 4)
  rows_np, raw_np = rng.standard_normal((3, max_rows, D)).astype(np.float32), rng.standard_normal((3, 24, D + 8)).astype(np.float32)
  chosen_np = (rng.random((3, 8, max_rows)) < 0.3).astype(np.uint8)
  sinks_np = rng.standard_normal(H).astype(np.float32)
  rows, raw, chosen, sinks = (Tensor(a).realize() for a in (rows_np, raw_np, chosen_np, sinks_np))
  pos_var, slot_var = UOp.variable("start_pos", 0, 4 * (max_rows - 4)), UOp.variable("slot", 0, 2)
  step = TinyJit(lambda q, p, s: attention_sinks(q, raw, rows if ratio else None, chosen if ratio == 4 else None, sinks, s, p, keys, SCALE,
                                                 unit).realize())
  for peak in (1.0, 30.0):
    q_np = (rng.standard_normal((T, H, D)) * peak).astype(np.float32)
    q = Tensor(q_np).realize()
    for pos, slot in [(0, 0), (7, 2), (40, 1), (170, 0), (255, 2)]:
      ref, tol = _sink_reference(q_np, rows_np[slot], raw_np[slot], chosen_np[slot], sinks_np, pos, keys)
      assert np.abs(step(q, pos_var.bind(pos), slot_var.bind(slot)).numpy() - ref).max() <= tol, (peak, pos, slot)
