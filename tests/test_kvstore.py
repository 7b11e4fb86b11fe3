"""The persistent KV cache directory against damage and hostility: a flipped header byte, headers of the wrong types
under a valid checksum, a FIFO, symlinks out of the directory, other models' and foreign files at eviction, failed and
interrupted writes, and saved prefixes the engine cannot take (through the worker's reuse path, on a fake engine)."""
import hashlib, json, logging, os, shutil, struct, subprocess, sys, threading, time, types

import numpy as np
import pytest

from tg_ds4.server.kvstore import Entry, KVStore, MAGIC, tokens_key
from tg_ds4.server.worker import Worker

def _rows(n, seed=0):
  return [("blk.0.attn.cache", np.random.default_rng(seed).standard_normal((1, n, 2, 8)).astype(np.float32))]

def _toks(i, n=40): return list(range(i, i + n))

def _path(d, tokens): return d / (tokens_key(tokens) + ".kv")

def _fill(d, count, fp="model-A", cap=1 << 20):
  s = KVStore(d, fp, cap, 4)
  for i in range(count): s.save(_toks(i), _rows(40, i))
  s.flush()
  return s

def _split(path):
  data = path.read_bytes()
  (hlen,) = struct.unpack("<I", data[len(MAGIC):len(MAGIC) + 4])
  return json.loads(data[len(MAGIC) + 4:len(MAGIC) + 4 + hlen]), data[len(MAGIC) + 4 + hlen:-32]

def _rewrite(path, header):
  """`path` with `header` instead of its own and a valid checksum: only the typed header checks can refuse it."""
  hb = json.dumps(header).encode()
  body = MAGIC + struct.pack("<I", len(hb)) + hb + _split(path)[1]
  path.write_bytes(body + hashlib.sha256(body).digest())

def _loads_ok(s, i):
  e, n = s.lookup(_toks(i) + [999])
  assert n == 40 and np.array_equal(s.load(e)["blk.0.attn.cache"], _rows(40, i)[0][1])

@pytest.fixture
def warnings_log(caplog):
  caplog.set_level(logging.WARNING, "tg_ds4.server")
  return caplog

def test_flipped_header_key_is_rejected_at_scan(tmp_path, warnings_log):
  _fill(tmp_path, 2)
  bad = _path(tmp_path, _toks(0))
  data = bad.read_bytes()
  assert data.count(b'"tokens"') == 1
  bad.write_bytes(data.replace(b'"tokens"', b'"tokeos"'))  # one flipped bit, nothing recomputed
  s = KVStore(tmp_path, "model-A", 1 << 20, 4)
  assert list(s.index) == [tokens_key(_toks(1))] and s.rejected == 1
  assert f"ignoring {bad.name}: header field 'tokens'" in warnings_log.text
  _loads_ok(s, 1)

def _set(h, path, value):
  *parents, last = path
  for k in parents: h = h[k]
  h[last] = value

@pytest.mark.parametrize("path,value,field", [
  (("tokens",), ["a"], "tokens"), (("tokens",), [[1, 2]], "tokens"), (("tokens",), [2**40], "tokens"), (("tokens",), 5, "tokens"),
  (("tokens",), [True, 2], "tokens"), (("payload_bytes",), "12", "payload_bytes"), (("tensors",), "x", "tensors"),
  (("tensors", 0, "shape"), [-1], "tensors[0].shape"), (("tensors", 0, "shape"), [1, 39, 2, 8], "payload_bytes"),
  (("tensors", 0, "dtype"), "object", "tensors[0].dtype"), (("tensors", 0, "dtype"), "|O", "tensors[0].dtype")])
def test_wrongly_typed_header_under_a_valid_checksum_is_rejected_at_scan(tmp_path, warnings_log, path, value, field):
  _fill(tmp_path, 2)
  bad = _path(tmp_path, _toks(0))
  header = _split(bad)[0]
  _set(header, path, value)
  _rewrite(bad, header)
  s = KVStore(tmp_path, "model-A", 1 << 20, 4)
  assert list(s.index) == [tokens_key(_toks(1))] and s.rejected == 1
  assert f"ignoring {bad.name}: header field '{field}'" in warnings_log.text
  _loads_ok(s, 1)
  assert bad.exists()  # refused, not deleted: never proven ours

def test_fifo_named_like_an_entry_does_not_block_startup(tmp_path, warnings_log):
  _fill(tmp_path, 1)
  fifo = tmp_path / "0000.kv"
  os.mkfifo(fifo)
  box = []
  t = threading.Thread(target=lambda: box.append(KVStore(tmp_path, "model-A", 1 << 20, 4)), daemon=True)
  t.start(); t.join(10)
  try:
    assert not t.is_alive(), "KVStore() blocked on a FIFO"
    assert "ignoring 0000.kv: not a regular file (a FIFO)" in warnings_log.text
    _loads_ok(box[0], 0)
  finally:  # a blocked open() returns once a writer shows up: do not leave the thread hanging
    if t.is_alive(): os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

def test_symlink_out_of_the_directory_is_not_followed_touched_or_deleted(tmp_path, warnings_log):
  d, out = tmp_path / "kv", tmp_path / "outside"
  _fill(out, 1)
  target = _path(out, _toks(0))
  os.utime(target, (1e9, 1e9))
  content = target.read_bytes()
  link = _path(d, _toks(0))
  d.mkdir(); link.symlink_to(target)
  s = KVStore(d, "model-A", 1 << 20, 4)
  assert s.index == {} and s.lookup(_toks(0))[0] is None
  assert f"ignoring {link.name}: not a regular file (a symbolic link)" in warnings_log.text
  assert s.load(Entry(link, np.asarray(_toks(0), np.int32), len(content))) is None  # a name turned into a link after the scan
  size = len(content)
  s = KVStore(d, "model-A", int(size * 1.5), 4)  # room for one: every save evicts
  for i in (1, 2, 3): s.save(_toks(i), _rows(40, i)); s.flush()
  assert link.is_symlink() and target.read_bytes() == content and target.stat().st_mtime == 1e9

def test_eviction_deletes_only_this_stores_own_oldest_entries(tmp_path, warnings_log):
  d, side, out = tmp_path / "kv", tmp_path / "side", tmp_path / "out"
  _fill(side, 1, fp="model-B")
  foreign = d / _path(side, _toks(50)).name
  d.mkdir(); out.mkdir()
  shutil.copy(_path(side, _toks(0)), foreign)  # another model's file (under another name: names hash the tokens alone)
  junk = d / "x.kv"; junk.write_bytes(b"not ours " * 1000)
  big = out / "big.bin"
  with open(big, "wb") as f: f.truncate(64 << 20)
  link = d / "big.kv"; link.symlink_to(big)
  for p in (foreign, junk): os.utime(p, (1e9, 1e9))  # older than anything of ours: first in line were they candidates
  s = KVStore(d, "model-A", 1 << 20, 4)
  s.save(_toks(0), _rows(40, 0)); s.flush()
  size = _path(d, _toks(0)).stat().st_size
  s.cap = int(size * 2.5)  # room for two of ours
  os.utime(_path(d, _toks(0)), (2e9, 2e9))
  for i in (1, 2, 3):
    s.save(_toks(i), _rows(40, i)); s.flush()
    os.utime(_path(d, _toks(i)), (2e9 + i, 2e9 + i))
  assert sorted(p.name for p in d.iterdir()) == sorted([foreign.name, junk.name, link.name, *(_path(d, _toks(i)).name for i in (2, 3))])
  assert sorted(s.index) == sorted(tokens_key(_toks(i)) for i in (2, 3))
  assert foreign.exists() and junk.read_bytes() == b"not ours " * 1000 and link.is_symlink() and big.stat().st_size == 64 << 20
  assert s.stats()["bytes"] <= s.cap

def test_another_models_file_for_the_same_prompt_is_not_replaced(tmp_path, warnings_log):
  _fill(tmp_path, 1, fp="model-B")
  f = _path(tmp_path, _toks(0))
  theirs = f.read_bytes()
  s = KVStore(tmp_path, "model-A", 1 << 20, 4)
  assert not s.wants(_toks(0))  # the worker does not even copy the rows off the device
  s.save(_toks(0), _rows(40, 7)); s.flush()
  assert f.read_bytes() == theirs and s.index == {} and f"could not save {tokens_key(_toks(0))}: FileExistsError" in warnings_log.text

def test_failed_writes_leave_no_temp_file_and_the_writer_lives_on(tmp_path, warnings_log, monkeypatch):
  s = KVStore(tmp_path, "model-A", 1 << 20, 4)
  real, calls = os.fsync, []
  def failing_fsync(fd):
    calls.append(fd)
    if len(calls) == 1: raise OSError(5, "Input/output error (injected)")
    return real(fd)
  monkeypatch.setattr(os, "fsync", failing_fsync)
  s.save(_toks(0), _rows(40, 0)); s.flush()
  monkeypatch.setattr(os, "fsync", real)
  def failing_replace(a, b): raise RuntimeError("not an OSError (injected)")
  monkeypatch.setattr(os, "replace", failing_replace)
  s.save(_toks(1), _rows(40, 1)); s.flush()
  monkeypatch.undo()
  s.save(_toks(2), [("blk.0.attn.cache", np.array([object()] * 4))]); s.flush()  # numpy would export the pointers as bytes
  assert [p.name for p in tmp_path.iterdir()] == [] and s.index == {}
  assert calls and all(f"could not save {tokens_key(_toks(i))}: {err}" in warnings_log.text
                       for i, err in ((0, "OSError"), (1, "RuntimeError"), (2, "CorruptFile: header field 'tensors[0].dtype'")))
  s.save(_toks(3), _rows(40, 3)); s.flush()  # the writer thread is still there
  assert [p.name for p in tmp_path.iterdir()] == [_path(tmp_path, _toks(3)).name]
  _loads_ok(s, 3)

def test_stale_temp_files_are_swept_live_ones_and_planted_links_kept(tmp_path, warnings_log):
  dead = subprocess.Popen([sys.executable, "-c", "pass"]); dead.wait()
  live = subprocess.Popen(["sleep", "30"])
  try:
    k = [tokens_key(_toks(i)) for i in range(4)]
    stale, own, alive = tmp_path / f".{k[0]}.{dead.pid}.tmp", tmp_path / f".{k[1]}.{os.getpid()}.tmp", tmp_path / f".{k[2]}.{live.pid}.tmp"
    for p in (stale, own, alive): p.write_bytes(b"half a file")
    victim = tmp_path / "victim"; victim.write_bytes(b"precious")
    planted = tmp_path / f".{k[3]}.{os.getpid()}.tmp"; planted.symlink_to(victim)  # would redirect the write of _toks(3)
    s = KVStore(tmp_path, "model-A", 1 << 20, 4)
    assert not stale.exists() and not own.exists() and alive.read_bytes() == b"half a file"
    s.save(_toks(3), _rows(40, 3)); s.flush()
    assert victim.read_bytes() == b"precious" and planted.is_symlink() and not _path(tmp_path, _toks(3)).exists()
    assert "could not save " + k[3] in warnings_log.text
  finally: live.kill(); live.wait()

class FakeRunner:
  """What Worker._reuse needs of a Runner; `fits=False` refuses rows the way Runner.load_kv_rows does (after emptying
  the cache)."""
  model = types.SimpleNamespace(max_rewind=None)  # a row cache: any saved prefix resumes
  def __init__(self, cached=(), fits=True): self.cached, self.fits = list(cached), fits
  def reusable(self, prompt, cached=None):
    n = 0
    for a, b in zip(prompt, self.cached if cached is None else cached):
      if a != b: break
      n += 1
    return min(n, max(len(prompt) - 1, 0))
  def load_kv_rows(self, tokens, rows):
    self.cached = []
    if not self.fits: raise ValueError("blk.0.attn.cache: saved rows (1, 40, 2, 8) do not fit (1, 64, 4, 8) up to row 40")
    self.cached = list(tokens)

def _worker(engine, store):
  w = Worker(lambda: (engine, store))  # not started: _reuse is called directly
  w.runner, w.kvstore = engine, store
  return w

def test_saved_prefix_with_malformed_tokens_never_fails_a_request(tmp_path, warnings_log):
  _fill(tmp_path, 2)
  bad = _path(tmp_path, _toks(0))
  header = _split(bad)[0]; header["tokens"] = 5; _rewrite(bad, header)  # valid checksum, tokens not a list
  s = KVStore(tmp_path, "model-A", 1 << 20, 4)
  w = _worker(FakeRunner(), s)
  assert w._reuse(_toks(0) + [999]) == 0 and tokens_key(_toks(0)) not in s.index
  assert f"ignoring {bad.name}" in warnings_log.text
  odd = Entry(tmp_path / "odd.kv", np.asarray(5, np.int32), 1)  # an index entry whose comparison raises
  s.index["odd"] = odd
  assert w._reuse(_toks(1) + [999]) == 40 and "odd" not in s.index and "ignoring odd.kv: unusable token ids" in warnings_log.text

def test_saved_rows_that_do_not_fit_the_engine_are_dropped(tmp_path, warnings_log):
  _fill(tmp_path, 1)
  f = _path(tmp_path, _toks(0))
  s = KVStore(tmp_path, "model-A", 1 << 20, 4)
  eng = FakeRunner(cached=_toks(0)[:5], fits=False)
  assert _worker(eng, s)._reuse(_toks(0) + [999]) == 0 and eng.cached == []  # what was in memory is gone too: load_kv_rows emptied it
  assert s.index == {} and f"ignoring {f.name}: ValueError: blk.0.attn.cache: saved rows" in warnings_log.text
  assert not f.exists() and s.wants(_toks(0))  # ours and useless: deleted, so the next answer saves it anew
  eng = FakeRunner(cached=_toks(0)[:5])
  assert _worker(eng, s)._reuse(_toks(0) + [999]) == 5  # nothing on disk any more: the memory prefix

def test_lookup_of_whole_states_takes_only_entries_the_prompt_extends(tmp_path):
  """A state that resumes only where it ends (DeepSeek V4's rings) is of use only when the prompt begins with all of its
  tokens: a longer entry that shares more of the prompt but goes on differently is passed over for it."""
  s = KVStore(tmp_path, "model-A", 1 << 20, 4)
  s.save(list(range(20)), _rows(20)); s.save(list(range(30)) + [7, 7], _rows(32)); s.flush()
  prompt = list(range(40))
  assert [len(e.tokens) if e else None for e in [s.lookup(prompt)[0]]] == [32] and s.lookup(prompt)[1] == 30
  e, n = s.lookup(prompt, whole=True)
  assert len(e.tokens) == 20 and n == 20 and s.lookup(list(range(10)), whole=True) == (None, 0)

def test_kvstore_roundtrip_lookup_and_lru(tmp_path):
  s = KVStore(tmp_path, "model-A", 1 << 20, 4)
  s.save(list(range(30)), _rows(30)); s.flush()
  e, n = s.lookup(list(range(20)) + [99])
  assert n == 20 and np.array_equal(s.load(e)["blk.0.attn.cache"], _rows(30)[0][1])
  assert not s.wants(list(range(30))) and not s.wants([1, 2]) and s.wants(list(range(31)))
  assert [p.name for p in tmp_path.iterdir()] == [tokens_key(list(range(30))) + ".kv"]  # no temp file left behind
  size = next(tmp_path.iterdir()).stat().st_size
  s = KVStore(tmp_path, "model-A", int(size * 2.5), 4)  # room for two
  s.save(list(range(100, 130)), _rows(30, 1)); s.flush()
  time.sleep(0.02); s.load(s.lookup(list(range(30)))[0])  # the first file becomes the most recently used
  time.sleep(0.02); s.save(list(range(200, 230)), _rows(30, 2)); s.flush()
  assert sorted(p.stem for p in tmp_path.iterdir()) == sorted(tokens_key(t) for t in (list(range(30)), list(range(200, 230))))

def test_kvstore_ignores_truncated_foreign_and_corrupt_files(tmp_path, caplog):
  s = KVStore(tmp_path, "model-A", 1 << 20, 4)
  for i in range(3): s.save(list(range(i, 40 + i)), _rows(40, i))
  s.flush()
  files = sorted(tmp_path.iterdir())
  assert len(files) == 3
  assert KVStore(tmp_path, "model-B", 1 << 20, 4).lookup(list(range(40)))[0] is None  # another model's files are not used (nor deleted)
  files[0].write_bytes(files[0].read_bytes()[:-100])  # truncated
  data = bytearray(files[1].read_bytes()); data[-200] ^= 1; files[1].write_bytes(bytes(data))  # corrupted payload
  caplog.set_level("WARNING", "tg_ds4.server")
  s = KVStore(tmp_path, "model-A", 1 << 20, 4)
  assert len(s.index) == 2 and "truncated" in caplog.text  # seen at start-up from the size alone
  loaded = {p.name: s.load(e) is not None for p, e in ((e.path, e) for e in list(s.index.values()))}
  assert loaded == {files[1].name: False, files[2].name: True} and "checksum mismatch" in caplog.text and not files[1].exists()
