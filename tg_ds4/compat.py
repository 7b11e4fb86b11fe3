"""Whether tg_ds4's changes to tinygrad's internals apply: the CPU kernel heuristic (`kernel_opts`) and the native
replay (`replay.FastCPUReplay`) read and patch tinygrad privates of one release. On another release they stay off (one
warning) and the stock tinygrad path runs: slower on the CPU, never wrong. `TG_DS4_KERNEL_OPTS=0` and
`TG_DS4_FAST_REPLAY=0` turn each off by hand. Nothing here patches anything: `kernel_opts.install` does, when a model
is loaded for a CPU renderer (arch.prepare_device, from Runner.load), never on import."""
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

def lowering_target(dev: str) -> None:
  """Make a NULL-device GPU target (`DEV=NULL:<renderer>[:<arch>]`: scheduled and lowered, nothing runs) lowerable on
  a machine with no GPU and no vendor toolkit; call before tinygrad opens the device. CUDA compiles with NVRTC from
  NVIDIA's PyPI wheel (nvidia-cuda-nvrtc-cu12, a test dependency), found through NVRTC_PATH, tinygrad's own override.
  Metal's compiler loads macOS frameworks, so elsewhere a stand-in whose "binary" is the Metal source takes its place:
  the renderer, which decides the kernels, is Metal's own. Other targets need nothing."""
  parts = dev.upper().split(":")
  if parts[0] != "NULL" or len(parts) < 2: return
  if parts[1] == "CUDA" and not os.environ.get("NVRTC_PATH"):
    import importlib.util, pathlib
    if (spec := importlib.util.find_spec("nvidia.cuda_nvrtc")) is not None and spec.submodule_search_locations:
      libs = sorted(pathlib.Path(next(iter(spec.submodule_search_locations)), "lib").glob("libnvrtc.so*"))
      if libs: os.environ["NVRTC_PATH"] = str(min(libs, key=lambda p: len(p.name)))
  if parts[1] == "METAL":
    try: import tinygrad.runtime.ops_metal  # noqa: F401  (macOS: the real compiler)
    except Exception:  # noqa: BLE001  (it loads libobjc / Metal frameworks at import)
      import sys, types
      from tinygrad.device import Compiler
      class MetalSourceCompiler(Compiler):
        def __init__(self): super().__init__(None)
        def compile(self, src: str) -> bytes: return src.encode()
      sys.modules["tinygrad.runtime.ops_metal"] = types.SimpleNamespace(MetalCompiler=MetalSourceCompiler)
