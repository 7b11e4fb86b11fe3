"""Persistent prefix KV cache: the cache rows of a prompt saved as one file, so a restarted server skips re-prefilling a
prefix it has seen.

File = MAGIC | u32 header length | header (JSON: format, model fingerprint, token ids, tensor names/dtypes/shapes, payload
size) | payload (each tensor's rows, C order) | sha256 of everything before it. Named by a hash of the token ids, written
to a temp file, fsynced, renamed into place (a crash leaves the old state or the new, never half a file). A file whose
size, checksum, format or model fingerprint does not match is never loaded. Least recently used files (mtime, touched on
every load) are deleted while the directory holds more than the size cap."""
from __future__ import annotations

import hashlib, io, json, logging, os, pathlib, queue, struct, threading, time
from dataclasses import dataclass

import numpy as np

FORMAT = 1
MAGIC = b"TGDS4KV\0"
SUFFIX = ".kv"
log = logging.getLogger("tg_ds4.server")

def model_fingerprint(gguf_path: str | os.PathLike, layout: list[tuple[str, tuple[int, ...], str, int]]) -> str:
  """Identity of the weights and of the cache layout: the file's size, its first 4 MiB (header and metadata) and 16
  samples of 64 KiB spread over the tensor data, plus each cache tensor's name, dtype and row shape (not its row count:
  a different --max-context keeps the files valid)."""
  h, path = hashlib.sha256(f"tg_ds4-kv-{FORMAT}".encode()), pathlib.Path(gguf_path)
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

def _read_header(f, size: int) -> tuple[dict, int]:
  head = f.read(len(MAGIC) + 4)
  if len(head) < len(MAGIC) + 4 or head[:len(MAGIC)] != MAGIC: raise CorruptFile("not a tg_ds4 KV file (bad magic)")
  (hlen,) = struct.unpack("<I", head[len(MAGIC):])
  if hlen > size: raise CorruptFile("truncated header")
  try: header = json.loads(f.read(hlen))
  except ValueError: raise CorruptFile("unreadable header") from None
  if not isinstance(header, dict): raise CorruptFile("unreadable header")
  expect = len(MAGIC) + 4 + hlen + int(header.get("payload_bytes", -1)) + 32
  if size != expect: raise CorruptFile(f"size {size} != {expect} bytes (truncated or appended to)")
  return header, len(MAGIC) + 4 + hlen

class KVStore:
  def __init__(self, directory: str | os.PathLike, fingerprint: str, cap_bytes: int, min_tokens: int):
    self.dir, self.fingerprint, self.cap, self.min_tokens = pathlib.Path(directory), fingerprint, cap_bytes, min_tokens
    self.dir.mkdir(parents=True, exist_ok=True)
    self.index: dict[str, Entry] = {}
    self.lock = threading.Lock()
    self.pending: set[str] = set()
    self.writes: queue.Queue = queue.Queue()
    self.saved = self.loaded = self.rejected = 0
    self._scan()
    threading.Thread(target=self._writer, name="kv-writer", daemon=True).start()

  def _scan(self):
    for p in sorted(self.dir.glob("*" + SUFFIX)):
      try:
        with open(p, "rb") as f: header, _ = _read_header(f, p.stat().st_size)
      except (OSError, CorruptFile) as e:
        log.warning("kv cache: ignoring %s: %s", p.name, e); self.rejected += 1; continue
      if header.get("format") != FORMAT or header.get("fingerprint") != self.fingerprint: continue  # another model or version: not ours
      self.index[p.stem] = Entry(p, np.asarray(header["tokens"], np.int32), p.stat().st_size)
    if self.index: log.info("kv cache: %d saved prefixes in %s", len(self.index), self.dir)

  # *** lookup and load (the inference worker's thread) ***

  def lookup(self, prompt: list[int]) -> tuple[Entry | None, int]:
    """The saved entry sharing the longest prefix with `prompt`, and that length."""
    p, best, best_n = np.asarray(prompt, np.int32), None, 0
    with self.lock: entries = list(self.index.values())
    for e in entries:
      m = min(len(p), len(e.tokens))
      diff = np.flatnonzero(p[:m] != e.tokens[:m])
      n = int(diff[0]) if len(diff) else m
      if n > best_n: best, best_n = e, n
    return best, best_n

  def load(self, entry: Entry) -> dict[str, np.ndarray] | None:
    """The entry's arrays, or None (with a warning, and the file dropped) when it fails any check."""
    try:
      data = entry.path.read_bytes()
      if len(data) < 32 or hashlib.sha256(data[:-32]).digest() != data[-32:]: raise CorruptFile("checksum mismatch")
      header, off = _read_header(io.BytesIO(data), len(data))
      if header.get("format") != FORMAT or header.get("fingerprint") != self.fingerprint: raise CorruptFile("written for another model or format")
      if header["tokens"] != entry.tokens.tolist() or tokens_key(header["tokens"]) != entry.path.stem:
        raise CorruptFile("token ids do not match the name")
      out = {}
      for t in header["tensors"]:
        n = int(np.prod(t["shape"])) * np.dtype(t["dtype"]).itemsize
        out[t["name"]] = np.frombuffer(data, np.dtype(t["dtype"]), int(np.prod(t["shape"])), off).reshape(t["shape"])
        off += n
      os.utime(entry.path)  # most recently used
      self.loaded += 1
      return out
    except (OSError, CorruptFile, KeyError, TypeError, ValueError) as e:
      log.warning("kv cache: ignoring %s: %s", entry.path.name, e)
      self.rejected += 1
      with self.lock: self.index.pop(entry.path.stem, None)
      if isinstance(e, CorruptFile):
        try: entry.path.unlink()
        except OSError: pass
      return None

  # *** save (arrays are copied off the device by the worker; files are written on a thread of their own) ***

  def wants(self, tokens: list[int]) -> bool:
    if len(tokens) < self.min_tokens: return False
    key = tokens_key(tokens)
    with self.lock: return key not in self.index and key not in self.pending

  def save(self, tokens: list[int], rows: list[tuple[str, np.ndarray]]) -> None:
    key = tokens_key(tokens)
    with self.lock: self.pending.add(key)
    self.writes.put((key, list(tokens), rows))

  def flush(self, timeout: float = 30.0) -> None:
    """Wait for pending writes (tests, shutdown)."""
    end = time.monotonic() + timeout
    while self.pending and time.monotonic() < end: time.sleep(0.01)

  def _writer(self):
    while True:
      key, tokens, rows = self.writes.get()
      try: self._write(key, tokens, rows)
      except OSError as e: log.warning("kv cache: could not save %s: %s", key, e)
      finally:
        with self.lock: self.pending.discard(key)

  def _write(self, key: str, tokens: list[int], rows: list[tuple[str, np.ndarray]]):
    arrays = [(n, np.ascontiguousarray(a)) for n, a in rows]
    payload = sum(a.nbytes for _, a in arrays)
    header = json.dumps({"format": FORMAT, "fingerprint": self.fingerprint, "tokens": tokens, "payload_bytes": payload,
                         "tensors": [{"name": n, "dtype": a.dtype.str, "shape": list(a.shape)} for n, a in arrays]}).encode()
    size = len(MAGIC) + 4 + len(header) + payload + 32
    if size > self.cap: return  # would evict everything else and still not fit
    path, tmp = self.dir / (key + SUFFIX), self.dir / f".{key}.{os.getpid()}.tmp"
    h = hashlib.sha256()
    with open(tmp, "wb") as f:
      for part in (MAGIC, struct.pack("<I", len(header)), header, *(memoryview(a).cast("B") for _, a in arrays)):
        h.update(part); f.write(part)
      f.write(h.digest()); f.flush(); os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(self.dir, os.O_RDONLY)
    try: os.fsync(dfd)  # the rename itself survives a crash
    finally: os.close(dfd)
    with self.lock: self.index[key] = Entry(path, np.asarray(tokens, np.int32), size)
    self.saved += 1
    self._evict(keep=key)

  def _evict(self, keep: str):
    files = []
    for p in self.dir.glob("*" + SUFFIX):
      try: st = p.stat()
      except OSError: continue
      files.append((st.st_mtime, p, st.st_size))
    total = sum(s for _, _, s in files)
    for _, p, s in sorted(files):
      if total <= self.cap: break
      if p.stem == keep: continue
      try: p.unlink()
      except OSError: continue
      total -= s
      with self.lock: self.index.pop(p.stem, None)
      log.info("kv cache: evicted %s (%d bytes)", p.name, s)

  def stats(self) -> dict:
    with self.lock: n, size = len(self.index), sum(e.size for e in self.index.values())
    return {"entries": n, "bytes": size, "cap_bytes": self.cap, "saved": self.saved, "loaded": self.loaded, "rejected": self.rejected}
