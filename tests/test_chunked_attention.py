"""nn/mla.py's chunked_attention, a GPU's decode attention over a symbolic count of 64-row chunks of the latent cache
(backend/compat.chunk_count), on tinygrad's PYTHON device (GPU-style execution): one captured step replayed at
positions whose chunk counts differ from the capture's equals softmax attention over rows [0, pos] computed in numpy."""
import numpy as np
import pytest
from tinygrad import Tensor, UOp

from tg_ds4.backend import compat, prepare_device
from tg_ds4.nn.mla import chunked_attention
from tg_ds4.runtime.jit import Jit

DEV, H, L, R, ROWS = "PYTHON", 4, 16, 8, 150  # 150 cache rows: the third chunk runs past the cache's end

@pytest.mark.skipif(not compat.derived_variables_on(), reason="chunk counts need tinygrad's JIT inputs (compat)")
def test_chunked_attention_replays_at_every_position_and_equals_softmax_attention():
  prepare_device(DEV)
  rng = np.random.default_rng(0)
  cache_np = rng.standard_normal((2, ROWS, L + R)).astype(np.float32)
  cache = Tensor(cache_np, device=DEV).realize()
  q = Tensor.empty(1, H, 1, L + R, device=DEV).realize()
  scale = 0.3
  step = Jit(lambda q, pos: chunked_attention(q, cache, 1, pos, 64, L, scale).realize())
  for p in (5, 63, 64, 100, 127, 128, 149):  # captured at 63 (the second call), replayed with 1, 2 and 3 chunks
    qn = rng.standard_normal((1, H, 1, L + R)).astype(np.float32)
    q.assign(Tensor(qn, device=DEV)).realize()
    got = step(q, UOp.variable("start_pos", 0, ROWS - 1).bind(p)).numpy()[0, :, 0]
    k = cache_np[1, :p + 1]
    s = qn[0, :, 0] @ k.T * scale
    w = np.exp(s - s.max(-1, keepdims=True))
    want = (w / w.sum(-1, keepdims=True)) @ k[:, :L]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (p, np.abs(got - want).max())
  assert step.captured is not None
