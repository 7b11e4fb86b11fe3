"""Persistent prefix KV cache: the cache rows of a prompt saved as one file, so a restarted server skips re-prefilling a
prefix it has seen.

File = MAGIC | u32 header length | header (JSON: format, model fingerprint, token ids, tensor names/dtypes/shapes, payload
size) | payload (each tensor's rows, C order) | sha256 of everything before it. Named by a hash of the token ids, written
to a temp file `.KEY.PID.tmp` (created exclusively, never through a link), fsynced, renamed into place (a crash leaves the
old state or the new, never half a file). A file whose size, checksum, format, model fingerprint or header types do not
match is never loaded.

The directory may be shared, damaged or hostile. Read: only regular files named `*.kv`, opened without following links
and without blocking (a symlink, FIFO, device or directory is skipped with a warning); one bad file costs itself, never
the start-up nor a request. Deleted, and nothing else ever: this store's own entries (a regular file whose header names
this model, indexed at start-up or written here) when least recently used (mtime, touched on every load) while they hold
more than the size cap, or when found damaged at load; and temp files of writers that died. Another model's files,
unreadable files and links are left alone, and not counted against the cap."""
from __future__ import annotations

import contextlib, hashlib, io, json, logging, math, os, pathlib, queue, re, stat, struct, threading, time
from dataclasses import dataclass

import numpy as np

FORMAT = 1
MAGIC = b"TGDS4KV\0"
SUFFIX = ".kv"
DTYPE = re.compile(r"[<>|=]?[biufc][0-9]{1,2}")
TEMP = re.compile(r"\.([0-9a-f]{40})\.([0-9]{1,10})\.tmp")  # `_write`'s temp files: .KEY.PID.tmp
log = logging.getLogger("tg_ds4.server")

def model_fingerprint(gguf_path: str | os.PathLike, layout: list[tuple[str, tuple[int, ...], str, int]], identity: str | None = None,
                      numerics: str = "exact") -> str:
  """Identity of the weights and of the cache layout: the file's size, its first 4 MiB (header and metadata) and 16
  samples of 64 KiB spread over the tensor data, plus each cache tensor's name, dtype and row shape (not its row count:
  a different --max-context keeps the files valid). A checkpoint folder's weights are named by `identity` instead
  (io/hf_folder.py's Checkpoint.identity). A cache computed under other numerics (quant/activations.py, as they work out on the
  device: serve --numerics) holds other values: caches of different numerics never restore each other's."""
  h, path = hashlib.sha256(f"tg_ds4-kv-{FORMAT}".encode()), pathlib.Path(gguf_path)
  if numerics != "exact": h.update(b"llama-cpp-rounding" if numerics == "llama.cpp" else f"numerics-{numerics}".encode())
  if identity is not None: h.update(identity.encode())
  else:
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
      h.update(f.read(4 << 20))
      for i in range(16):
        f.seek(size * i // 16); h.update(f.read(64 << 10))
  h.update(json.dumps([(n, [d for i, d in enumerate(shape) if i != axis], dt, axis) for n, shape, dt, axis in layout]).encode())
  return h.hexdigest()

def tokens_key(tokens: list[int]) -> str: return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()[:40]

@dataclass
class Entry:
  path: pathlib.Path
  tokens: np.ndarray  # int32 ids whose rows the file holds
  size: int

class CorruptFile(ValueError): pass
class NotOurs(ValueError): pass  # a link, FIFO, ..., or another model's file: never used, never deleted

_KINDS = {stat.S_IFLNK: "a symbolic link", stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a device", stat.S_IFBLK: "a device"}

def _not_regular(mode: int) -> NotOurs: return NotOurs(f"not a regular file ({_KINDS.get(stat.S_IFMT(mode), 'unknown')})")

def _open_regular(path: pathlib.Path) -> tuple[io.BufferedReader, os.stat_result]:
  """`path` opened for reading if it is a regular file. lstat first, so a device is never even opened; O_NOFOLLOW and
  fstat since the name may change in between (a FIFO swapped in is opened without blocking, then refused)."""
  if not stat.S_ISREG(mode := os.lstat(path).st_mode): raise _not_regular(mode)
  fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode): raise _not_regular(st.st_mode)
    return open(fd, "rb"), st
  except BaseException: os.close(fd); raise

def _read_header(f, size: int) -> tuple[dict, int]:
  """The header (not yet type-checked) and the payload's offset."""
  head = f.read(len(MAGIC) + 4)
  if len(head) < len(MAGIC) + 4 or head[:len(MAGIC)] != MAGIC: raise CorruptFile("not a tg_ds4 KV file (bad magic)")
  (hlen,) = struct.unpack("<I", head[len(MAGIC):])
  if hlen > size: raise CorruptFile("truncated header")
  try: header = json.loads(f.read(hlen))
  except (ValueError, RecursionError): raise CorruptFile("unreadable header") from None
  if not isinstance(header, dict): raise CorruptFile("unreadable header")
  return header, len(MAGIC) + 4 + hlen

def _int(x) -> bool: return type(x) is int  # not bool, which is an int too

def _numeric_dtype(s) -> np.dtype | None:
  """The dtype a `_write` header names ('<f4', '|b1', ...): numbers only, spelled as numpy spells them (so np.dtype
  neither fails nor warns on it)."""
  if not isinstance(s, str) or not DTYPE.fullmatch(s): return None
  try: return np.dtype(s)
  except TypeError: return None  # a size numpy lacks ('f3')

def _check_header(header: dict) -> dict:
  """`header` if every field has the type and range the file layout needs, else CorruptFile naming the first bad field
  (a header may pass the checksum and still be wrong: another writer's bug, or a forged file)."""
  def need(ok: bool, field: str, what: str):
    if not ok: raise CorruptFile(f"header field {field!r} is not {what}")
  need(_int(header.get("format")), "format", "an int")
  need(isinstance(header.get("fingerprint"), str), "fingerprint", "a string")
  need(isinstance(toks := header.get("tokens"), list) and all(_int(t) and 0 <= t < 2**31 for t in toks), "tokens", "a list of ints in [0, 2**31)")
  need(_int(pb := header.get("payload_bytes")) and pb >= 0, "payload_bytes", "an int >= 0")
  need(isinstance(ts := header.get("tensors"), list) and all(isinstance(t, dict) for t in ts), "tensors", "a list of objects")
  total = 0
  for i, t in enumerate(ts):
    need(isinstance(t.get("name"), str), f"tensors[{i}].name", "a string")
    need((dt := _numeric_dtype(t.get("dtype"))) is not None, f"tensors[{i}].dtype", "a numeric numpy dtype")
    # numpy's bound on an array's size, zero-length axes aside
    need(isinstance(shape := t.get("shape"), list) and len(shape) <= 32 and all(_int(d) and d >= 0 for d in shape)
         and math.prod(max(d, 1) for d in shape) * dt.itemsize < 2**62, f"tensors[{i}].shape", "a list of at most 32 ints >= 0 numpy can hold")
    total += math.prod(shape) * dt.itemsize
  need(len({t["name"] for t in ts}) == len(ts), "tensors", "a list of distinct names")
  need(total == pb, "payload_bytes", f"the tensors' total size ({total})")
  return header

def _check_file(header: dict, off: int, size: int, stem: str) -> np.ndarray:
  """The token ids of a file of ours (format and fingerprint already match) whose header is `header`, else CorruptFile."""
  _check_header(header)
  if size != (expect := off + header["payload_bytes"] + 32): raise CorruptFile(f"size {size} != {expect} bytes (truncated or appended to)")
  if tokens_key(header["tokens"]) != stem: raise CorruptFile("token ids do not match the name")
  return np.asarray(header["tokens"], np.int32)

class KVStore:
  def __init__(self, directory: str | os.PathLike, fingerprint: str, cap_bytes: int, min_tokens: int):
    self.dir, self.fingerprint, self.cap, self.min_tokens = pathlib.Path(directory), fingerprint, cap_bytes, min_tokens
    self.dir.mkdir(parents=True, exist_ok=True)
    self.index: dict[str, Entry] = {}
    self.lock = threading.Lock()
    self.pending: set[str] = set()
    self.writes: queue.Queue = queue.Queue()
    self.saved = self.loaded = self.rejected = 0
    self._sweep_temps()
    self._scan()
    threading.Thread(target=self._writer, name="kv-writer", daemon=True).start()

  def _ours(self, header: dict) -> bool: return header.get("format") == FORMAT and header.get("fingerprint") == self.fingerprint

  def _sweep_temps(self):
    """Remove the temp files of writers that died: their pid is gone, or is ours (a server makes its one store before
    writing anything, so those are a previous process's). A live process's are left alone (should that pid not be a
    writer, the cost is a leftover file, never a broken write)."""
    for p in self.dir.iterdir():
      if not (m := TEMP.fullmatch(p.name)): continue
      pid = int(m[2])
      if pid != os.getpid() and pid > 0:
        try: os.kill(pid, 0); continue
        except PermissionError: continue  # alive, another user's
        except (ProcessLookupError, OverflowError): pass
      with contextlib.suppress(OSError):
        if stat.S_ISREG(os.lstat(p).st_mode): p.unlink(); log.info("kv cache: removed stale temp file %s", p.name)

  def _scan(self):
    for p in sorted(self.dir.glob("*" + SUFFIX)):
      try:
        f, st = _open_regular(p)
        with f: header, off = _read_header(f, st.st_size)
        if not self._ours(header): continue  # another model's or version's: not ours to use (nor to delete)
        tokens = _check_file(header, off, st.st_size, p.stem)
      except Exception as e:  # one bad file costs itself, never the start-up
        log.warning("kv cache: ignoring %s: %s", p.name, e); self.rejected += 1; continue
      self.index[p.stem] = Entry(p, tokens, st.st_size)
    if self.index: log.info("kv cache: %d saved prefixes in %s", len(self.index), self.dir)

  def discard(self, entry: Entry, reason, delete: bool = False) -> None:
    """Stop using `entry` (one warning); with `delete`, also remove its file, if it still is a regular file: unlink never
    follows a link, and the lstat keeps a FIFO or directory swapped in under the name."""
    log.warning("kv cache: ignoring %s: %s", entry.path.name, reason)
    self.rejected += 1
    with self.lock:
      if self.index.get(entry.path.stem) is entry: del self.index[entry.path.stem]
    if delete:
      with contextlib.suppress(OSError):
        if stat.S_ISREG(os.lstat(entry.path).st_mode): entry.path.unlink()

  # *** lookup and load (the inference worker's thread) ***

  def lookup(self, prompt: list[int], whole: bool = False) -> tuple[Entry | None, int]:
    """The saved entry sharing the longest prefix with `prompt`, and that length; with `whole`, only entries all of
    whose tokens begin `prompt` (a state that resumes only where it ends: DeepSeek V4's rings)."""
    p, best, best_n = np.asarray(prompt, np.int32), None, 0
    with self.lock: entries = list(self.index.values())
    for e in entries:
      try:
        m = min(len(p), len(e.tokens))
        diff = np.flatnonzero(p[:m] != e.tokens[:m])
        n = int(diff[0]) if len(diff) else m
      except Exception as ex: self.discard(e, f"unusable token ids ({type(ex).__name__}: {ex})"); continue
      if n > best_n and not (whole and n < len(e.tokens)): best, best_n = e, n
    return best, best_n

  def load(self, entry: Entry) -> dict[str, np.ndarray] | None:
    """The entry's arrays, or None (with a warning, and the entry dropped) when it fails any check. The file is deleted
    only when its header names this model and the rest is damaged; anything else found under its name is left alone."""
    ours = False
    try:
      f, st = _open_regular(entry.path)
      with f:
        data = f.read(st.st_size)
        header, off = _read_header(io.BytesIO(data), len(data))
        if not (ours := self._ours(header)): raise NotOurs("written for another model or format")
        if len(data) < 32 or hashlib.sha256(data[:-32]).digest() != data[-32:]: raise CorruptFile("checksum mismatch")
        _check_file(header, off, len(data), entry.path.stem)
        out = {}
        for t in header["tensors"]:
          dt, count = np.dtype(t["dtype"]), math.prod(t["shape"])
          out[t["name"]] = np.frombuffer(data, dt, count, off).reshape(t["shape"])
          off += count * dt.itemsize
        os.utime(f.fileno())  # most recently used; through the fd, so the file checked is the file touched
      self.loaded += 1
      return out
    except Exception as e:
      self.discard(entry, e, delete=ours and isinstance(e, CorruptFile))
      return None

  # *** save (arrays are copied off the device by the worker; files are written on a thread of their own) ***

  def wants(self, tokens: list[int]) -> bool:
    if len(tokens) < self.min_tokens: return False
    key = tokens_key(tokens)
    with self.lock:
      if key in self.index or key in self.pending: return False
    return not os.path.lexists(self.dir / (key + SUFFIX))  # a file we do not use (another model's, a dropped one) stays

  def save(self, tokens: list[int], rows: list[tuple[str, np.ndarray]]) -> None:
    key = tokens_key(tokens)
    with self.lock: self.pending.add(key)
    self.writes.put((key, list(tokens), rows))

  def flush(self, timeout: float = 30.0) -> None:
    """Wait for pending writes (tests, shutdown)."""
    end = time.monotonic() + timeout
    while self.pending and time.monotonic() < end: time.sleep(0.01)

  def _writer(self):
    while True:  # never dies: a failed save costs that save
      key, tokens, rows = self.writes.get()
      try: self._write(key, tokens, rows)
      except Exception as e: log.warning("kv cache: could not save %s: %s: %s", key, type(e).__name__, e)
      finally:
        with self.lock: self.pending.discard(key)

  def _write(self, key: str, tokens: list[int], rows: list[tuple[str, np.ndarray]]):
    arrays = [(n, np.ascontiguousarray(a)) for n, a in rows]
    payload = sum(a.nbytes for _, a in arrays)
    meta = {"format": FORMAT, "fingerprint": self.fingerprint, "tokens": tokens, "payload_bytes": payload,
            "tensors": [{"name": n, "dtype": a.dtype.str, "shape": list(a.shape)} for n, a in arrays]}
    header = json.dumps(_check_header(meta)).encode()  # never a file the scan would refuse (an object array's buffer is its pointers)
    size = len(MAGIC) + 4 + len(header) + payload + 32
    if size > self.cap: return  # would evict everything else and still not fit
    path, tmp = self.dir / (key + SUFFIX), self.dir / f".{key}.{os.getpid()}.tmp"
    # O_EXCL: a name already there (a link planted to redirect the write) fails the save, and is not ours to remove
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
      h = hashlib.sha256()
      with open(fd, "wb") as f:
        for part in (MAGIC, struct.pack("<I", len(header)), header, *(memoryview(a).cast("B") for _, a in arrays)):
          h.update(part); f.write(part)
        f.write(h.digest()); f.flush(); os.fsync(f.fileno())
      # names hash the token ids alone: one there now is another model's file for the same prompt, not ours to replace
      if os.path.lexists(path): raise FileExistsError(f"{path.name} exists")
      os.replace(tmp, path)
    except BaseException:
      with contextlib.suppress(OSError): os.unlink(tmp)
      raise
    with self.lock: self.index[key] = Entry(path, np.asarray(tokens, np.int32), size)
    self.saved += 1
    dfd = os.open(self.dir, os.O_RDONLY)
    try: os.fsync(dfd)  # the rename itself survives a crash
    finally: os.close(dfd)
    self._evict(keep=key)

  def _evict(self, keep: str):
    """Delete this store's least recently used entries while they hold more than the cap. Only indexed entries are
    candidates, sized by lstat: one whose name is no longer a regular file is dropped from the index and left alone."""
    with self.lock: entries = list(self.index.items())
    files, total = [], 0
    for key, e in entries:
      try: st = os.lstat(e.path)
      except OSError: st = None
      if st is None or not stat.S_ISREG(st.st_mode):
        with self.lock: self.index.pop(key, None)
        continue
      files.append((st.st_mtime, key, e.path, st.st_size)); total += st.st_size
    for _, key, p, s in sorted(files):
      if total <= self.cap: break
      if key == keep: continue
      try: p.unlink()
      except OSError: continue
      total -= s
      with self.lock: self.index.pop(key, None)
      log.info("kv cache: evicted %s (%d bytes)", p.name, s)

  def stats(self) -> dict:
    with self.lock: n, size = len(self.index), sum(e.size for e in self.index.values())
    return {"entries": n, "bytes": size, "cap_bytes": self.cap, "saved": self.saved, "loaded": self.loaded, "rejected": self.rejected}
