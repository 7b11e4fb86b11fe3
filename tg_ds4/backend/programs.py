"""Lowered kernels shared between processes (`TG_DS4_PROGRAM_CACHE=1`; off by default): tinygrad keeps each kernel it
lowers and compiles (an AST -> a PROGRAM with its source and binary) in a dict of its process, so every new process
lowers again what another one lowered a moment ago, the most expensive part of a cold start. With this on, a kernel
missing from that dict is first looked up in `$TG_DS4_CACHE/programs/`, and one lowered here is written there.

The test suite turns it on (tests/conftest.py): its processes (pytest-xdist workers, CLI and server subprocesses, the
background lowering jobs) then lower each kernel once between them, as one process would. The step cache
(runtime/stepcache.py) saves whole captured steps; this saves kernels, so a step captured for another context size or another
set of settings still reuses every kernel whose AST it shares.

The key of an entry is tinygrad's own key for its in-process dict (the AST's hash, the renderer and its target, the
codegen settings) plus everything else that changes what a kernel lowers to: the compiler's flags, every tinygrad
setting, tinygrad's version, the CPU's flags, a hash of tg_ds4's sources, its TG_DS4_* knobs, and whether our kernel
heuristic is installed (backend/cpu/kernel_opts.py). Nothing is read or written while anything the heuristic reads was
changed by hand since import (a test that forces another CPU kind or replaces a rule): such a process lowers for
itself, as it would without this cache. An entry is a pickle with a sha256 trailer, written to a temp file and renamed;
one that fails its checksum or does not unpickle is lowered again. Least recently used entries are deleted above
`TG_DS4_PROGRAM_CACHE_SIZE` bytes (default 2 GiB)."""
from __future__ import annotations

import contextlib, hashlib, importlib.metadata, logging, os, pathlib, pickle, time

from tg_ds4.backend import compat
from tg_ds4.backend.cache import TINYGRAD_UNKEYED, cache_dir, cpu_id, knobs, source_hash

log = logging.getLogger("tg_ds4")
SUFFIX = ".prg"

def enabled() -> bool: return os.environ.get("TG_DS4_PROGRAM_CACHE", "0") == "1"

def directory() -> pathlib.Path: return cache_dir() / "programs"

def cap_bytes() -> int: return int(os.environ.get("TG_DS4_PROGRAM_CACHE_SIZE", 2 << 30))

if compat.internals_match():
  from tg_ds4.backend.cpu import compiler, kernel_opts
  from tg_ds4.backend.gpu import kernel_opts as gpu_kernel_opts
  _MODULES = (kernel_opts, compiler, gpu_kernel_opts)
  # what the heuristic's modules hold at import, before any test can replace a part of them
  _PRISTINE = {(m, k): id(v) for m in _MODULES for k, v in vars(m).items()}
_lower_and_compile = None  # tinygrad's own, while ours is installed

def install() -> None:
  """Idempotent; nothing when the cache is off or tinygrad's internals are not the release backend/compat.py knows."""
  global _lower_and_compile
  if _lower_and_compile is not None or not enabled() or not compat.internals_match(): return
  _lower_and_compile, compat.realize.lower_and_compile = compat.realize.lower_and_compile, _cached_lower_and_compile
  _evict(directory(), cap_bytes())

def _hooks() -> tuple[str, ...] | None:
  """Which lowering hooks are in place (each tinygrad's or ours), or None if something else replaced one or any part of
  the heuristic's modules changed since import."""
  if any(id(vars(m).get(k)) != v for (m, k), v in _PRISTINE.items()): return None
  state = []
  for now, stock, ours in ((compat.heuristic.hand_coded_optimizations, kernel_opts._hand_coded, kernel_opts.cpu_heuristic),
                           (compat.codegen.memory_coalescing, kernel_opts._tinygrad_coalescing, kernel_opts._memory_coalescing),
                           (compat.ClangRenderer.extra_matcher, kernel_opts._clang_extra, kernel_opts.CLANG_EXTRA),
                           (compat.ClangRenderer.string_rewrite, kernel_opts._clang_strings, kernel_opts.CLANG_STRINGS),
                           (compat.ClangCompiler.__init__, compiler._clang_init, compiler._init)):
    if now is not stock and now is not ours: return None
    state.append("ours" if now is ours else "tinygrad")
  return tuple(state)

def _environment() -> bytes | None:
  if (hooks := _hooks()) is None: return None
  return repr((importlib.metadata.version("tinygrad"), source_hash(), cpu_id(), hooks,
               sorted((k, repr(v.value)) for k, v in compat.ContextVar._cache.items() if k not in TINYGRAD_UNKEYED), knobs())).encode()

def _digest(env: bytes, key: tuple, renderer) -> str:
  """`key`: tinygrad's (AST hash, renderer type, target, codegen settings); the compiler's flags and cache key too."""
  ast_key, ren_type, *rest = key
  cc = getattr(renderer, "compiler", None)
  extra = repr((f"{ren_type.__module__}.{ren_type.__qualname__}", rest, getattr(cc, "args", None), getattr(cc, "cachekey", None)))
  return hashlib.sha256(env + ast_key + extra.encode()).hexdigest()

def _load(p: pathlib.Path):
  try: data = p.read_bytes()
  except OSError: return None
  if len(data) < 32 or hashlib.sha256(data[:-32]).digest() != data[-32:]: return None
  try: prg = pickle.loads(data[:-32])
  except Exception as e:  # noqa: BLE001  (an entry another tinygrad wrote: lowered again)
    log.info("program cache: %s unreadable (%s), lowered again", p.name, e)
    return None
  with contextlib.suppress(OSError): os.utime(p)  # most recently used
  return prg if isinstance(prg, compat.UOp) and prg.op is compat.Ops.PROGRAM else None

def _save(p: pathlib.Path, prg) -> None:
  try: body = pickle.dumps(prg, protocol=5)
  except Exception as e:  # noqa: BLE001  (best effort: the run goes on)
    log.info("program cache: %s not saved (%s)", p.name, e)
    return
  p.parent.mkdir(parents=True, exist_ok=True)
  tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
  try:
    tmp.write_bytes(body + hashlib.sha256(body).digest())
    os.replace(tmp, p)
  except OSError as e: log.info("program cache: %s not saved (%s)", p.name, e)
  finally:
    with contextlib.suppress(OSError): tmp.unlink()

def _cached_lower_and_compile(linear):
  if not enabled() or (env := _environment()) is None: return _lower_and_compile(linear)
  cache, d, missing = compat.codegen.to_program_cache, directory(), {}
  for c in linear.toposort():
    if c.op is compat.Ops.CALL and (a := compat.realize._get_call_to_compile(c)) is not None:
      if (key := compat.codegen.to_program_key(*a)) not in cache and key not in missing: missing[key] = d / f"{_digest(env, key, a[1])}{SUFFIX}"
  for key, p in list(missing.items()):
    if (prg := _load(p)) is not None: cache[key] = prg; del missing[key]
  out = _lower_and_compile(linear)
  for key, p in missing.items():
    if key in cache: _save(p, cache[key])
  return out

def _evict(d: pathlib.Path, cap: int) -> None:
  """Least recently used entries deleted down to `cap` bytes, and temp files a killed process left (an hour old): once a
  process, at install."""
  files = []
  for p in d.glob(".*.tmp"):
    with contextlib.suppress(OSError):
      if p.lstat().st_mtime < time.time() - 3600: p.unlink()
  for p in d.glob("*" + SUFFIX):
    with contextlib.suppress(OSError): st = p.lstat(); files.append((st.st_mtime, p, st.st_size))
  total = sum(s for _, _, s in files)
  for _, p, s in sorted(files):
    if total <= cap: break
    with contextlib.suppress(OSError): p.unlink(); total -= s
