"""Batched generation of DeepSeek V4 (models/deepseek4.py) over cache slots: every piece of V4's state (raw ring,
compressor states and compressed rows, the indexer's keys and choice) per slot, each row at its own position; answers
equal to the same requests run alone (exact numerics: greedy and seeded sampling token for token, logprobs within
1e-5), slots resumed and the state saved and restored as serve's disk KV cache does, and serve's app with slots."""
import pathlib, random

import pytest

from test_batch import _assert_same
from tg_ds4.io.gguf import GGUFFile
from tg_ds4.models.families import config_of
from tg_ds4.runtime.batcher import Batcher, Request
from tg_ds4.runtime.runner import Runner
from tg_ds4.runtime.sampling import SamplingParams

DS4 = pathlib.Path(__file__).parent / "fixtures" / "deepseek4" / "flash" / "flash-MXFP4.gguf"
PARALLEL = 2  # batches of 1 and 2 rows (each V4 batch size is a capture of its own: ~25 s; padded rows: test_batch.py)

@pytest.fixture(scope="module")
def ds4():
  """The V4 fixture's config, a runner with PARALLEL slots (exact numerics) and a Batcher over it. A request run alone
  is one in a Batcher of its own (steps of one row, nothing reused): every step the tests run is a batched one, so a
  runner loaded again finds all of them in the step cache (the single-sequence graphs, with the slot a constant, are
  held to the references by tests/test_ds4.py)."""
  runner = Runner.load(DS4, max_ctx=192, parallel=PARALLEL, numerics="exact")
  return config_of(GGUFFile(DS4)), runner, Batcher(runner)

def _alone(runner: Runner, reqs: list[Request]) -> list:
  return [Batcher(runner).run([q])[0] for q in reqs]

def test_deepseek4_batched_answers_equal_alone(ds4):
  """DeepSeek V4 (models/deepseek4.py): each row's raw ring, compressor states, compressed rows and indexer keys in its
  own slot, at its own position. Two waves of 8 requests through 2 slots, prompts of 3 to 150 tokens: before and past
  the window (32 raw rows), the indexer's top-k (8 of the ratio-4 rows) and the first ratio-128 row; the second wave's
  prompts extend the first's conversations (prompt, answer, a new turn), so slots resume past the answers where the
  rings allow (runner.Runner.reusable); a request cancelled mid-answer frees its slot for the rest."""
  cfg, runner, b, rnd = *ds4, random.Random(11)
  assert cfg.window < 45 and 4 * cfg.idx_top_k < 45 and 128 in cfg.compress_ratios
  # seeded sampling only (a greedy row is the argmax in the same steps: test_batched_answers_equal_alone): one kind of
  # captured step per batch size
  params = [SamplingParams(temperature=rnd.choice([0.7, 1.3]), top_p=rnd.choice([1.0, 0.9]), seed=c) for c in range(8)]
  first = [Request(tuple(rnd.randrange(cfg.n_vocab) for _ in range(n)), rnd.choice([3, 6]), p, logprobs=5)
           for n, p in zip((3, 150, 14, 45, 30, 70, 5, 130), params)]
  alone = lambda reqs: _alone(runner, reqs)
  want = alone(first)
  second = [Request(q.prompt + tuple(s.token for s in a) + tuple(rnd.randrange(cfg.n_vocab) for _ in range(5)), 4, q.params, logprobs=5)
            for q, a in zip(first, want)]
  _assert_same(want, b.run(first), "deepseek4")
  # the latest conversations first: the slots still hold the last ones to end
  ids, got, resumed, cancelled = [b.submit(q) for q in second[::-1]][::-1], {}, 0, None
  while b.busy:
    for e in b.step():
      if e.cached: resumed += 1
      if e.step is not None: got.setdefault(e.rid, []).append(e.step)
      if cancelled is None and e.step is not None and not e.finished: b.cancel(cancelled := e.rid)  # after its first token
  assert resumed and cancelled is not None and len(got[cancelled]) == 1
  keep = [k for k, i in enumerate(ids) if i != cancelled]
  _assert_same(alone([second[k] for k in keep]), [got[ids[k]] for k in keep], "deepseek4, second wave")

def test_deepseek4_state_saved_and_restored_across_a_restart(ds4, tmp_path):
  """serve --kv-cache-dir for V4 (runner.kv_rows / load_kv_rows through server/kvstore.py's file, the Batcher's restore
  hook as the server's): the state a conversation leaves in its slot (rings, compressor states, the complete windows'
  rows), saved to a file and read back by a new store into a newly loaded runner, continues the next turn exactly as
  the runner that never stopped (logprobs bit for bit), and as a from-scratch run to float rounding; a damaged file
  is skipped with a warning."""
  import logging
  from tg_ds4.server.kvstore import KVStore, model_fingerprint
  cfg, runner, _ = ds4
  rnd = random.Random(5)
  prompt = [rnd.randrange(cfg.n_vocab) for _ in range(70)]
  first = Batcher(runner)
  answer = [s.token for s in first.run([Request(tuple(prompt), 4, SamplingParams(0.7, seed=3), logprobs=5)])[0]]
  held = list(first.slot_tokens[0])
  assert held == prompt + answer[:-1]
  fp = model_fingerprint(DS4, runner.cache_layout())
  KVStore(tmp_path, fp, 1 << 30, 16).save(held, runner.kv_rows(len(held), 0))
  nxt = Request(tuple(held + answer[-1:] + [rnd.randrange(cfg.n_vocab) for _ in range(6)]), 5, SamplingParams(0.7, seed=4), logprobs=5)
  def run(b: Batcher) -> tuple[list, int | None]:
    rid, steps, cached = b.submit(nxt), [], None
    while b.busy:
      for e in b.step():
        if e.rid == rid and e.cached is not None: cached = e.cached
        if e.step is not None: steps.append(e.step)
    return steps, cached
  uninterrupted, cached = run(first)  # the slot still holds the conversation
  assert cached == len(held)
  store = KVStore(tmp_path, fp, 1 << 30, 16)  # a restart: the store indexes the directory again
  entry, _ = store.lookup(list(nxt.prompt), whole=True)
  restarted = Runner.load(DS4, max_ctx=192, parallel=PARALLEL, numerics="exact")
  def restore(q, slot, start):
    restarted.load_kv_rows(entry.tokens.tolist(), store.load(entry), slot)
    return restarted.reusable(list(q), entry.tokens.tolist())
  got, cached = run(Batcher(restarted, restore))
  assert cached == len(held)
  assert [(s.token, s.logprob, s.top) for s in got] == [(s.token, s.logprob, s.top) for s in uninterrupted]
  _assert_same(_alone(restarted, [nxt]), [got], "deepseek4 from scratch")
  entry.path.write_bytes(entry.path.read_bytes()[:-1] + b"x")
  with pytest.MonkeyPatch.context() as mp:
    warned = []
    mp.setattr(logging.getLogger("tg_ds4.server"), "warning", lambda *a: warned.append(a))
    assert store.load(entry) is None and warned

def test_deepseek4_serves_two_clients_at_once(ds4):
  """`serve`'s app on the V4 fixture with PARALLEL slots (the batched steps of the tests above, which the step cache
  holds), the official openai and anthropic clients streaming at once: the openai chat's seeded sample and logprobs
  equal a single sequence's for the same rendered prompt, and the anthropic stream is well formed."""
  import asyncio
  import anthropic, openai
  try: import httpx2 as httpx  # what the current SDKs are built on (tests/test_server.py)
  except ImportError: import httpx
  from tg_ds4.server.app import build_app, load
  from tg_ds4.server.guard import Allowed
  _, runner, _ = ds4
  served = load(str(DS4), max_context=192, warmup=False, numerics="exact", parallel=PARALLEL)
  msgs = [{"role": "user", "content": "Name three rivers"}]
  want = _alone(runner, [Request(tuple(served.render(msgs, None)), 6, SamplingParams(0.7, seed=9), logprobs=5)])[0]
  async def ask():
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(served, allowed=Allowed("127.0.0.1", frozenset({"test"})))),
                                 base_url="http://test") as http:
      oai = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)
      ant = anthropic.AsyncAnthropic(base_url="http://test", api_key="none", http_client=http, max_retries=0)
      async def chat():
        return [c async for c in await oai.chat.completions.create(model="deepseek-v4", messages=msgs, max_tokens=6, temperature=0.7, seed=9,
                                                                    logprobs=True, top_logprobs=5, stream=True)]
      async def message():
        return [e async for e in await ant.messages.create(model="claude", max_tokens=5, messages=[{"role": "user", "content": "Hi"}],
                                                           stream=True)]
      return await asyncio.gather(chat(), message())
  chunks, events = asyncio.run(ask())
  lps = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
  assert 1 <= len(lps) <= len(want) and all(abs(t.logprob - s.logprob) < 1e-5 for t, s in zip(lps, want))
  text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  assert text == served.tok.decode([s.token for s in want][:len(lps)])
  kinds = [e.type for e in events]
  assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and events[-2].usage.output_tokens >= 1
