"""What a hostile or unlucky client can do to `serve` (#20), each probe reproduced against the real HTTP stack (uvicorn
with the connection limits, the app, its body limits) over a scripted engine (tests/scripted.py) that starts in a second;
the model is not what is tested here. Every client stays on loopback, with bounded counts and times."""
import asyncio, json, os, pathlib, resource, socket, subprocess, sys, threading, time

import pytest
from hypothesis import given, settings, strategies as st

try: import httpx2 as httpx
except ImportError: import httpx

from tg_ds4.io.gguf import GGUFFile
from tg_ds4.server.app import build_app
from tg_ds4.server.body import json_depth
from tg_ds4.server.guard import Allowed
from tg_ds4.text.tokenizer import Tokenizer

from scripted import MODEL_ID, VOCAB, scripted_served

REPO = pathlib.Path(__file__).resolve().parents[1]
HEAD_TIMEOUT, BODY_TIMEOUT, NOFILE = 1.5, 2.0, 256

def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]

class Scripted:
  """tests/scripted.py in a subprocess: serve's HTTP stack, a descriptor limit of NOFILE (soft and hard, as the probe had)."""
  def __init__(self, tmp: pathlib.Path, *args: str):
    self.port, self.logpath = _free_port(), tmp / f"scripted-{time.monotonic_ns()}.log"
    self.url = f"http://127.0.0.1:{self.port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    limit = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))
    with open(self.logpath, "wb") as log:
      self.proc = subprocess.Popen([sys.executable, str(REPO / "tests/scripted.py"), "--port", str(self.port), *args], stdout=log,
                                   stderr=subprocess.STDOUT, env=env, preexec_fn=limit)
    deadline = time.monotonic() + 120
    while True:
      assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
      try:
        if httpx.get(self.url + "/health", timeout=2).status_code == 200: break
      except httpx.HTTPError: time.sleep(0.1)

  def log(self) -> str: return self.logpath.read_text(errors="replace")
  def health(self) -> dict: return httpx.get(self.url + "/health", timeout=10).json()
  def stop(self):
    self.proc.terminate()
    try: self.proc.wait(10)
    except subprocess.TimeoutExpired: self.proc.kill(); self.proc.wait()

  def complete(self, **kw) -> httpx.Response:
    return httpx.post(self.url + "/v1/completions", json={"model": MODEL_ID, "prompt": "hi", "max_tokens": 4}, timeout=10, **kw)

  def connect(self) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
    return s

@pytest.fixture(scope="module")
def server(tmp_path_factory):
  s = Scripted(tmp_path_factory.mktemp("limits"), "--head-timeout", str(HEAD_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
               "--allow-host", "models.example", "--allow-origin", "http://app.example", "--max-parsing", "1")
  yield s
  s.stop()

def _closed_by_server(s: socket.socket, within: float) -> bool:
  """The server closes `s` within `within` seconds (what it sent before, e.g. a 408, is read past)."""
  s.settimeout(within)
  try:
    while s.recv(65536): pass
    return True
  except (ConnectionResetError, BrokenPipeError): return True
  except TimeoutError: return False

def _response(s: socket.socket, within: float) -> bytes:
  s.settimeout(within)
  out = b""
  try:
    while chunk := s.recv(65536): out += chunk
  except (TimeoutError, ConnectionResetError): pass
  return out

# *** probe 2: a body that a regex depth scan takes quadratic time over ***

def test_depth_scan_is_linear_and_exact():
  evil = b'{"content":"' + b'\\"' * 24_000 + b"}"  # the probe's 48 KB body
  assert json_depth(evil) == 1
  big = b'{"content":"' + b'\\"' * (3 << 20) + b"}"
  t = time.perf_counter(); json_depth(big)
  assert time.perf_counter() - t < 5  # 6 MB: linear, where a regex scan is quadratic

@settings(max_examples=300, deadline=None, database=None)
@given(st.text(alphabet='[]{}"\\ax', max_size=80), st.integers(1, 9))
def test_depth_scan_matches_a_byte_loop_at_every_chunk_boundary(text, chunk):
  """Exact up to the first backslash outside a string, which no JSON has: the parser stops there, so the nesting
  before it is all that can reach the parser."""
  depth, best, inside, escaped = 0, 0, False, False
  for i, c in enumerate(text):  # the reference: one byte at a time
    if inside:
      if escaped: escaped = False
      elif c == "\\": escaped = True
      elif c == '"': inside = False
    elif c == "\\": text = text[:i]; break
    elif c == '"': inside = True
    elif c in "[{": depth += 1; best = max(best, depth)
    elif c in "]}": depth -= 1
  assert json_depth(text.encode(), chunk) == json_depth(text.encode()) == best

def test_hostile_bodies_do_not_stall_the_server(server):
  bodies = [b'{"model":"' + MODEL_ID.encode() + b'","prompt":"' + b'\\"' * n + b"}" for n in (24_000, 3 << 20)]
  results = {}
  def post(i): results[i] = httpx.post(server.url + "/v1/completions", content=bodies[i], headers={"content-type": "application/json"}, timeout=60)
  threads = [threading.Thread(target=post, args=(i,)) for i in range(2)]
  for t in threads: t.start()
  worst = 0.0
  while any(t.is_alive() for t in threads):
    t0 = time.perf_counter(); assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    worst = max(worst, time.perf_counter() - t0)
  for t in threads: t.join()
  assert [results[i].status_code for i in range(2)] == [400, 400] and "malformed JSON" in results[0].json()["error"]["message"]
  assert worst < 1.0, worst  # the depth scan never holds up the event loop

# *** probe 4: silent and slow connections ***

def test_silent_connections_neither_starve_clients_nor_exhaust_descriptors(server):
  silent = [server.connect() for _ in range(NOFILE + 44)]  # more than the descriptor limit allows open at once
  try:
    t0 = time.perf_counter()
    r = server.complete()
    assert r.status_code == 200 and r.json()["choices"][0]["text"] and time.perf_counter() - t0 < 5
    assert all(_closed_by_server(s, HEAD_TIMEOUT + 3) for s in silent)  # those that sent nothing are dropped
  finally:
    for s in silent: s.close()
  log = server.log()
  assert len(log) < 100_000 and "Too many open files" not in log and "Traceback" not in log, log[-3000:]

def test_at_the_connection_cap_the_longest_idle_connection_makes_room(tmp_path):
  capped = Scripted(tmp_path, "--max-connections", "20", "--head-timeout", "60")
  try:
    silent = [capped.connect() for _ in range(40)]
    time.sleep(0.5)
    t0 = time.perf_counter()
    assert capped.complete().status_code == 200 and time.perf_counter() - t0 < 5  # long before any head timeout
    closed = [_closed_by_server(s, 0.2) for s in silent]
    assert closed[:20] == [True] * 20 and sum(closed) >= 20, closed  # the oldest went first
    assert "connection cap 20 reached" in capped.log()
  finally:
    for s in silent: s.close()
    capped.stop()

def test_a_trickled_head_gets_no_extension(server):
  s = server.connect()
  head, t0, closed = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200, time.perf_counter(), False
  try:
    for b in head:  # one byte every 50 ms: uvicorn's keep-alive timer restarts at each one
      s.sendall(bytes([b])); time.sleep(0.05)
  except (BrokenPipeError, ConnectionResetError): closed = True
  assert closed or _closed_by_server(s, 1)
  assert time.perf_counter() - t0 < HEAD_TIMEOUT + 2
  s.close()

@pytest.mark.parametrize("framing", ["content-length larger than the body", "chunked body that never ends"])
def test_a_body_that_never_arrives_gets_408(server, framing):
  s = server.connect()
  head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
  head += "Content-Length: 1000\r\n\r\n" if framing.startswith("content") else "Transfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n"
  t0 = time.perf_counter()
  s.sendall(head.encode() + (b'{"model"' if framing.startswith("content") else b""))
  out = _response(s, BODY_TIMEOUT + 3)
  s.close()
  assert out.startswith(b"HTTP/1.1 408"), out[:200]
  assert BODY_TIMEOUT - 0.5 < time.perf_counter() - t0 < BODY_TIMEOUT + 3

# *** probe 5: cross-site requests ***

def test_cross_site_requests_do_not_run_the_model(server):
  done = server.health()["completed"]
  body = json.dumps({"model": MODEL_ID, "prompt": "hi", "max_tokens": 2})
  r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "text/plain", "origin": "http://evil.example"})
  assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"  # the foreign origin alone refuses it
  r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "text/plain"})  # a form or no-preflight fetch
  assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
  r = httpx.post(server.url + "/v1/messages", content=body, headers={"content-type": "application/x-www-form-urlencoded"})
  assert r.status_code == 415 and r.json()["type"] == "error"  # in the Anthropic shape on its path
  r = server.complete(headers={"host": "attacker.example"})  # DNS rebinding: the page's own name reaches our address
  assert r.status_code == 403 and "--allow-host" in r.json()["error"]["message"]
  assert server.complete(headers={"origin": "http://evil.example"}).status_code == 403
  assert server.complete(headers={"origin": "null"}).status_code == 403
  assert server.health()["completed"] == done  # none of these ran
  for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", "models.example"):
    assert server.complete(headers={"host": host}).status_code == 200, host
  r = server.complete(headers={"origin": "http://app.example"})  # --allow-origin: served, with CORS
  assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
  pre = httpx.options(server.url + "/v1/completions", headers={"origin": "http://app.example", "access-control-request-method": "POST",
                                                             "access-control-request-headers": "content-type"})
  assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://app.example"
  assert server.complete(headers={"origin": server.url}).status_code == 200  # the server's own origin

def test_transfer_encoding_with_content_length_is_refused(server):
  s = server.connect()
  body = json.dumps({"model": MODEL_ID, "prompt": "hi", "max_tokens": 2}).encode()
  s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Transfer-Encoding: chunked\r\n\r\n{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
  out = _response(s, 5)
  s.close()
  assert out.startswith(b"HTTP/1.1 400") and b"Transfer-Encoding" in out, out[:300]

# *** probe 6: memory of concurrent bodies, 500 messages, a cut character ***

def _hwm(pid: int) -> int:
  return next(int(line.split()[1]) for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmHWM")) << 10

def test_concurrent_large_bodies_are_parsed_a_bounded_number_at_a_time(server):
  msgs = [{"role": "user", "content": "x"} for _ in range(150_000)]  # 5 MB: ~125 MB once parsed and validated
  body = json.dumps({"model": MODEL_ID, "messages": msgs, "max_tokens": 1}).encode()
  post = lambda: httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=120)
  base = _hwm(server.proc.pid)
  assert post().status_code == 400  # the rendered prompt is over the context: parsed and validated in full first
  one = _hwm(server.proc.pid) - base
  threads = [threading.Thread(target=post) for _ in range(8)]
  for t in threads: t.start()
  for t in threads: t.join()
  eight = _hwm(server.proc.pid) - base
  print(f"\npeak RSS growth: one 5 MB body {one >> 20} MB, eight at once {eight >> 20} MB (--max-parsing 1)")
  assert one > 40 << 20 and eight < one + (100 << 20), (one >> 20, eight >> 20)  # eight unbounded: ~8x one (1.3 GB in the probe)

@pytest.fixture(scope="module")
def tok(): return Tokenizer.from_gguf(GGUFFile(VOCAB))

def _asgi(app, fn):
  async def main():
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://test") as http:
      return await fn(http)
  return asyncio.run(main())

def test_a_failed_generation_says_so_without_internals(tok):
  script = tok.encode("Hello there", add_special=False)
  app = build_app(scripted_served(tok, script, fail=script[0]), allowed=Allowed("127.0.0.1", frozenset({"test"})))
  async def go(http):
    body = {"model": MODEL_ID, "prompt": "hi", "max_tokens": 4}
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 500 and "generation failed" in r.json()["error"]["message"]
    streamed = (await http.post("/v1/completions", json={**body, "stream": True})).text
    a = await http.post("/v1/messages", json={"model": MODEL_ID, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert a.status_code == 500 and a.json()["error"]["type"] == "api_error"
    for text in (r.text, streamed, a.text):
      assert "RuntimeError" not in text and "secret" not in text and "model.gguf" not in text, text
    assert '"error"' in streamed
  _asgi(app, go)

def test_an_answer_cut_inside_a_character_ends_at_a_whole_character(tok):
  text = "caf\u00e9 \u20ac\u20ac \u4e16\u754c"
  ids = tok.encode(text, add_special=False)
  cuts = [n for n in range(1, len(ids)) if "\ufffd" in tok.decode(ids[:n])]  # token counts that end inside a character
  assert cuts, "this vocabulary splits these characters into byte tokens"
  app = build_app(scripted_served(tok, ids), allowed=Allowed("127.0.0.1", frozenset({"test"})))
  async def go(http):
    for n in cuts:
      whole = tok.decode(ids[:n]).rstrip("\ufffd")
      r = await http.post("/v1/completions", json={"model": MODEL_ID, "prompt": "hi", "max_tokens": n})
      assert r.json()["choices"][0]["text"] == whole and r.json()["choices"][0]["finish_reason"] == "length"
      s = (await http.post("/v1/completions", json={"model": MODEL_ID, "prompt": "hi", "max_tokens": n, "stream": True})).text
      pieces = [json.loads(line[6:])["choices"][0]["text"] for line in s.splitlines() if line.startswith("data: {")]
      assert "".join(pieces) == whole
  _asgi(app, go)

# *** cancellation while queued ***

def test_a_request_cancelled_while_queued_never_runs(tmp_path):
  """Request A holds the worker (the scripted engine waits after A's first token); B queues behind it and its client
  gives up; then A's client leaves too. B must never reach the engine: no steps, no tokens, a cancel at 0 generated."""
  hold = tmp_path / "go"
  s = Scripted(tmp_path, "--hold", str(hold))
  try:
    body = {"model": MODEL_ID, "prompt": "first", "max_tokens": 8, "stream": True}
    with httpx.Client(timeout=10) as http, http.stream("POST", s.url + "/v1/completions", json=body) as r:
      next(line for line in r.iter_lines() if line.startswith("data: {"))  # A runs, held after its first token
      with pytest.raises(httpx.TimeoutException):
        httpx.post(s.url + "/v1/completions", json={**body, "prompt": "second request", "stream": False}, timeout=0.5)
      h = s.health()
      assert h["busy"] and h["queued"] == 1, h
    time.sleep(0.5)  # both disconnects reach the server (the worker cannot move: A is held)
    hold.touch()
    deadline = time.monotonic() + 10
    while (h := s.health())["busy"] or h["queued"] or h["cancelled"] < 2:
      assert time.monotonic() < deadline, h
      time.sleep(0.02)
    assert h["cancelled"] == 2 and h["completed"] == 0 and h["tokens"] <= 2, h  # A: its first token, at most one more
    assert h["last_cancel"]["generated"] == 0 and h["last_cancel"]["tokens_after_cancel"] == 0, h
    assert s.log().count("scripted: generating") == 1, s.log()  # only A ever reached the engine
    assert s.complete().json()["choices"][0]["text"]  # and the worker serves the next request
  finally: s.stop()
