"""Encode/decode throughput of tg_ds4.text.tokenizer on English text (a benchmark, not a test).

  python profiles/tokenizer_speed.py smollm2                       # registry name, or a .gguf path
  python profiles/tokenizer_speed.py qwen2.5-coder-0.5b --text FILE --backend python

The default text is the Python language reference shipped with CPython (pydoc_data.topics, ~0.46 MB of English prose
with code). "cold" is the first encode with a fresh tokenizer (every word is new to the per-word cache), "warm" repeats
it; decode is ids back to text.
"""
import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from tg_ds4.io import registry  # noqa: E402
from tg_ds4.io.gguf import GGUFFile  # noqa: E402
from tg_ds4.text.tokenizer import Tokenizer  # noqa: E402

def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("model", help="registry name or GGUF path")
  ap.add_argument("--text", help="UTF-8 text file (default: CPython's pydoc_data.topics)")
  ap.add_argument("--backend", default="auto", choices=("auto", "python"))
  ap.add_argument("--repeat", type=int, default=3, help="warm runs (best is reported)")
  args = ap.parse_args()
  if args.text: text = pathlib.Path(args.text).read_text(encoding="utf-8")
  else:
    import pydoc_data.topics
    text = "\n\n".join(pydoc_data.topics.topics.values())
  mb = len(text.encode()) / 1e6
  t0 = time.perf_counter(); gf = GGUFFile(registry.resolve(args.model)); t1 = time.perf_counter()
  tok = Tokenizer.from_gguf(gf, backend=args.backend); t2 = time.perf_counter()
  print(f"{tok}  gguf read {t1 - t0:.2f}s, tokenizer build {t2 - t1:.2f}s, text {mb:.2f} MB")
  t0 = time.perf_counter(); ids = tok.encode(text); cold = time.perf_counter() - t0
  warm = min(_timed(lambda: tok.encode(text)) for _ in range(args.repeat))
  dec = min(_timed(lambda: tok.decode(ids)) for _ in range(args.repeat))
  print(f"encode cold {mb / cold:6.2f} MB/s  warm {mb / warm:6.2f} MB/s  ({len(ids)} tokens, {len(text.encode()) / len(ids):.2f} bytes/token)")
  print(f"decode      {mb / dec:6.2f} MB/s")

def _timed(f) -> float:
  t0 = time.perf_counter(); f()
  return time.perf_counter() - t0

if __name__ == "__main__": main()
