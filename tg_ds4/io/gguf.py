"""GGUF files as metadata + packed tinygrad tensors backed by the file's own bytes.

Parsing is the `gguf` package's GGUFReader, made strict: every read is bounds-checked, and every tensor's type,
shape and byte range is validated, so a bad file fails with a `GGUFError` naming the file and the field or tensor
instead of hanging or crashing later. Nothing is dequantized here: each tensor is a `QTensor` whose blocks are a
zero-copy view of the mmapped file on the CPU device (a copy from the DISK device elsewhere).
"""
from __future__ import annotations

import contextlib, mmap
import os
import pathlib
import re
import struct
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from tinygrad import Device, Tensor, UOp, dtypes

from tg_ds4.backend.buffers import device_buffer, host_view

from tg_ds4.quant.formats import QTYPES, QTensor, QuantType


class GGUFError(ValueError):
  """A GGUF file that cannot be used; the message names the file and what was wrong."""

SPLIT_RE = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")

@dataclass(frozen=True)
class TensorInfo:
  name: str
  qtype: QuantType
  shape: tuple[int, ...]  # tinygrad order (GGUF dims reversed)
  path: pathlib.Path
  offset: int             # absolute byte offset in `path`
  nbytes: int

  @property
  def n_elements(self) -> int: return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1
  @property
  def block_shape(self) -> tuple[int, ...]: return (*self.shape[:-1], self.shape[-1] // self.qtype.block, self.qtype.nbytes)

class _StrictReader(GGUFReader):
  """GGUFReader with reads past the end of the file turned into errors (upstream returns short arrays, which turns
  a corrupt array length into a near-endless loop) and a record of where parsing was, for error messages."""
  last_field = "(header)"

  def _get(self, offset, dtype, count=1, override_order=None):
    count, itemsize = int(count), np.dtype(dtype).itemsize
    if count < 0 or offset + itemsize * count > len(self.data):
      raise GGUFError(f"truncated after {self.last_field!r}: reading {count} x {np.dtype(dtype).name} at offset {offset} "
                      f"runs past the end of the file ({len(self.data)} bytes)")
    return super()._get(offset, dtype, count, override_order)

  def _push_field(self, field, skip_sum=False):
    if field.name in self.fields: raise GGUFError(f"duplicate metadata key {field.name!r}")
    self.last_field = field.name
    return super()._push_field(field, skip_sum)

  def _get_field_parts(self, orig_offs, raw_type):
    """Arrays get one part instead of one numpy view per item: upstream's per-item views cost ~400 bytes each, which
    for a 150k-token vocabulary (tokens, scores, types, merges) meant ~0.5 GB of RSS and seconds of parsing."""
    if raw_type != GGUFValueType.ARRAY or self.byte_order != "I": return super()._get_field_parts(orig_offs, raw_type)
    itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
    sub, n, offs = GGUFValueType(int(itype[0])), int(alen[0]), orig_offs + 12
    if (nptype := self.gguf_scalar_to_np.get(sub)) is not None:
      arr = self._get(offs, nptype, n)
      return 12 + arr.nbytes, [itype, alen, arr], [2], [GGUFValueType.ARRAY, sub]
    if sub != GGUFValueType.STRING: return super()._get_field_parts(orig_offs, raw_type)
    mv, size, strings = memoryview(self.data), len(self.data), []
    for _ in range(n):
      if offs + 8 > size or offs + 8 + (ln := int.from_bytes(mv[offs:offs + 8], "little")) > size:
        raise GGUFError(f"truncated after {self.last_field!r}: string array of {n} items runs past the end of the file ({size} bytes)")
      strings.append(bytes(mv[offs + 8:offs + 8 + ln]).decode("utf-8", errors="replace")); offs += 8 + ln
    return offs - orig_offs, [itype, alen, strings], [2], [GGUFValueType.ARRAY, sub]

  def _build_tensors(self, start_offs, fields):  # tensors are built by GGUFFile from the validated infos instead
    self.tensor_fields, self.tensors = fields, []

def _field_value(f) -> Any:
  if not f.types: return None
  if f.types[0] == GGUFValueType.ARRAY:
    if len(f.data) == 1 and isinstance(part := f.parts[f.data[0]], list): return part  # our one-part string arrays
    if len(f.data) == 1 and f.types[-1] != GGUFValueType.STRING: return part.tolist()  # one part holds every number
    if f.types[-1] == GGUFValueType.STRING: return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
    vals = [f.parts[i] for i in f.data]  # nested arrays, big-endian files: upstream's per-item parts
    return np.concatenate(vals).tolist() if vals else []
  if f.types[0] == GGUFValueType.STRING: return bytes(f.parts[-1]).decode("utf-8", errors="replace")
  return f.parts[-1].tolist()[0]

class GGUFFile:
  """One GGUF model (all splits). `metadata` maps keys to Python values; `infos` describes each tensor;
  `tensor(name)` / `tensors()` give packed `QTensor`s on a device."""

  def __init__(self, path: str | os.PathLike):
    self.path = pathlib.Path(path)
    first = _read_one(self.path)
    self.metadata: dict[str, Any] = first[0]
    self.infos: dict[str, TensorInfo] = dict(first[1])
    self.paths = _split_paths(self.path, self.metadata)
    for p in self.paths[1:]:
      for name, info in _read_one(p)[1].items():
        if name in self.infos: raise GGUFError(f"{p}: tensor {name!r} also appears in an earlier split")
        self.infos[name] = info
    self._maps: dict[pathlib.Path, np.memmap] = {}

  @property
  def arch(self) -> str: return self.metadata.get("general.architecture", "")
  @property
  def file_size(self) -> int: return sum(p.stat().st_size for p in self.paths)
  @property
  def n_params(self) -> int: return sum(i.n_elements for i in self.infos.values())
  def __contains__(self, name: str) -> bool: return name in self.infos
  def __repr__(self): return f"GGUFFile({str(self.path)!r}, arch={self.arch!r}, tensors={len(self.infos)})"

  def get(self, key: str, default: Any = None) -> Any:
    """Metadata lookup; `{arch}` in the key is replaced by the architecture name."""
    return self.metadata.get(key.replace("{arch}", self.arch), default)

  def tensor(self, name: str, device: str | None = None) -> QTensor:
    if (info := self.infos.get(name)) is None: raise GGUFError(f"{self.path}: no tensor named {name!r}")
    device = Device.canonicalize(device or Device.DEFAULT)
    if device.startswith("NULL"): raw = Tensor.empty(info.nbytes, dtype=dtypes.uint8, device=device)  # scheduling only
    elif device.startswith("CPU"):
      mm = self._mmap(info.path)
      raw = Tensor.from_blob(mm.ctypes.data + info.offset, (info.nbytes,), dtype=dtypes.uint8, device=device)
      weakref.finalize(raw.uop.buffer, lambda m: None, mm)  # the mapping lives as long as any view of it
      # float32 kernels load 8 floats at offsets that divide by 8 (kernel_opts): a file aligned to less gets a copy
      if info.qtype.name == "F32" and (mm.ctypes.data + info.offset) % 32: raw = raw.clone().realize()
    else: raw = self._upload(info, device)
    return QTensor(raw.reshape(info.block_shape), info.qtype, info.shape)

  def _upload(self, info: TensorInfo, device: str):
    """The tensor's bytes read from the file in bounded pieces into a buffer on `device` (layers.device_buffer)."""
    with open(info.path, "rb", buffering=0) as f:
      def fill(piece: memoryview, off: int) -> None:
        f.seek(info.offset + off)
        got = 0
        while got < len(piece) and (n := f.readinto(piece[got:])): got += n
        if got < len(piece): raise GGUFError(f"{info.path}: tensor {info.name!r} ends past the end of the file")
      return Tensor(UOp.from_buffer(device_buffer(device, info.nbytes, dtypes.uint8, fill)))

  def tensors(self, device: str | None = None) -> dict[str, QTensor]:
    return {name: self.tensor(name, device) for name in self.infos}

  def release(self, t: Tensor) -> None:
    """Drop the pages of this file's mapping that `t` views (a tensor of `tensor` on the CPU, or a reshape of one) from
    the process's memory, once a copy of its bytes replaced it (models/widen.py): the mapping is read-only, so a page
    touched again later is read back from the page cache. Anything else is left alone."""
    a = host_view(t)
    if a is None or not a.nbytes: return
    for mm in self._maps.values():
      if 0 <= (off := a.ctypes.data - mm.ctypes.data) and off + a.nbytes <= mm.nbytes:
        start = off - off % mmap.PAGESIZE
        with contextlib.suppress(OSError, ValueError, AttributeError): mm._mmap.madvise(mmap.MADV_DONTNEED, start, off + a.nbytes - start)
        return

  def _mmap(self, path: pathlib.Path) -> np.memmap:
    if path not in self._maps: self._maps[path] = np.memmap(path, mode="r")
    return self._maps[path]

def open_gguf(path: str | os.PathLike) -> GGUFFile: return GGUFFile(path)

def _read_one(path: pathlib.Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
  try:
    if not path.exists(): raise GGUFError("no such file")
    if path.is_dir(): raise GGUFError("is a directory, expected a .gguf file")
    size = path.stat().st_size
    if size < 24: raise GGUFError(f"truncated header: {size} bytes, a GGUF header needs at least 24")
    with open(path, "rb") as f: magic, version = struct.unpack("<4sI", f.read(8))
    if magic != b"GGUF": raise GGUFError(f"not a GGUF file: magic is {magic!r}, expected b'GGUF'")
    if version not in (2, 3): raise GGUFError(f"GGUF version {version} is not supported (expected 2 or 3)")
    try: r = _StrictReader(path)
    except GGUFError: raise
    except (ValueError, KeyError, IndexError, UnicodeDecodeError, OverflowError, TypeError, MemoryError) as e:
      where = "after " + repr(getattr(e, "last_field", None) or "the header")
      raise GGUFError(f"corrupt metadata or tensor table ({where}): {type(e).__name__}: {e}") from None
    metadata = {name: _field_value(f) for name, f in r.fields.items() if not name.startswith("GGUF.")}
    metadata["GGUF.version"], metadata["GGUF.tensor_count"] = int(version), len(r.tensor_fields)
    infos = {}
    for f in r.tensor_fields:
      info = _tensor_info(path, f, r.data_offset, size)
      if info.name in infos: raise GGUFError(f"duplicate tensor {info.name!r}")
      infos[info.name] = info
    return metadata, infos
  except GGUFError as e:
    raise GGUFError(f"{path}: {e}") from None
  except (OSError, mmap.error) as e:
    raise GGUFError(f"{path}: cannot read: {e}") from None

def _tensor_info(path: pathlib.Path, f, data_start: int, size: int) -> TensorInfo:
  _, name_b, _, dims_a, type_a, off_a = f.parts
  try: name = bytes(name_b).decode("utf-8")
  except UnicodeDecodeError: raise GGUFError(f"tensor name {bytes(name_b)[:40]!r} is not UTF-8") from None
  type_id, dims, off = int(type_a[0]), [int(d) for d in dims_a], int(off_a[0])
  if (qt := QTYPES.get(type_id)) is None:
    raise GGUFError(f"tensor {name!r} has unknown or unsupported ggml type id {type_id} "
                    f"(supported: {', '.join(f'{t.name}={t.id}' for t in QTYPES.values())})")
  if not 1 <= len(dims) <= 4: raise GGUFError(f"tensor {name!r} has {len(dims)} dimensions, expected 1 to 4")
  if any(d <= 0 or d >= 1 << 40 for d in dims): raise GGUFError(f"tensor {name!r} has dimensions {dims}, expected positive sizes")
  if dims[0] % qt.block: raise GGUFError(f"tensor {name!r} ({qt.name}) has {dims[0]} elements per row, not a multiple of the block size {qt.block}")
  nbytes = int(np.prod(dims, dtype=object)) // qt.block * qt.nbytes
  start = int(data_start) + off
  if start + nbytes > size:
    raise GGUFError(f"tensor {name!r} ({qt.name} {'x'.join(map(str, dims))}, {nbytes} bytes at offset {start}) extends past the end "
                    f"of the file ({size} bytes)")
  return TensorInfo(name, qt, tuple(reversed(dims)), path, start, nbytes)

def _split_paths(path: pathlib.Path, metadata: dict) -> list[pathlib.Path]:
  count = int(metadata.get("split.count", 1) or 1)
  if count <= 1: return [path]
  if metadata.get("split.no", 0) != 0:
    raise GGUFError(f"{path}: is split {metadata['split.no']} of {count}; open the first split (-00001-of-{count:05d})")
  if not (m := SPLIT_RE.match(str(path))): raise GGUFError(f"{path}: split.count={count} but the name does not end in -00001-of-{count:05d}.gguf")
  paths = [pathlib.Path(f"{m.group(1)}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
  if missing := [str(p) for p in paths if not p.exists()]: raise GGUFError(f"{path}: missing split files: {', '.join(missing)}")
  return paths
