"""One flag for the C compiler that builds CPU kernels: `-mllvm -slp-max-vf=16`.

A GEMV over a few rows of x (a batched decode step, nn/cache_rows.py) keeps LANES accumulators per row, all in one
loop. clang's SLP vectorizer seeds on the loop's accumulator phis as one list and tries its widest vector first: 64
for 4 rows x 16 lanes, which it rejects, and then it leaves the whole list scalar (clang 14: "List vectorization was
possible but not beneficial"): smollm2's Q4_1 gate|up for 4 rows then ran as scalar code. Capped at 16 (one row's
lanes), it vectorizes each row's accumulators as for one row, unpacking each weight once for all rows. The cap changes
which instructions clang picks, not the C program: no operation is reordered (no fast-math), so results are bitwise
the same. A compiler that does not take the flag (another C compiler, an LLVM without the option) gets none;
`TG_DS4_SLP_MAX_VF=0` leaves it off, another number caps there."""
from __future__ import annotations

import functools, logging, os, subprocess

from tg_ds4.backend.compat import ClangCompiler

SLP_MAX_VF = int(os.environ.get("TG_DS4_SLP_MAX_VF", "16"))  # 0: no cap, clang's own choice
FLAGS = ("-mllvm", f"-slp-max-vf={SLP_MAX_VF}")
_clang_init = ClangCompiler.__init__

@functools.cache
def _accepted(cc: str, flags: tuple[str, ...]) -> bool:
  try:
    r = subprocess.run([cc, "-c", "-x", "c", "-O2", *flags, "-", "-o", os.devnull], input=b"int f(int x) { return x + 1; }\n",
                       capture_output=True, timeout=60)
  except (OSError, subprocess.TimeoutExpired): return False
  if r.returncode: logging.getLogger("tg_ds4").info("%s does not take %s: CPU kernels compiled without it", cc, " ".join(flags))
  return r.returncode == 0

def add_flags(compiler) -> None:
  """Add FLAGS to a tinygrad ClangCompiler (idempotent), and to its cache key, so that kernels compiled without them are
  not reused from tinygrad's disk cache."""
  args = getattr(compiler, "args", None)
  if not SLP_MAX_VF or not isinstance(args, list) or all(f in args for f in FLAGS) or not _accepted(os.environ.get("CC", "clang"), FLAGS): return
  compiler.args = [*args, *FLAGS]
  if compiler.cachekey is not None: compiler.cachekey = f"{compiler.cachekey}_slp{SLP_MAX_VF}"

def _init(self, *args, **kwargs):
  _clang_init(self, *args, **kwargs)
  add_flags(self)

def install() -> None:
  """Every ClangCompiler made from now on gets FLAGS (idempotent). tinygrad's compile workers rebuild the renderer, and
  with it its compiler, from its target when they unpickle it, so this runs in each worker too (kernel_opts._init_worker);
  the compiler of a renderer already made is add_flags' job."""
  ClangCompiler.__init__ = _init
