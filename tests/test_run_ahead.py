"""Run-ahead greedy generation (runtime/runner.py's steps on a device that runs steps asynchronously): RUN_AHEAD chained
steps launched at a time, each reading its token from the device and writing the next there, give the tokens the
per-token loop gives, stop where it stops (mid-burst included), and count as cached only the rows of the tokens fed
before the stop. Forced on the CPU here (exact float32), where the loop would otherwise read each token back."""
import pathlib

import pytest

from tg_ds4.runtime.runner import Runner

DS3 = pathlib.Path(__file__).parent / "fixtures" / "deepseek2" / "ds3" / "ds3-Q4_0.gguf"
PROMPT = [1, 5, 9, 13, 2, 7, 22, 3]

@pytest.fixture(scope="module")
def runner():
  return Runner.load(DS3, max_ctx=64, numerics="exact")

def generate(r: Runner, ahead: int, n: int, stop=frozenset()) -> list[int]:
  r.run_ahead = ahead
  return list(r.generate(PROMPT, n, stop=stop))

def test_run_ahead_gives_the_per_token_loops_tokens_and_stops_where_it_stops(runner):
  want = generate(runner, 1, 23)  # 23: the last burst is short
  assert len(want) == 23 and len(set(want)) > 3
  assert generate(runner, 4, 23) == want
  stop = want[9]  # the second token of the third burst of 4 (tokens 1-4, 5-8, 9-12 come in bursts after the first)
  first = want.index(stop)
  assert generate(runner, 4, 23, stop={stop}) == want[:first + 1]
  assert runner.cached == PROMPT + want[:first]  # rows of the tokens fed before the stop: not the ones run ahead
  assert generate(runner, 4, 1) == want[:1]
