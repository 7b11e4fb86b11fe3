"""Persisted captured steps: a TinyJit capture (its lowered, compiled kernels in order) saved under
`$TG_DS4_CACHE/steps/` and loaded by later processes, which then run the step without scheduling or lowering anything.

What an entry holds: the captured linear (compiled programs, their order, the memory plan) and the small constant
buffers made during capture. What it never holds: the model's weights, caches and tables. Those are referred to by
their attribute path in the model (`blk.3.attn.cache`, `blk.0.ffn.ffn_up.weight`, the GGUF names), and bound to the live
model's buffers at load, after checking each one's size and dtype. Buffers the step writes (scratch) are recreated
empty with fresh identities: tinygrad identifies a buffer by a per-process counter, and an unpickled buffer whose
number a live one already has would silently become that one.

The key is everything that changes the lowered program: the model file's identity (size, and a hash of its header and
tensor table: metadata, names, types, shapes, offsets), the step's name and the model's settings (max context, ...),
the device and its renderer, the CPU's flags, tinygrad's version and settings (BEAM, NOOPT, ...), a hash of tg_ds4's own
sources, and its TG_DS4_* knobs. An entry = MAGIC | u32 header length | header JSON (format, key, step, byte counts) |
pickle | sha256 of all before it; written to a temp file and renamed (two processes starting together both work: the
last rename wins, both files are whole). A truncated, corrupt, foreign or stale entry is skipped with one warning and
rebuilt. Least recently used entries are deleted above `TG_DS4_STEP_CACHE_SIZE` (default 1 GiB).
`TG_DS4_STEP_CACHE=0` turns the cache off. The directory is the user's own cache, trusted like tinygrad's own compile
cache (both hold pickles)."""
from __future__ import annotations

import contextlib, dataclasses, hashlib, io, json, logging, os, pathlib, pickle, struct, time
from dataclasses import dataclass

import numpy as np
from tinygrad import Device

from tg_ds4.backend.cache import TINYGRAD_UNKEYED, cache_dir, cpu_id, knobs, source_hash
from tg_ds4.backend.compat import Buffer, ContextVar, Ops, UOp, _to_np_dtype, buffers
from tg_ds4.nn.layers import named_tensors

log = logging.getLogger("tg_ds4")
FORMAT = 2
MAGIC = b"TGDS4STEP\0"
SUFFIX = ".step"
MAX_CONST_BYTES = 16 << 20  # capture-time constants an entry may carry: more means a weight is missing from the names
def enabled() -> bool: return os.environ.get("TG_DS4_STEP_CACHE", "1") != "0"

def directory() -> pathlib.Path: return cache_dir() / "steps"

def cap_bytes() -> int: return int(os.environ.get("TG_DS4_STEP_CACHE_SIZE", 1 << 30))

def _environment(device: str) -> dict:
  import tinygrad
  ren = Device[device].renderer
  return {"device": device, "renderer": f"{type(ren).__module__}.{type(ren).__name__}", "arch": str(getattr(ren, "arch", "")),
          "global_max": list(ren.global_max or ()), "cpu": cpu_id(), "tinygrad": getattr(tinygrad, "__version__", "?"), "tg_ds4": source_hash(),
          "tinygrad_settings": sorted((k, repr(v.value)) for k, v in ContextVar._cache.items() if k not in TINYGRAD_UNKEYED),
          "knobs": knobs()}

def file_identity(gf) -> str:
  """A GGUF model (every split part): sizes and everything before the tensor data (header, metadata, tensor table), not
  the mtime. Reads a few MB however large the file. A checkpoint folder says its own (io/hf_folder.py's Checkpoint.identity)."""
  if hasattr(gf, "identity"): return gf.identity()
  h = hashlib.sha256()
  for p in gf.paths:
    start = min((i.offset for i in gf.infos.values() if i.path == p), default=0)
    h.update(f"{p.name}:{p.stat().st_size}:{start}".encode())
    with open(p, "rb") as f: h.update(f.read(start))
  return h.hexdigest()

def for_model(model, gf, device: str, **settings) -> StepCache | None:
  """The step cache of a loaded model (None when TG_DS4_STEP_CACHE=0). `settings`: whatever else of the model changes
  its graphs (max context, activation rounding)."""
  if not enabled(): return None
  label = f"{gf.path.name} " + " ".join(f"{k}={v}" for k, v in settings.items())
  return StepCache(model, {"device": device, "model": file_identity(gf), "class": type(model).__name__, **settings}, label)

# *** naming the model's buffers ***

def named_buffers(model) -> dict[Buffer, tuple[UOp, str, int, str]]:
  """Every realized buffer of the model's tensors -> (its BUFFER uop, attribute path, size, dtype name). Keyed by the
  Buffer: a capture may reach it through another uop (tinygrad's `UOp.from_buffer`). A buffer several tensors view keeps
  the first path (attributes in definition order, so the same path in every process). Paths, not GGUF names: a name
  two buffers shared would bind one in the other's place at load."""
  out: dict[Buffer, tuple[UOp, str, int, str]] = {}
  for name, t in named_tensors(model, flat=False):
    if (b := t.uop.base).op is Ops.BUFFER and b.is_realized: out.setdefault(b.buffer, (b, name, b.buffer.size, b.buffer.dtype.name))
  if len({v[1] for v in out.values()}) != len(out): raise ValueError("two model buffers under one path")
  return out

class StaleEntry(ValueError): pass

class _Pickler(pickle.Pickler):
  def __init__(self, f, names: dict[Buffer, tuple[UOp, str, int, str]], written: set[UOp]):
    super().__init__(f, protocol=5)
    self.names, self.written, self.const_bytes = names, written, 0

  def persistent_id(self, obj):
    if isinstance(obj, Buffer): raise pickle.PicklingError("a Buffer outside its BUFFER uop")
    if not isinstance(obj, UOp) or obj.op is not Ops.BUFFER: return None
    b, data = buffers.get(obj), None
    if b is not None and b in self.names: return ("model",) + self.names[b][1:]
    if b is not None and b._base is not None and b._base in self.names:  # a view of a model buffer (a bitcast of its bytes)
      return ("view",) + self.names[b._base][1:] + (b.offset, b.size, b.dtype)
    if b is not None and b.options is not None and b.options.external_ptr:  # memory we do not own (the mapped file): never a copy
      raise pickle.PicklingError(f"an unnamed buffer of {b.nbytes} bytes at an external address (a weight not in the model?)")
    if b is not None and obj not in self.written and b.is_allocated():  # made during capture and only read: a constant
      data = bytes(b.as_memoryview())
      if (n := self.const_bytes + len(data)) > MAX_CONST_BYTES:
        raise pickle.PicklingError(f"{n} bytes of unnamed constants (a weight not in the model?)")
      self.const_bytes = n
    spec = None if b is None else (b.device, b.size, b.dtype, b.options)
    return ("buffer", obj.dtype, obj.src, obj.arg, obj.tag, spec, data)

def _buffer(spec: tuple, data: bytes | None) -> Buffer:
  device, size, dtype, options = spec
  if data is None: return Buffer(device, size, dtype, options=options)
  if device == "PYTHON": return Buffer(device, size, dtype, opaque=memoryview(bytearray(data)))  # host source of a copy
  if device == "NPY": return Buffer(device, size, dtype, opaque=np.frombuffer(bytearray(data), _to_np_dtype(dtype)))
  return Buffer(device, size, dtype, options=options).ensure_allocated().copy_from(Buffer("PYTHON", size, dtype, opaque=memoryview(bytearray(data))))

class _Unpickler(pickle.Unpickler):
  def __init__(self, f, live: dict[str, tuple[UOp, int, str]]):
    super().__init__(f)
    self.live, self.fresh = live, {}

  def _model(self, path: str, size: int, dtype: str) -> UOp:
    if (got := self.live.get(path)) is None or got[1:] != (size, dtype):
      raise StaleEntry(f"model buffer {path!r}: {got and got[1:]} in this model, {(size, dtype)} in the entry")
    return got[0]

  def persistent_load(self, pid):
    if pid[0] == "model": return self._model(*pid[1:])
    if pid[0] == "view":
      if pid not in self.fresh:
        base = self._model(*pid[1:4]).buffer
        self.fresh[pid] = UOp.from_buffer(Buffer(base.device, pid[5], pid[6], base=base, offset=pid[4]))
      return self.fresh[pid]
    _, dtype, src, arg, tag, spec, data = pid
    # keyed by the whole identity: slot numbers repeat across buffers of other sizes and types (tinygrad's memory plan
    # numbers its arenas itself), and one merged with another lost a constant table (warm ds4 logits differed)
    if (key := (dtype, src, arg, tag)) not in self.fresh:  # a new identity: never a live buffer's
      buf = None if spec is None else _buffer(spec, data)
      self.fresh[key] = UOp(Ops.BUFFER, dtype, src, dataclasses.replace(arg, slot=next(UOp.unique_num)), tag, _buffer=buf)
    return self.fresh[key]

@dataclass
class StepCache:
  """The entries of one loaded model: `key(name)` per step; `load(name)` / `save(name, captured)`."""
  holds_model_state = False  # (nn/layers.py's named_tensors does not walk back into the model from here)
  model: object
  identity: dict          # model file identity and settings (max context, ...); the environment is added here
  label: str = ""         # what `tg_ds4 cache` shows (the file name; not part of the key)
  dir: pathlib.Path = dataclasses.field(default_factory=directory)
  loaded: int = 0
  saved: int = 0

  def __post_init__(self): self.identity = {**self.identity, **_environment(self.identity["device"])}

  def key(self, name: str) -> str:
    return hashlib.sha256(json.dumps({"format": FORMAT, "step": name, **self.identity}, sort_keys=True, default=str).encode()).hexdigest()[:32]

  def path(self, name: str) -> pathlib.Path: return self.dir / f"{self.key(name)}{SUFFIX}"

  def load(self, name: str):
    """The CapturedJit saved for step `name`, or None (nothing saved, or an entry that fails a check: warned, removed)."""
    p = self.path(name)
    try: data = p.read_bytes()
    except FileNotFoundError: return None
    except OSError as e: log.warning("step cache: cannot read %s: %s", p.name, e); return None
    try:
      header, payload = _split(data)
      if header.get("key") != p.stem or header.get("step") != name: raise StaleEntry("written for another step")
      live = {path: (u, size, dtype) for u, path, size, dtype in named_buffers(self.model).values()}
      captured, written = _Unpickler(io.BytesIO(payload), live).load()
      captured.__dict__["_written_uops"] = written  # a walk over every call, saved rather than redone
    except Exception as e:  # noqa: BLE001  (a bad entry costs a capture, never the run)
      log.warning("step cache: ignoring %s (%s): %s: %s", p.name, name, type(e).__name__, e)
      with contextlib.suppress(OSError): p.unlink()
      return None
    with contextlib.suppress(OSError): os.utime(p)  # most recently used
    self.loaded += 1
    return captured

  def save(self, name: str, captured) -> None:
    """Write `captured` for step `name` (best effort: a failure is one warning, the run goes on)."""
    try:
      f = io.BytesIO()
      _Pickler(f, named_buffers(self.model), captured._written_uops).dump((captured, captured._written_uops))
      header = json.dumps({"format": FORMAT, "key": self.key(name), "step": name, "model": self.label, "device": self.identity["device"],
                           "created": time.time()}).encode()
      body = MAGIC + struct.pack("<I", len(header)) + header + f.getvalue()
      self.dir.mkdir(parents=True, exist_ok=True)
      p, tmp = self.path(name), self.dir / f".{self.key(name)}.{os.getpid()}.tmp"
      try:
        tmp.write_bytes(body + hashlib.sha256(body).digest())
        os.replace(tmp, p)
      finally:
        with contextlib.suppress(OSError): tmp.unlink()
      self.saved += 1
      evict(self.dir, cap_bytes(), keep=p)
    except Exception as e:  # noqa: BLE001
      log.warning("step cache: could not save step %s: %s: %s", name, type(e).__name__, e)

def _split(data: bytes) -> tuple[dict, bytes]:
  if len(data) < len(MAGIC) + 4 + 32 or data[:len(MAGIC)] != MAGIC: raise StaleEntry("not a tg_ds4 step file")
  if hashlib.sha256(data[:-32]).digest() != data[-32:]: raise StaleEntry("checksum mismatch (truncated or corrupt)")
  (n,) = struct.unpack("<I", data[len(MAGIC):len(MAGIC) + 4])
  header = json.loads(data[len(MAGIC) + 4:len(MAGIC) + 4 + n])
  if not isinstance(header, dict) or header.get("format") != FORMAT: raise StaleEntry("another format version")
  return header, data[len(MAGIC) + 4 + n:-32]

def entries(d: pathlib.Path | None = None) -> list[tuple[pathlib.Path, dict | None, os.stat_result]]:
  """(path, header or None if unreadable, stat) of every entry, least recently used first."""
  out = []
  for p in (d or directory()).glob("*" + SUFFIX):
    try:
      st = p.lstat()
      try: header = _split(p.read_bytes())[0]
      except (StaleEntry, ValueError): header = None
    except OSError: continue
    out.append((p, header, st))
  return sorted(out, key=lambda e: e[2].st_mtime)

def clear(d: pathlib.Path | None = None) -> tuple[int, int]:
  """Delete every entry (and stray temp file); returns (files, bytes)."""
  n = size = 0
  for p in [*(d or directory()).glob("*" + SUFFIX), *(d or directory()).glob(".*.tmp")]:
    with contextlib.suppress(OSError): s = p.lstat().st_size; p.unlink(); n, size = n + 1, size + s
  return n, size

def evict(d: pathlib.Path, cap: int, keep: pathlib.Path | None = None) -> None:
  files = []
  for p in d.glob("*" + SUFFIX):
    with contextlib.suppress(OSError): files.append((p.lstat().st_mtime, p, p.lstat().st_size))
  total = sum(s for _, _, s in files)
  for _, p, s in sorted(files):
    if total <= cap: break
    if p == keep: continue
    with contextlib.suppress(OSError): p.unlink(); total -= s
