"""tg_ds4 vs llama.cpp (llama-cpp-python) on the same GGUF, same process, 2 threads: prefill and decode tok/s.

  python profiles/side_by_side.py smollm2 [qwen2.5-coder-0.5b gemma3-270m]

64-token prompt, 32 greedy tokens, medians of 3 runs after 2 warm-up runs (tinygrad compiles kernels on first use).
Several models in one go; for one model, `python -m tg_ds4 bench --vs-llama-cpp` gives the same comparison."""
import statistics, sys, time

import numpy as np

from tg_ds4.io.registry import resolve
from tg_ds4.runtime.runner import Runner

def main(name: str) -> None:
  from llama_cpp import Llama
  path = str(resolve(name))
  llm = Llama(path, n_ctx=256, n_threads=2, n_threads_batch=2, n_batch=256, verbose=False)
  ids = (llm.tokenize(b"Once upon a time, in a small village by the sea, there lived an old fisherman who", add_bos=True) * 8)[:64]
  def lcp():
    llm.reset(); t0 = time.perf_counter(); llm.eval(ids); t1 = time.perf_counter()
    for _ in range(32): llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    return len(ids) / (t1 - t0), 32 / (time.perf_counter() - t1)
  runner = Runner.load(path, max_ctx=256)
  def ours():
    list(runner.generate(ids, 33)); return runner.stats.prefill_tps, runner.stats.decode_tps
  for _ in range(2): ours()
  L, O = [lcp() for _ in range(3)], [ours() for _ in range(3)]
  med = lambda xs, i: statistics.median(x[i] for x in xs)
  print(f"{name}: prefill tok/s tg_ds4 {med(O, 0):.1f} llama.cpp {med(L, 0):.1f} ({med(O, 0) / med(L, 0):.3f}x); "
        f"decode tok/s tg_ds4 {med(O, 1):.2f} llama.cpp {med(L, 1):.1f} ({med(O, 1) / med(L, 1):.3f}x)")

if __name__ == "__main__":
  for n in sys.argv[1:] or ["smollm2"]: main(n)
