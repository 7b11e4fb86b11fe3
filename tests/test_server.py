"""`python -m tg_ds4 serve` end to end on a tiny random-weight llama (the deepseek fixture's 512-token BPE vocab, a
ChatML template with tools), started on 127.0.0.1 in a subprocess: the official openai and anthropic clients, greedy
equality with `generate`, 16 concurrent clients, disconnects, prefix KV reuse in memory and across a restart, every
error status, and a fuzzer driven by the OpenAPI schema the server publishes. In-process (a scripted engine instead of
a model): tool calls through both APIs, stop strings, 429; and the KV store's file checks."""
import asyncio, codecs, dataclasses, json, os, pathlib, re, socket, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import anthropic, openai  # dev dependencies (make install): missing, the module fails rather than skips
try: import httpx2 as httpx  # noqa: E402  (what the current SDKs are built on; older ones use httpx itself)
except ImportError: import httpx  # noqa: E402
from gguf import GGUFReader, GGUFValueType, GGUFWriter  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from tg_ds4.io.gguf import GGUFFile  # noqa: E402
from tg_ds4.runtime.sampling import SamplingParams  # noqa: E402
from tg_ds4.server.app import build_app  # noqa: E402
from tg_ds4.server.guard import Allowed  # noqa: E402
from scripted import scripted_served  # noqa: E402
from tg_ds4.server.kvstore import tokens_key  # noqa: E402
from tg_ds4.server.worker import Job  # noqa: E402
from tg_ds4.text.tokenizer import Tokenizer  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
VOCAB = REPO / "tests/fixtures/deepseek2/ds3/ds3-Q8_0.gguf"
MODEL_ID, CTX = "tiny-chat", 256
TEMPLATE = (
  "{%- if tools %}{{ '<|im_start|>system\\n' }}{% if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
  "{{ '# Tools\\n<tools>' }}{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}"
  "{{ '\\n</tools>\\nCall one as <tool_call>\\n{\"name\": <name>, \"arguments\": <args>}\\n</tool_call><|im_end|>\\n' }}"
  "{%- elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{% endif %}"
  "{%- for m in messages %}"
  "{%- if m.role == 'assistant' and m.tool_calls %}{{ '<|im_start|>assistant\\n' + m.content }}{% for tc in m.tool_calls %}"
  "{{ '<tool_call>\\n{\"name\": \"' + tc.function.name + '\", \"arguments\": ' + (tc.function.arguments | tojson) + '}\\n</tool_call>' }}"
  "{% endfor %}{{ '<|im_end|>\\n' }}"
  "{%- elif m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
  "{%- elif m.role != 'system' or not loop.first %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
  "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

def write_chat_llama(dst: pathlib.Path, n_layer: int = 1, seed: int = 0, vocab: pathlib.Path = VOCAB, template: str | None = TEMPLATE) -> None:
  """A 1-block llama (dim 64, GQA 4/2) with random weights, the tokenizer of the GGUF `vocab` (default the deepseek
  fixture's) and `template` (None: `vocab`'s own chat template): quick to compile and to decode, and
  its greedy output depends on the prompt (large embedding/output scales)."""
  r = GGUFReader(vocab)
  w = GGUFWriter(str(dst), "llama")
  D, H, KV, FF, V = 64, 4, 2, 128, len(r.fields["tokenizer.ggml.tokens"].contents())
  w.add_name(MODEL_ID); w.add_block_count(n_layer); w.add_context_length(512); w.add_embedding_length(D); w.add_feed_forward_length(FF)
  w.add_head_count(H); w.add_head_count_kv(KV); w.add_layer_norm_rms_eps(1e-5); w.add_rope_freq_base(10000.0)
  for name, f in r.fields.items():
    if not name.startswith("tokenizer.") or (name == "tokenizer.chat_template" and template is not None): continue
    t = f.types[0]
    if t == GGUFValueType.ARRAY: w.add_array(name, f.contents())
    elif t == GGUFValueType.STRING: w.add_string(name, f.contents())
    else: w.add_key_value(name, f.contents(), t)
  if template is not None: w.add_string("tokenizer.chat_template", template)
  rng = np.random.default_rng(seed)
  W = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)
  w.add_tensor("token_embd.weight", W(V, D) * 8); w.add_tensor("output.weight", W(V, D) * 4)
  w.add_tensor("output_norm.weight", np.ones(D, np.float32))
  for i in range(n_layer):
    p = f"blk.{i}."
    for n, x in (("attn_norm", np.ones(D, np.float32)), ("ffn_norm", np.ones(D, np.float32)), ("attn_q", W(D, D)), ("attn_k", W(KV * D // H, D)),
                 ("attn_v", W(KV * D // H, D)), ("attn_output", W(D, D)), ("ffn_gate", W(FF, D)), ("ffn_up", W(FF, D)), ("ffn_down", W(D, FF))):
      w.add_tensor(p + n + ".weight", x)
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

def _env():
  return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]

class Server:
  """`python -m tg_ds4 serve` in a subprocess on 127.0.0.1; restart() keeps the KV cache directory."""
  def __init__(self, model: pathlib.Path, tmp: pathlib.Path):
    self.model, self.tmp, self.kvdir, self.n, self.proc = model, tmp, tmp / "kv", 0, None

  def start(self):
    self.n += 1
    self.port, self.logpath = _free_port(), self.tmp / f"server{self.n}.log"
    self.url = f"http://127.0.0.1:{self.port}"
    with open(self.logpath, "wb") as log:
      self.proc = subprocess.Popen([sys.executable, "-m", "tg_ds4", "serve", "-m", str(self.model), "--port", str(self.port),
                                    "--max-context", str(CTX), "--kv-cache-dir", str(self.kvdir), "--kv-cache-min-tokens", "24",
                                    "--max-body-bytes", "65536"],
                                   stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=_env())
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
      if self.proc.poll() is not None: raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log()}")
      try:
        if httpx.get(self.url + "/health", timeout=2).status_code == 200: return self
      except httpx.HTTPError: pass
      time.sleep(0.3)
    raise TimeoutError(self.log())

  def stop(self):
    if self.proc and self.proc.poll() is None:
      self.proc.terminate()
      try: self.proc.wait(30)
      except subprocess.TimeoutExpired: self.proc.kill(); self.proc.wait()

  def restart(self): self.stop(); return self.start()
  def log(self) -> str: return self.logpath.read_text(errors="replace")
  def health(self) -> dict: return httpx.get(self.url + "/health", timeout=10).json()
  def openai(self): return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)
  def anthropic(self): return anthropic.Anthropic(base_url=self.url, api_key="none", max_retries=0, timeout=120)

@pytest.fixture(scope="module")
def model(tmp_path_factory):
  path = tmp_path_factory.mktemp("model") / "tiny-chat.gguf"
  write_chat_llama(path)
  return path

CLI_PROMPT = "The rivers of the world"

@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
  # `generate` for the greedy comparison compiles while the server does (each process compiles its own kernels)
  cli = subprocess.Popen([sys.executable, "-m", "tg_ds4", "generate", "-m", str(model), "-p", CLI_PROMPT, "-n", "12", "--max-context", str(CTX)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=_env())
  s = Server(model, tmp_path_factory.mktemp("server")).start()
  s.cli = cli
  yield s
  s.stop()
  if cli.poll() is None: cli.kill()
  cli.communicate()

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three rivers"}]

def _complete(client, prompt, n=8):
  r = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=n, temperature=0)
  return r.choices[0].text

# *** official clients ***

def test_openai_client_chat_stream_and_logprobs(server):
  c = server.openai()
  assert [m.id for m in c.models.list().data] == [MODEL_ID]
  r = c.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=8, temperature=0)
  ch = r.choices[0]
  assert ch.finish_reason in ("length", "stop") and ch.message.role == "assistant" and ch.message.content
  u = r.usage
  assert u.prompt_tokens > 20 and 0 < u.completion_tokens <= 8 and u.total_tokens == u.prompt_tokens + u.completion_tokens
  chunks = list(c.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=8, temperature=0, stream=True,
                                          stream_options={"include_usage": True}))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(k.choices[0].delta.content or "" for k in chunks if k.choices) == ch.message.content
  assert [k.choices[0].finish_reason for k in chunks if k.choices and k.choices[0].finish_reason] == [ch.finish_reason]
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
  assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1  # the same prompt again: all but the last token reused
  sampled = [c.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=6, temperature=0.9, top_p=0.95, seed=seed,
                                       extra_body={"top_k": 40, "min_p": 0.01}).choices[0].message.content for seed in (7, 7, 8, 9, 10)]
  assert sampled[0] == sampled[1]  # the same seed, the same text
  assert len(set(sampled)) >= 2, sampled  # and the seed is used: four seeds do not all give one text
  lp = c.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
  content = lp.choices[0].logprobs.content
  text = lp.choices[0].message.content  # the tokens' bytes up to the last whole character (a cut one is in `bytes`, not in the text)
  assert codecs.getincrementaldecoder("utf-8")("replace").decode(b"".join(bytes(t.bytes) for t in content)) == text == ch.message.content[:len(text)]
  for t in content:  # greedy: the chosen token is the most likely one, and the top list is sorted
    assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token and abs(t.top_logprobs[0].logprob - t.logprob) < 1e-6
    assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob and t.logprob <= 0

def test_anthropic_client_messages_and_stream(server):
  a = server.anthropic()
  kw = dict(model=MODEL_ID, max_tokens=8, system="You are terse.", messages=[{"role": "user", "content": "Name three rivers"}],
            extra_body={"temperature": 0})  # (current SDKs no longer have the argument; the API still takes the field)
  m = a.messages.create(**kw)
  assert m.role == "assistant" and m.content[0].type == "text" and m.stop_reason in ("max_tokens", "end_turn") and m.usage.output_tokens <= 8
  same = server.openai().chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=8, temperature=0)
  assert m.content[0].text == same.choices[0].message.content  # one template, one prompt, one greedy answer
  events = list(a.messages.create(**kw, stream=True))
  kinds = [e.type for e in events]
  assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
  assert set(kinds[2:-3]) == {"content_block_delta"}
  assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == m.content[0].text
  assert events[0].message.usage.cache_read_input_tokens > 0 and events[-2].delta.stop_reason == m.stop_reason
  with a.messages.stream(**kw) as s: final = s.get_final_message()
  assert final.content[0].text == m.content[0].text and final.usage.output_tokens == m.usage.output_tokens

def test_greedy_equals_cli_generate(server):
  out, err = server.cli.communicate(timeout=900)
  assert server.cli.returncode == 0, err.decode()
  assert _complete(server.openai(), CLI_PROMPT, 12) == out.decode("utf-8")

# *** one worker, many connections ***

def test_concurrent_clients_get_their_own_answers(server):
  prompts = [f"Question {i}: {w}" for i, w in enumerate(["rivers", "mountains", "the sea", "tinygrad", "kernels", "weights", "caches", "bytes"])]
  expected = {p: _complete(server.openai(), p, 6) for p in prompts}  # sequential greedy results
  assert len(set(expected.values())) > 4  # different prompts answer differently, so a mix-up would show
  def client(i):
    c = server.openai()
    return [(p, _complete(c, p, 6)) for p in (prompts[(i + j) % len(prompts)] for j in range(4))]
  with ThreadPoolExecutor(16) as ex: got = [r for rs in ex.map(client, range(16)) for r in rs]
  assert len(got) == 64 and all(text == expected[p] for p, text in got)
  # the warm-up captured every step these requests take (every batch size, greedy and sampled, every prefill chunk):
  # none waited on a compile (the logprob heads, captured per bucket on first use, are not warmed)
  log = server.log().split("warm-up done", 1)
  assert len(log) == 2 and "warm-up 1/" in log[0], log[0][-2000:]
  assert not [ln for ln in log[1].splitlines() if " captured in " in ln and not re.search(r"step head-[\w-]+-\d+ captured", ln)], log[1][-3000:]
  h = server.health()
  assert h["queued"] == 0 and h["slots"] == 4 and h["peak_running"] == 4, h  # serve's default: 4 slots, all used together

def test_disconnected_stream_frees_the_worker_within_one_token(server):
  # (both prompts make this model write ~240 tokens before any end-of-text token, so a cut is always mid-answer)
  c, story, essay = server.openai(), "Once upon a time", "Write an essay"
  _complete(c, "Still there?", 2)  # the answers to compare against come from a cache that holds neither prompt
  fresh = c.completions.create(model=MODEL_ID, prompt=story, max_tokens=8, temperature=0)
  assert fresh.usage.prompt_tokens_details.cached_tokens < fresh.usage.prompt_tokens - 1
  sampled = dict(model=MODEL_ID, prompt=essay, max_tokens=8, temperature=0.9, seed=3)
  fresh_sampled = c.completions.create(**sampled).choices[0].text
  before = server.health()["cancelled"]
  body = {"model": MODEL_ID, "prompt": story, "max_tokens": 10_000, "temperature": 0, "stream": True}
  with httpx.Client(timeout=60) as http, http.stream("POST", server.url + "/v1/completions", json=body) as r:
    for line in r.iter_lines():
      if line.startswith("data: {"): break  # one token in, then hang up
  deadline = time.monotonic() + 30
  while (h := server.health())["busy"] or h["cancelled"] == before:
    assert time.monotonic() < deadline, h
    time.sleep(0.02)
  assert h["last_cancel"]["tokens_after_cancel"] <= 1 and h["last_cancel"]["generated"] < CTX - 10, h["last_cancel"]
  # the worker serves the next request, and the cut answer's rows left in the cache change nothing: the same prompt
  # again (all but its last token reused) answers as it did from a cold cache
  again = c.completions.create(model=MODEL_ID, prompt=story, max_tokens=8, temperature=0)
  assert again.choices[0].text == fresh.choices[0].text and again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
  before = server.health()["cancelled"]  # the same for a non-streaming request whose client gives up
  with pytest.raises(httpx.TimeoutException):
    httpx.post(server.url + "/v1/completions", json={**body, "stream": False, "prompt": essay, "temperature": 0.9, "seed": 3}, timeout=0.05)
  while (h := server.health())["busy"] or h["cancelled"] == before:
    assert time.monotonic() < deadline + 30, h
    time.sleep(0.02)
  assert h["last_cancel"]["tokens_after_cancel"] <= 1 and h["last_cancel"]["generated"] < CTX - 10, h["last_cancel"]
  assert c.completions.create(**sampled).choices[0].text == fresh_sampled  # a seeded draw after a cut one: the same text

def test_sampling_parameters_shape_what_is_drawn(server):
  """The first token drawn under 16 seeds: temperature spreads the draws, top_k / min_p / top_p keep them inside the set
  the greedy request's logprobs (the raw distribution, which the filters act on) say they may come from, and a
  temperature near 0 draws the greedy token."""
  c = server.openai()
  top = c.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=1, temperature=0, logprobs=True,
                                  top_logprobs=20).choices[0].logprobs.content[0].top_logprobs
  key = lambda t: tuple(t.bytes)  # a token's bytes name it (several byte tokens print as the same replacement character)
  lp = {key(t): t.logprob for t in top}
  assert len(lp) == 20
  def draws(temperature, **extra):
    return [key(c.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=1, temperature=temperature, seed=seed, logprobs=True,
                                          **({"extra_body": extra} if extra else {})).choices[0].logprobs.content[0]) for seed in range(16)]
  hot, best = draws(2.0), key(top[0])
  assert len(set(hot)) >= 5, hot
  top2 = draws(2.0, top_k=2)
  assert set(top2) == {key(top[0]), key(top[1])}, top2
  assert set(draws(2.0, min_p=0.3)) <= {t for t, v in lp.items() if v >= lp[best] + np.log(0.3)}
  nucleus = [key(t) for i, t in enumerate(top) if sum(np.exp(x.logprob) for x in top[:i]) < 0.6]  # the smallest set with mass >= 0.6
  assert set(draws(2.0, top_p=0.6)) <= set(nucleus)
  assert draws(0.01) == [best] * 16

# *** prefix KV reuse ***

def test_second_chat_turn_reuses_the_cache(server):
  c = server.openai()
  r1 = c.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=6, temperature=0)
  turn2 = CHAT + [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "And three lakes"}]
  r2 = c.chat.completions.create(model=MODEL_ID, messages=turn2, max_tokens=6, temperature=0)
  cached = r2.usage.prompt_tokens_details.cached_tokens
  assert r1.usage.prompt_tokens - 4 <= cached < r2.usage.prompt_tokens, (cached, r1.usage, r2.usage)

# *** errors ***

def test_errors_have_their_status_and_shape(server):
  u, ok = server.url, {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
  anth = {**ok, "max_tokens": 1}
  def post(path, body=None, raw=None, **kw):
    return httpx.post(u + path, content=raw if raw is not None else json.dumps(body), headers={"content-type": "application/json"}, timeout=60, **kw)
  def oai(r, status, param=None):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert e["type"] and e["message"] and (param is None or e["param"] == param), e
  def ant(r, status, kind):
    assert r.status_code == status and r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.text
  before = server.health()
  oai(post("/v1/chat/completions", raw=b'{"model": "x", "messages": ['), 400)
  ant(post("/v1/messages", raw=b"{not json"), 400, "invalid_request_error")
  oai(post("/v1/chat/completions", raw=b"[1, 2]"), 400)
  oai(post("/v1/chat/completions", {**ok, "messages": "hi"}), 400, "messages")
  oai(post("/v1/chat/completions", {**ok, "temperature": "hot"}), 400, "temperature")
  oai(post("/v1/chat/completions", {**ok, "stream": 1}), 400, "stream")
  oai(post("/v1/chat/completions", raw=json.dumps({**ok, "logit_bias": {"\ud800": "x"}}).encode()), 400)  # a lone surrogate in the error
  ant(post("/v1/messages", {**anth, "max_tokens": "1"}), 400, "invalid_request_error")
  oai(post("/v1/completions", {"model": MODEL_ID, "prompt": "word " * 400}), 400, "prompt")
  ant(post("/v1/messages", {**anth, "messages": [{"role": "user", "content": "word " * 400}]}), 400, "invalid_request_error")
  oai(post("/v1/completions", raw=json.dumps({"model": MODEL_ID, "prompt": "x" * 70_000}).encode()), 413)
  oai(post("/v1/completions", raw=iter([b'{"model": "', b"x" * 70_000, b'"}'])), 413)  # chunked: no content-length to go by
  ant(post("/v1/messages", raw=json.dumps({**anth, "system": "x" * 70_000}).encode()), 413, "request_too_large")
  deep = {**ok, "metadata": json.loads("[" * 100 + "]" * 100)}
  oai(post("/v1/chat/completions", deep), 400)
  assert "nested" in post("/v1/chat/completions", deep).json()["error"]["message"]
  for field, value in (("n", 2), ("tool_choice", "required"), ("response_format", {"type": "json_object"}), ("logit_bias", {"1": 5}),
                       ("presence_penalty", 0.5), ("top_logprobs", 50), ("top_p", 0), ("stop", ["a"] * 20)):
    r = post("/v1/chat/completions", {**ok, field: value, "logprobs": True})
    oai(r, 400, field)
    assert field in r.json()["error"]["message"]
  r = post("/v1/messages", {**anth, "thinking": {"type": "enabled"}})
  ant(r, 400, "invalid_request_error"); assert "thinking" in r.json()["error"]["message"]
  oai(post("/v1/completions", {"model": MODEL_ID, "prompt": ["a", "b"]}), 400, "prompt")
  oai(post("/v1/completions", {"model": MODEL_ID, "prompt": [1, 99999]}), 400, "prompt")
  oai(post("/v1/completions", {"model": MODEL_ID, "prompt": "hi", "echo": True}), 400, "echo")
  assert httpx.get(u + "/v1/nothing").status_code == 404
  after = server.health()
  assert (after["completed"], after["tokens"], after["failed"]) == (before["completed"], before["tokens"], 0)  # no inference ran

def test_any_model_name_is_answered_by_the_model_served(server):
  """Clients send the model name they were configured with: the one model answers, under its own id (the file's stem,
  as /v1/models lists it), and the docs' client example runs as written."""
  example = (REPO / "docs/serving.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]
  assert 'model="any"' in example and "http://127.0.0.1:8000" in example
  exec(example.replace("http://127.0.0.1:8000", server.url), {})
  r = server.openai().chat.completions.create(model="gpt-9", messages=CHAT, max_tokens=4, temperature=0)
  same = server.openai().chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=4, temperature=0)
  assert r.model == MODEL_ID and r.choices[0].message.content == same.choices[0].message.content
  m = server.anthropic().messages.create(model="claude-9", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
  assert m.model == MODEL_ID and m.content[0].text
  assert httpx.get(server.url + "/v1/models/gpt-9").json()["id"] == MODEL_ID
  assert "serving it as 'tiny-chat' (requests naming any other model get it too)" in server.log()

def test_strict_model_name_refuses_other_names(tok):
  """--strict-model-name: a name that is not the served id or one of its aliases is a 404 in each API's shape."""
  served = dataclasses.replace(scripted_served(tok, tok.encode("ok", add_special=False)), strict=True, aliases=frozenset({"tiny-chat.gguf"}))
  app = build_app(served, allowed=Allowed("127.0.0.1", frozenset({"test"})))
  async def fn(http, oai, ant):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = await http.post("/v1/chat/completions", json={**chat, "model": "gpt-9"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model" and "this server serves 'tiny-chat'" in r.json()["error"]["message"]
    r = await http.post("/v1/messages", json={**chat, "model": "claude-9"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert (await http.get("/v1/models/gpt-9")).status_code == 404 and (await http.get("/v1/models/tiny-chat")).status_code == 200
    for name in (MODEL_ID, "tiny-chat.gguf"):
      r = await http.post("/v1/chat/completions", json={**chat, "model": name})
      assert r.status_code == 200 and r.json()["model"] == MODEL_ID
  _run(app, fn)

def test_fuzzed_requests_never_get_a_5xx(server):
  schema = httpx.get(server.url + "/openapi.json").json()
  comps = schema["components"]["schemas"]
  base = {"/v1/chat/completions": {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0},
          "/v1/completions": {"model": MODEL_ID, "prompt": "hi", "max_tokens": 2, "temperature": 0},
          "/v1/messages": {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}}
  def props(path):
    ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return sorted(comps[ref.rsplit("/", 1)[1]]["properties"])
  fields = {p: props(p) for p in base}
  assert {"messages", "max_tokens", "logprobs", "tools"} <= set(fields["/v1/chat/completions"]) and "stop_sequences" in fields["/v1/messages"]
  scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12)
  values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=8)
  def mutate(path):
    set_field = st.tuples(st.sampled_from(fields[path]), values).map(lambda kv: {**base[path], kv[0]: kv[1]})
    drop_field = st.sampled_from(sorted(base[path])).map(lambda k: {f: v for f, v in base[path].items() if f != k})
    bad_message = st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "name"]), values, max_size=3)
    bad_message = bad_message.map(lambda m: {**base[path], "messages": [m]})
    return st.one_of(set_field, drop_field, bad_message, values)
  cases = st.sampled_from(sorted(base)).flatmap(lambda p: st.tuples(st.just(p), st.one_of(mutate(p), st.binary(max_size=40))))
  seen = []
  with httpx.Client(timeout=120) as http:
    @settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(cases)
    def check(case):
      path, body = case
      raw = body if isinstance(body, bytes) else json.dumps(body).encode()
      r = http.post(server.url + path, content=raw, headers={"content-type": "application/json"})
      seen.append(r.status_code)
      assert r.status_code < 500, (path, raw[:300], r.status_code, r.text[:300])
    check()
  assert len(seen) >= 200 and {400, 200} <= set(seen)
  assert server.health()["failed"] == 0

# *** persistent KV cache (last: restarts the server) ***

def test_kv_cache_survives_a_restart_and_a_corrupt_file_is_ignored(server, model):
  tok = Tokenizer.from_gguf(GGUFFile(model))
  p1 = "alpha " + " ".join(f"river{i}" for i in range(12))
  p2 = "zeta " + " ".join(f"lake{i}" for i in range(12))
  ids1, ids2 = tok.encode(p1), tok.encode(p2)
  assert 24 <= len(ids1) < CTX - 20 and 24 <= len(ids2) and ids1[0] != ids2[0]
  c = server.openai()
  t1, t2 = _complete(c, p1), _complete(c, p2)
  f1, f2 = server.kvdir / (tokens_key(ids1) + ".kv"), server.kvdir / (tokens_key(ids2) + ".kv")
  deadline = time.monotonic() + 30
  while not (f1.exists() and f2.exists()):
    assert time.monotonic() < deadline, list(server.kvdir.iterdir())
    time.sleep(0.05)
  server.restart()
  data = bytearray(f2.read_bytes()); data[len(data) // 2] ^= 0xFF; f2.write_bytes(bytes(data))  # one flipped byte in the payload
  c = server.openai()
  r1 = c.completions.create(model=MODEL_ID, prompt=p1, max_tokens=8, temperature=0)
  assert r1.usage.prompt_tokens_details.cached_tokens == len(ids1) - 1 and r1.choices[0].text == t1  # prefix from disk, same answer
  r2 = c.completions.create(model=MODEL_ID, prompt=p2, max_tokens=8, temperature=0)
  assert r2.usage.prompt_tokens_details.cached_tokens == 0 and r2.choices[0].text == t2
  assert "ignoring " + f2.name in server.log() and "checksum" in server.log()
  h = server.health()["kv_store"]
  assert h["loaded"] == 1 and h["rejected"] == 1

# *** in-process: a scripted engine behind the real app ***

@pytest.fixture(scope="module")
def tok(model): return Tokenizer.from_gguf(GGUFFile(model))

def _app(tok, script: list[int], start=True, max_queue=8):
  served = scripted_served(tok, script, TEMPLATE, start, max_queue)
  return build_app(served, allowed=Allowed("127.0.0.1", frozenset({"test"}))), served.worker  # httpx's ASGI transport sends Host: test

def _run(app, fn):
  async def main():
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
      return await fn(http, openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0),
                      anthropic.AsyncAnthropic(base_url="http://test", api_key="none", http_client=http, max_retries=0))
  return asyncio.run(main())

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
SAID = 'I will check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

def test_tool_calls_through_both_apis(tok):
  script = tok.encode(SAID, add_special=False) + [1]  # then end of turn
  app, worker = _app(tok, script)
  msgs = [{"role": "user", "content": "Weather in Paris?"}]
  async def go(http, oai, ant):
    r = await oai.chat.completions.create(model=MODEL_ID, messages=msgs, tools=TOOLS)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == "I will check."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert '"name": "get_weather"' in tok.decode(worker.runner.prompts[-1])  # the tools went through the template
    chunks = [k async for k in await oai.chat.completions.create(model=MODEL_ID, messages=msgs, tools=TOOLS, stream=True)]
    text = "".join(k.choices[0].delta.content or "" for k in chunks)
    calls = [t for k in chunks for t in k.choices[0].delta.tool_calls or []]
    assert text == "I will check." and "<tool_call" not in text and [c.function.name for c in calls] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = await oai.chat.completions.create(model=MODEL_ID, messages=msgs)  # no tools offered: the text as it is
    assert plain.choices[0].message.content == SAID and not plain.choices[0].message.tool_calls
    # the call goes back into the next turn through the template (arguments as the JSON string the API carries)
    follow = msgs + [{"role": "assistant", "content": "", "tool_calls": [m.tool_calls[0].model_dump()]},
                     {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "sunny"}]
    await oai.chat.completions.create(model=MODEL_ID, messages=follow, tools=TOOLS)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in tok.decode(worker.runner.prompts[-1])
    a = await ant.messages.create(model=MODEL_ID, max_tokens=200, messages=msgs, tools=[{"name": "get_weather", "input_schema": {"type": "object"}}])
    assert a.stop_reason == "tool_use" and [b.type for b in a.content] == ["text", "tool_use"] and a.content[1].input == {"city": "Paris"}
    async with ant.messages.stream(model=MODEL_ID, max_tokens=200, messages=msgs, tools=[{"name": "get_weather", "input_schema": {}}]) as s:
      final = await s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[1].name == "get_weather" and final.content[1].input == {"city": "Paris"}
    cut = await oai.chat.completions.create(model=MODEL_ID, messages=msgs, tools=TOOLS, max_tokens=len(tok.encode(SAID[:-20], add_special=False)))
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls[0].function.name == "get_weather"  # repaired
  _run(app, go)

def test_stop_strings_are_cut_and_never_leak(tok):
  app, _ = _app(tok, tok.encode("Hello there STOP and more", add_special=False) + [1])
  async def go(http, oai, ant):
    r = await oai.completions.create(model=MODEL_ID, prompt="x", max_tokens=50, stop=["STOP"])
    assert r.choices[0].text == "Hello there " and r.choices[0].finish_reason == "stop"
    stream = await oai.completions.create(model=MODEL_ID, prompt="x", max_tokens=50, stop="STOP", stream=True)
    pieces = [k.choices[0].text async for k in stream if k.choices]
    assert "".join(pieces) == "Hello there " and not any("S" in p for p in pieces)
    a = await ant.messages.create(model=MODEL_ID, max_tokens=50, messages=[{"role": "user", "content": "x"}], stop_sequences=["there"])
    assert a.content[0].text == "Hello " and a.stop_reason == "stop_sequence" and a.stop_sequence == "there"
  _run(app, go)

def test_full_queue_answers_429_with_retry_after(tok):
  app, worker = _app(tok, [5], start=False, max_queue=1)  # no worker thread: whatever is queued stays queued
  worker.submit(Job([1, 2], 1, SamplingParams(), frozenset()))
  async def go(http, oai, ant):
    r = await http.post("/v1/completions", json={"model": MODEL_ID, "prompt": "x"})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "rate_limit_error"
    r = await http.post("/v1/messages", json={"model": MODEL_ID, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    assert (await http.get("/health")).status_code == 503  # not ready: the worker never started
  _run(app, go)

def test_slots_queue_429_and_cancel(model):
  """A worker with 2 slots and a queue of 1: two requests run together, a third waits, a fourth is refused (QueueFull:
  the 429); a cancelled running request leaves within a token, a request cancelled while queued never runs, and the
  slot serves the next request, which answers as the same request alone."""
  from tg_ds4.runtime.runner import Runner
  from tg_ds4.server.worker import Done, QueueFull, Started, Worker
  runner = Runner.load(GGUFFile(model), max_ctx=CTX, parallel=2)
  alone = list(runner.generate([9, 8, 7, 6], 6))
  w = Worker(lambda: (runner, None), max_queue=1).start().wait_loaded()
  async def events_of(job, until=Done):
    out = []
    while not out or not isinstance(out[-1], until): out.append(await asyncio.wait_for(job.events.get(), 120))
    return out
  async def go():
    loop = asyncio.get_running_loop()
    job = lambda p, n: Job(p, n, SamplingParams(), frozenset(), loop=loop)
    a, b, c = job([1, 2, 3], 200), job([4, 5, 6], 200), job([7, 8], 5)
    w.submit(a); await events_of(a, Started)
    w.submit(b); await events_of(b, Started)
    w.submit(c)
    assert w.status()["running"] == 2 and w.status()["queued"] == 1
    with pytest.raises(QueueFull): w.submit(job([9], 1))
    c.cancel(); a.cancel()
    assert (await events_of(a))[-1].reason == "cancelled" and (await events_of(c))[-1].reason == "cancelled"
    assert w.last_cancel["generated"] == 0 and c.generated == 0  # c, cancelled while queued, never ran
    assert a.generated - a.cancel_at <= 1 and a.generated < 200
    d = job([9, 8, 7, 6], 6)
    w.submit(d)
    got = [e.token for e in await events_of(d) if hasattr(e, "token")]
    b.cancel(); await events_of(b)
    return got
  assert asyncio.run(go()) == alone
  assert w.status()["failed"] == 0 and w.status()["peak_running"] == 2

# *** KV store files ***

def test_engine_logprobs_reuse_and_kv_rows(model):
  """The engine pieces the server builds on, on the real (tiny) model: logprobs match a host log_softmax, a common
  prefix is reused, and rows saved from one cache state and loaded into another give the same continuation."""
  from tg_ds4.runtime.runner import Runner
  e = Runner.load(GGUFFile(model), max_ctx=64)
  a, b = list(range(40, 60)), list(range(40, 50)) + list(range(100, 110))
  logits = e.prefill_last(a).numpy()[0, -1].astype(np.float64)  # before the engine runs: it does not know about this prefill
  lp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
  ref = list(e.generate(a, 6))
  assert e.cached == a + ref[:-1] and e.reusable(a) == len(a) - 1 and e.reusable(b) == 10
  steps = list(e.steps(a, 6, start_pos=e.reusable(a), logprobs=3))
  assert [s.token for s in steps] == ref
  assert abs(steps[0].logprob - lp[ref[0]]) < 1e-4 and [t for t, _ in steps[0].top] == np.argsort(-lp)[:3].tolist()
  rows = dict(e.kv_rows(len(a)))
  list(e.generate(b, 6))
  e.load_kv_rows(a, rows)
  assert e.reusable(a) == len(a) - 1 and list(e.generate(a, 6, start_pos=e.reusable(a))) == ref
