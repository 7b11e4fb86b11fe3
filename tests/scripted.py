"""A scripted engine behind the real server stack: the HTTP side (validation, limits, streaming, errors) tested without a
model to compile. `python tests/scripted.py --port N [serve's HTTP flags]` runs it as `serve` would (uvicorn with the
connection limits) over the 512-token fixture vocabulary."""
from __future__ import annotations

import argparse, logging, pathlib, sys, time

from tg_ds4.runtime.runner import Step
from tg_ds4.runtime.sampling import SamplingParams
from tg_ds4.server.app import build_app, run
from tg_ds4.server.body import BodyLimits
from tg_ds4.server.guard import Allowed
from tg_ds4.server.served import Served
from tg_ds4.server.worker import Worker
from tg_ds4.text.chat_template import Template

VOCAB = pathlib.Path(__file__).resolve().parent / "fixtures/deepseek2/ds3/ds3-Q8_0.gguf"
MODEL_ID = "tiny-chat"
TEMPLATE = "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"

log = logging.getLogger("scripted")

class ScriptedRunner:
  """Stands in for Runner in the worker: 'generates' a fixed token script instantly and records the prompts. A script
  containing `fail` raises there, as a broken model would. With `hold`, every token after the first waits until that
  file exists: a request that keeps the worker busy for as long as a test needs."""
  def __init__(self, script: list[int], fail: int | None = None, hold: pathlib.Path | None = None):
    self.script, self.fail, self.hold, self.cached, self.prompts = script, fail, hold, [], []
  def reusable(self, prompt): return 0
  def steps(self, prompt, max_new, params=SamplingParams(), stop=frozenset(), start_pos=0, logprobs=None):
    self.prompts.append(prompt)
    log.info("scripted: generating for a %d-token prompt", len(prompt))
    for i, t in enumerate(self.script[:max_new]):
      while i and self.hold is not None and not self.hold.exists(): time.sleep(0.01)
      if t == self.fail: raise RuntimeError("secret internal detail /home/user/model.gguf")
      yield Step(t, -0.5 if logprobs is not None else None, ((t, -0.5),) * (logprobs or 0))
      if t in stop: return

def scripted_served(tok, script: list[int], template: str = TEMPLATE, start=True, max_queue=8, fail: int | None = None,
                    hold: pathlib.Path | None = None) -> Served:
  worker = Worker(lambda: (ScriptedRunner(script, fail, hold), None), max_queue=max_queue)
  if start: worker.start().wait_loaded()
  return Served(MODEL_ID, frozenset({MODEL_ID}), tok, Template(template), 512, worker)

if __name__ == "__main__":
  from tg_ds4.io.gguf import GGUFFile
  from tg_ds4.text.tokenizer import Tokenizer
  a = argparse.ArgumentParser()
  a.add_argument("--port", type=int, required=True)
  a.add_argument("--host", default="127.0.0.1")
  a.add_argument("--text", default="Hello there, this is a scripted answer.")
  a.add_argument("--fail", action="store_true", help="the engine raises at the first token")
  a.add_argument("--hold", type=pathlib.Path, help="tokens after the first wait until this file exists")
  a.add_argument("--max-body-bytes", type=int, default=8 << 20)
  a.add_argument("--max-parsing", type=int, default=2)
  a.add_argument("--head-timeout", type=float, default=10.0)
  a.add_argument("--body-timeout", type=float, default=30.0)
  a.add_argument("--max-connections", type=int, default=256)
  a.add_argument("--allow-host", action="append", default=[])
  a.add_argument("--allow-origin", action="append", default=[])
  args = a.parse_args()
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
  tok = Tokenizer.from_gguf(GGUFFile(VOCAB))
  script = tok.encode(args.text, add_special=False)
  served = scripted_served(tok, script, fail=script[0] if args.fail else None, hold=args.hold)
  app = build_app(served, BodyLimits(args.max_body_bytes, 64, args.body_timeout, args.max_parsing),
                  Allowed(args.host, frozenset(args.allow_host), frozenset(args.allow_origin)))
  run(app, args.host, args.port, args.head_timeout, args.max_connections)
