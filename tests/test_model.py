"""Model structure: loading errors, decode == prefill, chunked prefill at any start, and a JIT that never recaptures."""
import numpy as np
import pytest
from ggufgen import write_tiny_deepseek2
from tinygrad import Tensor

from tg_ds4.io.gguf import GGUFError
from tg_ds4.runtime.runner import Runner

TOKENS = [1, 5, 9, 33, 2, 7, 100, 4, 8, 12, 3, 3, 77]

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path = tmp_path_factory.mktemp("ds2") / "tiny.gguf"
  write_tiny_deepseek2(path)
  return path

def test_missing_tensor_is_named(tmp_path):
  write_tiny_deepseek2(p := tmp_path / "m.gguf", drop="blk.1.ffn_up_exps.weight")
  with pytest.raises(GGUFError, match=r"missing tensor 'blk.1.ffn_up_exps.weight' \(expected shape \[8, 32, 64\]"): Runner.load(p)

def test_wrong_shape_is_named(tmp_path):
  write_tiny_deepseek2(p := tmp_path / "s.gguf", reshape=("blk.2.attn_q_a.weight", (32, 32)))
  with pytest.raises(GGUFError, match=r"tensor 'blk.2.attn_q_a.weight' has shape \[32, 32\], expected \[32, 64\]"): Runner.load(p)

def test_unsupported_arch_is_named(tmp_path):
  write_tiny_deepseek2(p := tmp_path / "a.gguf", arch="mamba9")
  with pytest.raises(GGUFError, match=r"architecture 'mamba9' is not supported"): Runner.load(p)

def test_context_past_the_trained_one_is_given_with_a_warning(tiny, caplog):
  """As llama.cpp's n_ctx > n_ctx_train: what the caller asks for, not a silent cap (test_reference's long case runs
  150-token prompts through 64-position fixtures against transformers)."""
  trained = Runner.load(tiny).model.max_ctx
  assert not [r for r in caplog.records if "trained" in r.getMessage()]
  assert Runner.load(tiny, max_ctx=trained + 40).model.max_ctx == trained + 40
  want = f"tiny.gguf: a context of {trained + 40} positions exceeds the {trained} the model was trained for"
  assert [r.getMessage() for r in caplog.records] == [want]

def test_decode_equals_prefill_and_jit_replays(tiny):
  ref = Runner.load(tiny, max_ctx=32).prefill(TOKENS, chunk=len(TOKENS)).numpy()[0]
  m = Runner.load(tiny, max_ctx=32)
  outs, captured = [], None
  for i, t in enumerate(TOKENS):
    outs.append(m.decode(t, i).numpy()[0, 0])
    if i == 0: captured = m._jits["greedy"].captured       # replay.Jit captures on its first call
    if i >= 1: assert m._jits["greedy"].captured is captured, f"decode recaptured at step {i}"
  assert captured is not None and len(TOKENS) - 2 >= 3  # replayed at 3+ growing positions
  got = np.stack(outs)
  assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()

@pytest.mark.parametrize("chunk", [1, 4, 5])
def test_chunked_prefill_matches_one_shot(tiny, chunk):
  ref = Runner.load(tiny, max_ctx=32).prefill(TOKENS, chunk=len(TOKENS)).numpy()[0]
  got = Runner.load(tiny, max_ctx=32).prefill(TOKENS, chunk=chunk).numpy()[0]
  assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
  assert np.isfinite(got).all()

def test_prefill_continues_at_any_start(tiny):
  ref = Runner.load(tiny, max_ctx=32).prefill(TOKENS, chunk=len(TOKENS)).numpy()[0]
  m = Runner.load(tiny, max_ctx=32)
  m.prefill(TOKENS[:6], chunk=6)
  got = m.prefill(TOKENS[6:], start_pos=6, chunk=7).numpy()[0]
  assert np.abs(got - ref[6:]).max() <= 1e-4 * np.abs(ref).max()

def test_legacy_combined_kv_b_is_split_at_load(tiny, tmp_path):
  write_tiny_deepseek2(p := tmp_path / "legacy.gguf", legacy_kv_b=True)
  ref = Runner.load(tiny, max_ctx=32).prefill(TOKENS, chunk=len(TOKENS)).numpy()[0]
  got = Runner.load(p, max_ctx=32).prefill(TOKENS, chunk=len(TOKENS)).numpy()[0]
  assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()

def test_fused_gate_up_experts_equal_split(tiny, tmp_path):
  write_tiny_deepseek2(p := tmp_path / "fused.gguf", fused_gate_up=True)
  ref = Runner.load(tiny, max_ctx=32).prefill(TOKENS, chunk=len(TOKENS)).numpy()[0]
  got = Runner.load(p, max_ctx=32).prefill(TOKENS, chunk=len(TOKENS)).numpy()[0]
  assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()

def test_fully_masked_row_is_finite():
  from tg_ds4.nn.mla import causal_mask
  scores = Tensor.zeros(1, 1, 3, 5) + causal_mask(3, 2)
  masked = scores + Tensor([[[[0.0], [0.0], [-3.4e38]]]]).expand(1, 1, 3, 5)  # last row: every key masked
  probs = masked.softmax(-1).numpy()
  assert np.isfinite(probs).all() and np.allclose(probs.sum(-1), 1.0)
  np.testing.assert_array_equal(causal_mask(3, 2).numpy() == 0, np.tril(np.ones((3, 5), bool), 2))

def test_prefill_plan(tiny):
  """A prompt tail is split into whole chunks of the captured sizes, a short rest fed per token and a longer rest into
  the smallest chunk that holds it; nothing is padded past the next chunk size, nothing fed past FEED_TOKENS."""
  from tg_ds4.runtime.runner import FEED_TOKENS
  r = Runner.load(tiny, max_ctx=32)
  C = r.model.PREFILL_CHUNKS
  for n in range(1, 400):
    sizes, fed = r.prefill_plan(n, FEED_TOKENS)
    assert 0 <= fed <= FEED_TOKENS and all(c in C for c in sizes) and sum(sizes) >= n - fed
    assert sum(sizes[:-1]) < n - fed if sizes else fed == n          # only the last chunk may be padded
    if sizes and fed: assert sum(sizes) == n - fed                    # padding and feeding never together
    rest = n - fed - sum(sizes[:-1])
    if sizes: assert sizes[-1] >= rest and all(c < rest for c in C if c < sizes[-1])  # the smallest chunk that holds the rest
  assert r.prefill_plan(5, FEED_TOKENS) == ([], 5) and r.prefill_plan(20, FEED_TOKENS) == ([32], 0) and r.prefill_plan(36, FEED_TOKENS) == ([32], 4)
  assert r.prefill_plan(5, 0) == ([32], 0)  # prefill_last: chunks only
