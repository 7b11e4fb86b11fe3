"""Time to first token through `python -m tg_ds4 serve` for a ~1,000-token prompt: uncached, with the shared prefix in
the worker's KV cache (a second turn), and with it on disk after a restart (--kv-cache-dir).

  python profiles/ttft.py [MODEL] [--tokens 1000]      (default model qwen2.5-coder-0.5b)

Each request is a streamed /v1/completions call (greedy, 4 tokens); TTFT = request sent -> first text chunk received.
The server warms up (compiles) before answering /health, so no compile time is counted."""
from __future__ import annotations

import argparse, json, os, pathlib, socket, subprocess, sys, tempfile, time, urllib.error, urllib.request

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]

def start(model: str, kvdir: str, log) -> tuple[subprocess.Popen, str]:
  port = free_port()
  proc = subprocess.Popen([sys.executable, "-m", "tg_ds4", "serve", "-m", model, "--port", str(port), "--max-context", "2048",
                           "--kv-cache-dir", kvdir], stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
  url = f"http://127.0.0.1:{port}"
  while True:
    if proc.poll() is not None: raise SystemExit(f"server exited with {proc.returncode}; see {log.name}")
    try:
      with urllib.request.urlopen(url + "/health", timeout=2) as r:
        if r.status == 200: return proc, url
    except (urllib.error.URLError, OSError): pass
    time.sleep(0.5)

def ttft(url: str, model_id: str, prompt: str) -> tuple[float, float, dict]:
  body = {"model": model_id, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
  t0, first, usage = time.perf_counter(), None, {}
  req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"})
  with urllib.request.urlopen(req, timeout=3600) as r:
    for raw in r:
      line = raw.decode().strip()
      if not line.startswith("data: {"): continue
      chunk = json.loads(line[6:])
      if first is None and chunk["choices"] and chunk["choices"][0]["text"]: first = time.perf_counter() - t0
      usage = chunk.get("usage") or usage
  return first or float("nan"), time.perf_counter() - t0, usage

def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b")
  ap.add_argument("--tokens", type=int, default=1000)
  args = ap.parse_args()
  from tg_ds4.io.gguf import GGUFFile
  from tg_ds4.io.registry import resolve
  from tg_ds4.text.tokenizer import Tokenizer
  path = resolve(args.model)
  gf = GGUFFile(path)
  tok, model_id = Tokenizer.from_gguf(gf), str(gf.get("general.name") or pathlib.Path(path).stem)
  text = (REPO / "README.md").read_text() * 4
  prefix = tok.decode(tok.encode(text, add_special=False)[:args.tokens])
  rows = []
  with tempfile.TemporaryDirectory() as kvdir, open(pathlib.Path(kvdir).parent / "ttft-server.log", "wb") as log:
    proc, url = start(args.model, kvdir, log)
    try:
      rows.append(("uncached", *ttft(url, model_id, prefix + "\n\nQuestion A: what is this?")))
      rows.append(("prefix in memory (2nd request)", *ttft(url, model_id, prefix + "\n\nQuestion B: who wrote it?")))
      time.sleep(2)  # let the KV file be written
    finally: proc.terminate(); proc.wait()
    proc, url = start(args.model, kvdir, log)
    try: rows.append(("prefix from disk (after restart)", *ttft(url, model_id, prefix + "\n\nQuestion C: why?")))
    finally: proc.terminate(); proc.wait()
  print(f"{args.model}: TTFT for a {args.tokens}-token shared prefix (greedy, streamed /v1/completions)")
  print(f"{'case':<34} {'prompt':>7} {'cached':>7} {'TTFT s':>8} {'total s':>8}")
  for name, first, total, u in rows:
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    print(f"{name:<34} {u.get('prompt_tokens', 0):>7} {cached:>7} {first:>8.2f} {total:>8.2f}")

if __name__ == "__main__": main()
