"""Batched generation (batch.Batcher over nn/cache_rows.py's cache slots): every answer equals the same request run alone on a
runner with one sequence (runner.Runner.steps): greedy and seeded sampling token for token, logprobs within 1e-5.

16 clients x 4 requests on the MoE MLA fixture: clients arrive in waves while others are mid-answer, so slots join and
leave between steps, batches of 1, 2 and 4 rows run, long prompts prefill a chunk at a time beside the running rows,
and a client's later requests extend its earlier prompt (a free slot holding that prefix is reused).

The runners compute exact float math (`numerics="exact"`): a batched step's float kernels (norms, attention, the
router) take other shapes than one row's, so they may sum in another order, ~1e-7 apart; under the default numerics'
8-bit rounding of Q4_0 matmul inputs (quant/activations.py) such a difference can move one rounding, and the same request's
logprobs then differ by a few hundredths batched and alone (measured 0.013-0.026 here, tokens still equal), as
llama.cpp's own do. The integer dot products themselves give each row what it gets alone (test_intdot)."""
import pathlib, random

import pytest

from tg_ds4.io.gguf import GGUFFile
from tg_ds4.models.families import config_of
from tg_ds4.runtime.batcher import Batcher, Request
from tg_ds4.runtime.runner import Runner
from tg_ds4.runtime.sampling import SamplingParams

DS3 = pathlib.Path(__file__).parent / "fixtures" / "deepseek2" / "ds3" / "ds3-Q4_0.gguf"
CTX, PARALLEL, CLIENTS, PER_CLIENT = 192, 4, 16, 4  # CTX: test_reference's, whose ds3 steps the single-sequence runner loads

def _requests(vocab: int) -> list[Request]:
  rnd, out = random.Random(7), []
  for c in range(CLIENTS):
    prompt = [rnd.randrange(vocab) for _ in range(rnd.choice([2, 5, 11, 30]))]
    for j in range(PER_CLIENT):
      prompt = prompt + [rnd.randrange(vocab) for _ in range(rnd.choice([1, 3, 8]))]   # a conversation growing
      params = SamplingParams() if c % 2 == 0 else \
        SamplingParams(temperature=rnd.choice([0.7, 1.3]), top_k=rnd.choice([0, 40]), top_p=rnd.choice([1.0, 0.9]), seed=100 * c + j)
      out.append(Request(tuple(prompt), rnd.choice([1, 3, 6]), params, stop=frozenset({rnd.randrange(vocab)}), logprobs=5))
  return out

@pytest.fixture(scope="module")
def alone():
  r = Runner.load(DS3, max_ctx=CTX, numerics="exact")
  return lambda reqs: [list(r.steps(list(q.prompt), q.max_new, q.params, q.stop, logprobs=q.logprobs)) for q in reqs]

@pytest.fixture(scope="module")
def batcher():
  return Batcher(Runner.load(DS3, max_ctx=CTX, parallel=PARALLEL, numerics="exact"))

def _assert_same(alone: list, got: list, label: str) -> float:
  worst = 0.0
  for a, g in zip(alone, got, strict=True):
    assert [s.token for s in g] == [s.token for s in a], label
    for x, y in zip(a, g):
      assert [t for t, _ in y.top] == [t for t, _ in x.top], label
      worst = max(worst, abs(x.logprob - y.logprob), *(abs(p - q) for (_, p), (_, q) in zip(x.top, y.top)))
  assert worst < 1e-5, (label, worst)
  return worst

@pytest.fixture(scope="module")
def requests():
  return _requests(config_of(GGUFFile(DS3)).n_vocab)

def test_batched_answers_equal_alone(requests, alone, batcher):
  b = batcher
  out: dict[int, list] = {}
  ids, pending, sizes, steps = [], list(requests), set(), 0
  while pending or b.busy:
    if pending and steps % 3 == 0:  # a wave of two clients' requests every third step
      for q in pending[:2 * PER_CLIENT]: ids.append(b.submit(q))
      del pending[:2 * PER_CLIENT]
    sizes.add(sum(1 for s in b.running.values() if not s.chunks))
    for e in b.step():
      if e.step is not None: out.setdefault(e.rid, []).append(e.step)
    steps += 1
  assert {1, 2, 4} <= sizes | {0}, sizes                      # batches of several sizes ran
  assert len(ids) == CLIENTS * PER_CLIENT
  worst = _assert_same(alone(requests), [out.get(i, []) for i in ids], "16 clients x 4")
  print(f"\n{len(ids)} requests in {steps} steps, batch rows {sorted(sizes)}, logprobs within {worst:.1e} of alone")

def test_cancel_frees_the_slot_and_leaves_the_others_alone(requests, alone, batcher):
  reqs = [Request(q.prompt, 6, q.params, logprobs=q.logprobs) for q in requests[1:6 * PER_CLIENT:PER_CLIENT]]  # 6 clients, 4 slots
  b = batcher
  ids = [b.submit(q) for q in reqs]
  out: dict[int, list] = {i: [] for i in ids}
  ended: dict[int, int] = {}
  while b.busy:
    for e in b.step():
      if e.step is not None: out[e.rid].append(e.step)
      if e.finished: ended[e.rid] = len(out[e.rid])
    if len(out[ids[0]]) == 2 and ids[0] not in ended: b.cancel(ids[0])
  assert ended[ids[0]] == 2 and all(ended[i] == 6 for i in ids[1:]), ended
  want = alone(reqs)
  _assert_same([want[0][:2]] + want[1:], [out[i] for i in ids], "cancelled")

def test_greedy_rows_without_logprobs(requests, alone, batcher):
  reqs = [Request(q.prompt, 5) for q in requests[::PER_CLIENT * 5]]
  got = batcher.run(reqs)
  assert [[s.token for s in g] for g in got] == [[s.token for s in a] for a in alone(reqs)]
  assert all(s.logprob is None for g in got for s in g)

def test_slot_rows_save_and_restore(requests, alone, batcher):
  """A slot's cache rows (serve's disk KV cache, per slot): the rows of a prompt read from slot 1 equal those the
  single-sequence runner wrote for it (to float rounding: the prompt tail ran in batched steps); written into slot 0,
  which meanwhile held another prompt, through the Batcher's restore hook, the request answers as alone without
  prefilling them again."""
  import numpy as np
  q, other = Request(requests[3].prompt, 4, logprobs=5), Request(requests[9].prompt, 2)  # prompts of > FEED_TOKENS tokens
  single = Runner.load(DS3, max_ctx=CTX, numerics="exact")
  list(single.steps(list(q.prompt), 1))
  ref = dict(single.kv_rows(len(q.prompt)))
  b, slots = Batcher(batcher.runner), {}
  ids = [b.submit(q), b.submit(q)]
  while b.busy: slots.update({e.rid: e.slot for e in b.step() if e.cached is not None})
  assert [slots[i] for i in ids] == [0, 1]
  rows = dict(b.runner.kv_rows(len(q.prompt), 1))
  assert rows.keys() == ref.keys() and all(rows[k].shape == ref[k].shape for k in ref)
  worst = max(float(np.abs(rows[k].astype(np.float64) - ref[k]).max() / np.abs(ref[k]).max()) for k in ref)
  assert worst < 1e-5, worst
  b.slot_tokens = [[] for _ in range(b.slots)]
  b.run([other])  # slot 0 now holds another prompt's rows
  b.slot_tokens = [[] for _ in range(b.slots)]  # nothing in memory to reuse: only what the hook restores
  def restore(prompt, slot, start):
    assert slot == 0 and start == 0
    b.runner.load_kv_rows(list(prompt[:-1]), rows, slot)
    return len(prompt) - 1
  b.restore, got = restore, []
  b.submit(q)
  while b.busy:
    for e in b.step():
      if e.cached is not None: assert e.cached == len(q.prompt) - 1 and e.slot == 0
      if e.step is not None: got.append(e.step)
  _assert_same(alone([q]), [got], "restored")

def test_dsa_batched_answers_equal_alone():
  """DSA on glm-dsa, whose layers hold every DSA block kind (deepseek32's indexer layers and glm-dsa's shared ones):
  each row's indexer keys go into its own slot of the key cache (all rows in one store: per-row stores of one buffer
  made a cycle in tinygrad's schedule), and a row's selection over more cached positions than top-k (32: the 45-token
  prompt) is its own."""
  name = "glmdsa/glmdsa-Q8_0"
  path = pathlib.Path(__file__).parent / "fixtures" / "dsa" / f"{name}.gguf"
  vocab, rnd = config_of(GGUFFile(path)).n_vocab, random.Random(3)
  reqs = [Request(tuple(rnd.randrange(vocab) for _ in range(n)), 4, SamplingParams() if i % 2 == 0 else SamplingParams(0.9, seed=i),
                  logprobs=5) for i, n in enumerate((3, 14, 45))]
  assert config_of(GGUFFile(path)).idx_top_k < 45
  single = Runner.load(path, max_ctx=64, numerics="exact")
  alone = [list(single.steps(list(q.prompt), q.max_new, q.params, logprobs=q.logprobs)) for q in reqs]
  _assert_same(alone, Batcher(Runner.load(path, max_ctx=64, parallel=3, numerics="exact")).run(reqs), name)

def test_batch_step_checks_its_rows():
  r = Runner.load(DS3, max_ctx=CTX)
  with pytest.raises(ValueError, match="parallel > 1"): r.batch_step([1], [0], [0])
  with pytest.raises(ValueError, match="parallel must be in"): Runner.load(DS3, max_ctx=CTX, parallel=9)
