"""llama.cpp's tokenizer test vectors: models/ggml-vocab-*.gguf with their .gguf.inp / .gguf.out, from the
llama-cpp-python 0.3.36 sdist on PyPI (the files llama.cpp's tests/test-tokenizer-0 reads).

`ensure()` returns a directory holding them, in this order of preference: <cache>/vocab/ when already filled; an
extracted copy of the sdist under <cache>/lcp/src/; else the ggml-vocab-* members of the sdist (a cached copy, or one
downloaded from the PEP 691 index and checked against the index's sha256 and the one pinned here), extracted into
<cache>/vocab/. <cache> is ~/.cache/tg_ds4 or $TG_DS4_CACHE. Anything that prevents this raises VectorsUnavailable.

  python tests/vocab_vectors.py      # fetch them now and print the directory
"""
from __future__ import annotations

import json
import pathlib
import shutil
import sys
import tarfile
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from tg_ds4.io.registry import INDEX, _download, _sha256, cache_dir  # noqa: E402

PACKAGE, VERSION = "llama-cpp-python", "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
MEMBERS = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/models/ggml-vocab-"
REQUIRED = ("deepseek-llm", "deepseek-coder", "qwen2", "llama-bpe", "llama-spm", "gpt-2")  # checked for completeness
SEPARATOR = "\n__ggml_vocab_test__\n"

class VectorsUnavailable(RuntimeError): pass

def vocab_dir() -> pathlib.Path: return cache_dir() / "vocab"

def _complete(d: pathlib.Path) -> bool:
  return all((d / f"ggml-vocab-{n}.gguf{ext}").is_file() for n in REQUIRED for ext in ("", ".inp", ".out"))

def ensure() -> pathlib.Path:
  extracted = cache_dir() / "lcp" / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp" / "models"
  for d in (vocab_dir(), extracted):
    if _complete(d): return d
  sdist = next((p for p in (cache_dir() / SDIST, cache_dir() / "lcp" / SDIST) if p.is_file() and _sha256(p) == SHA256), None)
  try:
    if sdist is None: sdist = _fetch_sdist()
    _extract(sdist, vocab_dir())
  except VectorsUnavailable: raise
  except Exception as e:
    raise VectorsUnavailable(f"cannot get llama.cpp's tokenizer test vectors ({SDIST} from {INDEX}/{PACKAGE}/): {type(e).__name__}: {e}. "
                             f"Put the sdist at {cache_dir() / SDIST} (sha256 {SHA256}) to run offline.") from e
  if not _complete(vocab_dir()): raise VectorsUnavailable(f"{sdist} lacks some of the ggml-vocab-{{{','.join(REQUIRED)}}} vectors")
  return vocab_dir()

def _fetch_sdist() -> pathlib.Path:
  req = urllib.request.Request(f"{INDEX}/{PACKAGE}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
  with urllib.request.urlopen(req, timeout=60) as r: files = json.load(r)["files"]
  if not (f := next((f for f in files if f["filename"] == SDIST), None)): raise VectorsUnavailable(f"{SDIST} is not on {INDEX}/{PACKAGE}/")
  if (sha := f["hashes"].get("sha256")) != SHA256: raise VectorsUnavailable(f"the index lists {SDIST} with sha256 {sha}, expected {SHA256}")
  dest = cache_dir() / SDIST
  dest.parent.mkdir(parents=True, exist_ok=True)
  _download(f["url"], dest, sha, f.get("size", 0), SDIST)  # checks the sha256 of what arrived
  return dest

def _extract(sdist: pathlib.Path, out: pathlib.Path):
  tmp = out.with_name(out.name + ".part")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  with tarfile.open(sdist) as tf:
    for m in tf:
      if m.isfile() and m.name.startswith(MEMBERS) and "/" not in m.name[len(MEMBERS):]:
        with tf.extractfile(m) as src, open(tmp / pathlib.PurePosixPath(m.name).name, "wb") as dst: shutil.copyfileobj(src, dst)
  shutil.rmtree(out, ignore_errors=True)
  tmp.rename(out)

def names(d: pathlib.Path) -> list[str]:
  """Vocabs that have test vectors."""
  return sorted(p.name[len("ggml-vocab-"):-len(".gguf.inp")] for p in d.glob("ggml-vocab-*.gguf.inp"))

def read(gguf: pathlib.Path) -> dict[str, list[int]]:
  """text -> expected ids, parsed as test-tokenizer-0.cpp parses them (a std::map: a repeated text keeps its last ids)."""
  raw = pathlib.Path(f"{gguf}.inp").read_bytes().decode("utf-8")
  texts, pos = [], 0
  while pos < len(raw):
    nxt = raw.find(SEPARATOR, pos)
    if nxt < 0: texts.append(raw[pos:]); break
    texts.append(raw[pos:nxt]); pos = nxt + len(SEPARATOR)
  outs = pathlib.Path(f"{gguf}.out").read_text(encoding="utf-8").split("\n")
  if outs and outs[-1] == "": outs.pop()
  if len(texts) != len(outs): raise ValueError(f"{gguf}: {len(texts)} inputs but {len(outs)} outputs")
  return {t: [int(x) for x in o.strip().split(" ") if x] for t, o in zip(texts, outs)}

if __name__ == "__main__": print(ensure())
