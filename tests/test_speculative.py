"""Speculative decoding (runtime/speculative.py): greedy speculation gives plain greedy's tokens, sampled speculation
keeps the target's distribution and is reproducible under a seed."""
import pathlib

import numpy as np
import pytest
from tinygrad import Tensor

from tg_ds4.io.registry import resolve
from tg_ds4.runtime.runner import Runner, reusable_prefix
from tg_ds4.runtime.sampling import SamplingParams, distribution, sample
from tg_ds4.runtime.speculative import DraftModel, accept_sampled, draw, speculate, warm_steps

FIX = pathlib.Path(__file__).parent / "fixtures"
CTX, N = 64, 40  # CTX: test_stepcache's, whose steps of the same files and settings these runners load when it ran first

def _prompt(n_vocab: int, n: int) -> list[int]: return [(x * 7919 + 13) % n_vocab for x in range(n)]

# prompts of FEED_TOKENS (12) tokens or fewer go through the per-token step, on both sides: no prefill chunk to capture
@pytest.mark.parametrize("target, draft, n, ks", [
  ("smollm2", "smollm2", 20, (1, 2, 3, 4)),  # drafting for itself: every draft is accepted; both prompts prefill a chunk
  (FIX / "deepseek2/ds3/ds3-Q4_0.gguf", FIX / "deepseek2/ds3/ds3-Q8_0.gguf", 12, (1, 3)),
  (FIX / "dsa/ds32/ds32-Q4_0.gguf", FIX / "dsa/ds32/ds32-Q8_0.gguf", 12, (2,)),
  # 40 tokens after 12: past the positions where the ratio-4 layers' indexer keeps fewer rows than it sees
  (FIX / "deepseek4/flash/flash-MXFP4.gguf", FIX / "deepseek4/flash/flash-IQ2_XXS.gguf", 12, (2,)),
], ids=["smollm2", "ds3", "ds32", "deepseek4"])
def test_greedy_speculation_gives_plain_greedy_tokens(target, draft, n, ks):
  """Token for token what plain greedy decoding gives, for each k, with the rows of rejected drafts left in the caches
  (each verify step rewinds past them)."""
  t = Runner.load(resolve(str(target)), max_ctx=CTX)
  d = DraftModel(Runner.load(resolve(str(draft)), max_ctx=CTX))
  prompt = _prompt(t.model.cfg.n_vocab, n)
  plain = list(t.generate(prompt, N))
  for k in ks:
    assert list(speculate(t, d, prompt, N, k)) == plain, k
    st = t.stats
    assert st.generated == N and st.drafted >= k and 0 <= st.accepted <= st.drafted
    if target == draft: assert st.acceptance == 1.0  # the verify rows compute the per-token step's logits bit for bit
    else: assert 0 < st.acceptance < 1
  # the runner's bookkeeping names the sequence as what its rows hold (past the rejected drafts' rows), so a prompt
  # extending it resumes from them
  seq = prompt + plain
  assert t.cached[:len(seq) - 1] == seq[:-1] and t.reusable(seq + [1]) >= len(seq) - 1

def test_seeded_speculative_sampling_is_reproducible():
  t = Runner.load(FIX / "deepseek2/ds3/ds3-Q4_0.gguf", max_ctx=CTX)
  d = DraftModel(Runner.load(FIX / "deepseek2/ds3/ds3-Q8_0.gguf", max_ctx=CTX))
  prompt, run = _prompt(t.model.cfg.n_vocab, 12), lambda seed: list(speculate(t, d, prompt, 24, 3, SamplingParams(0.9, 40, 0.95, 0.0, seed)))
  a = run(7)
  assert run(7) == a and run(8) != a and len(a) == 24
  assert 0 < t.stats.acceptance < 1

def test_distribution_is_what_sample_draws():
  """sampling.distribution (the acceptance rule's p and q) is the distribution `sample` draws from: zero exactly where
  the filters drop a token, and the frequencies of 40,000 draws within a chi-square bound of it."""
  logits = np.array([2.0, 1.5, 1.4, 0.3, 0.2, -1.0, -3.0, 0.9], np.float32)
  params = SamplingParams(0.7, 6, 0.97, 0.02)
  T, K, P, M = (x.reshape(1) for x in params.tensors())
  p = distribution(Tensor(logits.reshape(1, -1)), T, K, P, M).numpy()[0]
  n = 40_000
  rng = Tensor(np.stack([np.full(n, 11, np.uint32), np.arange(n, dtype=np.uint32)], 1))
  got = np.bincount(sample(Tensor(np.tile(logits, (n, 1))), T, K, P, M, rng).numpy()[:, 0], minlength=len(logits))
  assert abs(p.sum() - 1) < 1e-6 and (p == 0).sum() >= 2 and (got[p == 0] == 0).all()
  e = n * p[p > 0]
  assert ((got[p > 0] - e) ** 2 / e).sum() < 20.5  # chi-square, 5 degrees of freedom at most: p = 0.001

def test_sampled_acceptance_keeps_the_target_distribution():
  """The acceptance rule on a 5-token vocabulary whose next-token distributions depend on the previous token: the first
  two tokens of 30,000 speculative runs (drafts from another distribution, some of its tokens impossible for the
  target and the other way round) follow the target's joint distribution (chi-square over the 25 pairs)."""
  r = np.random.default_rng(0)
  V = 5
  target, drafted = r.dirichlet(np.ones(V), V), r.dirichlet(np.ones(V), V)
  target[:, 4], drafted[:, 3] = 0, 0
  target, drafted = target / target.sum(1, keepdims=True), drafted / drafted.sum(1, keepdims=True)
  gen, counts, k = np.random.default_rng(1), np.zeros((V, V)), 2
  for _ in range(30_000):
    seq, out = [0], []
    while len(out) < 2:
      drafts, prev = [], seq[-1]
      for _ in range(k): drafts.append(draw(drafted[prev], gen)); prev = drafts[-1]
      ctx = [seq[-1]] + drafts
      new = accept_sampled(target[ctx], drafted[ctx[:k]], drafts, gen)
      seq += new; out += new
    counts[out[0], out[1]] += 1
  # a draft id past the target's vocabulary (a draft's padding entries) is rejected where it stands
  assert accept_sampled(target[[0, 1]], np.pad(drafted[[0]], ((0, 0), (0, 2))), [V + 1], gen) in ([t] for t in range(4))
  want = 30_000 * target[0][:, None] * target
  assert counts[want == 0].sum() == 0
  chi = ((counts - want)[want > 0] ** 2 / want[want > 0]).sum()
  assert chi < 44.3, chi  # 16 possible pairs (15 degrees of freedom) at most: p = 0.0001

def test_a_request_running_alone_in_a_batcher_speculates():
  """serve's slots: a greedy request that is the only one with a token to feed decodes speculatively (the ds3 fixture
  drafted by its Q8_0, k = 3) and answers what it answers through the batched steps; two requests at once take the
  batched steps until the shorter ends, then the other speculates. The server's warm-up (the runner's steps and
  speculative.warm_steps) leaves no step for a request to capture."""
  from tg_ds4.runtime.batcher import Batcher, Request
  runner = Runner.load(FIX / "deepseek2/ds3/ds3-Q4_0.gguf", max_ctx=CTX, parallel=2)
  d = DraftModel(Runner.load(FIX / "deepseek2/ds3/ds3-Q8_0.gguf", max_ctx=CTX))
  runner.warm_up(extra=warm_steps(runner, d, 3))
  captured = (set(runner._jits), set(d.runner._jits))
  V = runner.model.cfg.n_vocab
  reqs = [Request(tuple(_prompt(V, 12)), 36), Request(tuple(_prompt(V, 9)[::-1]), 12)]
  tokens = lambda steps: [[s.token for s in r] for r in steps]
  plain = [tokens(Batcher(runner).run([q]))[0] for q in reqs]
  b = Batcher(runner, drafter=d, speculative=3)
  assert [tokens(b.run([q]))[0] for q in reqs] == plain
  assert 0 < b.accepted < b.drafted
  drafted = b.drafted
  assert tokens(b.run(reqs)) == plain and b.drafted > drafted
  assert (set(runner._jits), set(d.runner._jits)) == captured

def test_a_deepseek4_draft_rewinds_past_rejected_drafts():
  """A V4 draft (ring caches) resumes after rejected drafts from the rows it still holds, within its rings' slack, instead of
  prefilling again from position 0, and proposes what it proposes from a prefill from scratch."""
  r = Runner.load(FIX / "deepseek4/flash/flash-IQ2_XXS.gguf", max_ctx=CTX)
  d = DraftModel(r)
  seq = _prompt(r.model.cfg.n_vocab, 20)
  drafts, _ = d.propose(seq, 3, (), None)
  fresh = lambda s: (setattr(r, "cached", []), setattr(d, "furthest", None), d.propose(s, 3, (), None)[0])[-1]
  for nxt in (seq + [drafts[0], (drafts[1] + 1) % r.model.cfg.n_vocab], seq[:-4] + [5, 6]):  # 1 and 6 positions back
    d.propose(seq, 3, (), None)  # the drafts' rows written past where nxt parts from them
    assert d._start(nxt) == reusable_prefix(nxt, r.cached) > 0
    got = d.propose(nxt, 3, (), None)[0]
    assert got == fresh(nxt)
