"""Batched decode steps A/B in one process: `python profiles/ab_batch.py MODEL ROWS TG_DS4_KNOB [STEPS]` loads MODEL twice
with ROWS slots, once with the knob (an environment variable the step reads when it is captured) at 0 and once at 1,
plus a one-sequence runner, and replays the three captured steps alternately STEPS times (default 30): the median
wall of each, and each batched step's aggregate against one stream. Alternating step by step cancels the machine's
drift, which two `bench --parallel` runs minutes apart do not. The step cache is keyed by TG_DS4_*
variables, so a knob with that prefix gets its own captured step."""
import os, statistics, sys, time

from tg_ds4.io.registry import resolve
from tg_ds4.runtime.runner import Runner


def main(path: str, B: int, knob: str, steps: int = 30) -> None:
  rs = {}
  for v in ("0", "1"):
    os.environ[knob] = v
    r = Runner.load(path, max_ctx=128, parallel=B)
    for i in range(3): r.batch_step([5 + i * 7 + j for j in range(B)], list(range(B)), [40 + i] * B)
    rs[v] = r
  one = Runner.load(path, max_ctx=128)
  for i in range(3): one.next_token(5 + i, 40 + i).item()
  times: dict[str, list[float]] = {v: [] for v in [*rs, "one"]}
  for i in range(steps):  # each row its own token (MoE rows choose different experts), positions 41..60
    for v, r in rs.items():
      t0 = time.perf_counter(); r.batch_step([5 + j * 13 + i for j in range(B)], list(range(B)), [41 + i % 20] * B)
      times[v].append(time.perf_counter() - t0)
    t0 = time.perf_counter(); one.next_token(7 + i, 41 + i % 20).item(); times["one"].append(time.perf_counter() - t0)
  m = {v: 1e3 * statistics.median(t) for v, t in times.items()}
  for v in rs: print(f"{knob}={v}: {m[v]:.2f} ms a {B}-row step, {B * m['one'] / m[v]:.2f}x one stream ({m['one']:.2f} ms a token)")

if __name__ == "__main__":
  if len(sys.argv) not in (4, 5): sys.exit(__doc__.split(":")[0] + ": " + __doc__.split("`")[1])
  main(str(resolve(sys.argv[1])), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]) if len(sys.argv) == 5 else 30)
