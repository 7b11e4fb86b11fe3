"""Where tg_ds4 keeps what it builds (`$TG_DS4_CACHE`, default ~/.cache/tg_ds4: downloaded models, captured steps, lowered
programs, the CPU replay's runner) and what a compiled artefact depends on beyond its own inputs: tg_ds4's sources, the
CPU, tinygrad's settings and the TG_DS4_* knobs. The step cache (runtime/stepcache.py) and the program cache
(backend/programs.py) key their entries on these."""
from __future__ import annotations

import functools, hashlib, os, pathlib, platform

# tinygrad settings that do not change what a capture lowers to
TINYGRAD_UNKEYED = {"DEBUG", "VIZ", "PROFILE", "PARALLEL", "TRACK_MATCH_STATS", "CAPTURE_PROCESS_REPLAY", "CAPTURING", "NO_COLOR", "CCACHE",
                    "ALLOW_DEVICE_USAGE", "TRACEMETA", "CACHELEVEL", "IGNORE_BEAM_CACHE", "LRU", "DEBUG_RANGEIFY"}

# knobs that change no lowered program: where the caches live, how large they grow, whether kernels are shared
UNKEYED_KNOBS = {"TG_DS4_CACHE", "TG_DS4_STEP_CACHE_SIZE", "TG_DS4_PROGRAM_CACHE", "TG_DS4_PROGRAM_CACHE_SIZE"}

def cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get("TG_DS4_CACHE", pathlib.Path.home() / ".cache" / "tg_ds4"))

@functools.cache
def source_hash() -> str:
  """sha256 of every source file of the package (.py, .c, .toml) with its path."""
  h = hashlib.sha256()
  root = pathlib.Path(__file__).parents[1]
  for p in sorted(root.rglob("*")):
    if p.suffix in (".py", ".c", ".toml") and "__pycache__" not in p.parts:
      h.update(p.relative_to(root).as_posix().encode()); h.update(p.read_bytes())
  return h.hexdigest()

@functools.cache
def cpu_id() -> str:
  """The machine, its CPU flags and core count, hashed: a kernel compiled for one CPU is not run on another."""
  try: flags = next((ln for ln in pathlib.Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith(("flags", "Features"))), "")
  except OSError: flags = ""
  return hashlib.sha256(f"{platform.machine()} {flags} {os.cpu_count()}".encode()).hexdigest()[:16]

def knobs() -> list[tuple[str, str]]:
  """The TG_DS4_* environment settings that change what is lowered."""
  return sorted((k, v) for k, v in os.environ.items() if k.startswith("TG_DS4_") and k not in UNKEYED_KNOBS)
