"""Whether tg_ds4's changes to tinygrad's internals apply: the CPU kernel heuristic (`kernel_opts`) and the native
replay (`replay.FastCPUReplay`) read and patch tinygrad privates of one release. On another release they stay off (one
warning) and the stock tinygrad path runs: slower on the CPU, never wrong. `TG_DS4_KERNEL_OPTS=0` and
`TG_DS4_FAST_REPLAY=0` turn each off by hand. Nothing here patches anything: `kernel_opts.install` does, when a model
is loaded for a CPU renderer (arch.load_model), never on import."""
import functools, importlib.metadata, logging, os

TINYGRAD = "0.14.0"  # the release the internals below were written against (pyproject pins it)

@functools.cache
def internals_match() -> bool:
  if (v := importlib.metadata.version("tinygrad")) == TINYGRAD: return True
  logging.getLogger("tg_ds4").warning("tinygrad %s is installed, tg_ds4's CPU kernel heuristic and native replay were written for %s: "
                                      "both are off, stock tinygrad runs", v, TINYGRAD)
  return False

def kernel_opts_on() -> bool: return os.environ.get("TG_DS4_KERNEL_OPTS", "1") != "0" and internals_match()

def fast_replay_on() -> bool: return os.environ.get("TG_DS4_FAST_REPLAY", "1") != "0" and internals_match()
