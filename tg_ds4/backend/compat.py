"""The one seam between tg_ds4 and tinygrad's internals: every tinygrad name used beyond the package's public exports
(`from tinygrad import Tensor, UOp, ...`) is imported here and nowhere else, and the release they were written against
is checked here.

Two groups. The graph and buffer internals (Buffer, Ops, the JIT's capture, dtype conversions) are what any device
needs; they have been stable across releases and a change there is an error at import. The CPU machinery's
(backend/cpu: the kernel heuristic patches tinygrad's codegen, the native replay calls compiled CPU programs itself)
and the PYTHON device's lockstep programs (backend/emulator.py) are used only when a model is loaded for the device
they serve, and only on the release below: on another one, or when they cannot be imported, they stay off (one
warning) and the stock tinygrad path runs, slower, never wrong. `TG_DS4_KERNEL_OPTS=0`, `TG_DS4_FAST_REPLAY=0` and
`TG_DS4_FAST_EMULATOR=0` turn each off by hand. Nothing here patches anything: backend.prepare_device does, when a
model is loaded, never on import."""
import contextlib, functools, importlib.metadata, logging, os, sqlite3, threading

# graph and buffer internals, for every device
from tinygrad.device import Buffer, BufferSpec, Compiler  # noqa: F401
from tinygrad.dtype import DType, _from_np_dtype, _to_np_dtype, dtypes  # noqa: F401
from tinygrad.engine import jit as tinygrad_jit, realize  # noqa: F401  (profile times kernels through realize.track_stats; tools/gpu_record.py)
from tinygrad.engine.jit import CapturedJit, JitError, _copy_input, _TinyJit  # noqa: F401
from tinygrad.function import function  # noqa: F401
from tinygrad.renderer import Estimates  # noqa: F401
from tinygrad.helpers import BEAM, DEBUG, NUM_CPU_THREADS, PARALLEL, PROFILE, ContextVar, GlobalCounters, perf_counter_us, prod, to_tuple  # noqa: F401
from tinygrad.uop.ops import AxisType, GroupOp, KernelInfo, Ops, PatternMatcher, UOp, UPat, buffers, graph_rewrite, remove_all_tags, sym_infer  # noqa: F401

# the CPU machinery's (backend/cpu), used only when internals_match()
try:
  import tinygrad.codegen as codegen  # noqa: F401
  from tinygrad import helpers as tinygrad_helpers  # noqa: F401  (its compile cache's database connection)
  from tinygrad.codegen.opt import KernelOptError, Opt, OptOps, heuristic  # noqa: F401
  from tinygrad.codegen.opt.postrange import Scheduler  # noqa: F401
  from tinygrad.engine import worker  # noqa: F401
  from tinygrad.engine.realize import ExecContext, _resolve, estimate_uop, get_call_arg_uops, get_runtime, pm_exec, track_stats  # noqa: F401
  from tinygrad.renderer.cstyle import ClangRenderer  # noqa: F401
  from tinygrad.runtime.ops_cpu import MAX_ARGS, CPUProgram  # noqa: F401
  from tinygrad.runtime.support.compiler_cpu import ClangCompiler  # noqa: F401
  from tinygrad.schedule import indexing as schedule_indexing, rangeify as schedule_rangeify  # noqa: F401  (backend/store_hazard.py)
  from tinygrad.uop.ops import upat_interpret  # noqa: F401  (backend/store_hazard.py)
  from tinygrad.uop.upat import upat_compile  # noqa: F401  (backend/store_hazard.py)
  from tinygrad.dtype import AddrSpace  # noqa: F401  (backend/emulator.py)
  from tinygrad.helpers import is_image_shape  # noqa: F401  (backend/emulator.py)
  from tinygrad.helpers import strip_parens  # noqa: F401  (backend/cpu/kernel_opts.py's float rendering)
  from tinygrad.runtime.ops_python import PythonProgram  # noqa: F401  (backend/emulator.py)
  _CPU_IMPORT_ERROR: str | None = None
except (ImportError, AttributeError) as e:  # another release moved something
  _CPU_IMPORT_ERROR = str(e)

TINYGRAD = "0.14.0"  # the release the internals below were written against (pyproject pins it)

@functools.cache
def internals_match() -> bool:
  if (v := importlib.metadata.version("tinygrad")) == TINYGRAD and _CPU_IMPORT_ERROR is None: return True
  if v == TINYGRAD:
    logging.getLogger("tg_ds4").warning("tinygrad %s: %s; tg_ds4's CPU kernel heuristic and native replay are off, stock tinygrad runs",
                                        v, _CPU_IMPORT_ERROR)
    return False
  logging.getLogger("tg_ds4").warning("tinygrad %s is installed, tg_ds4's CPU kernel heuristic and native replay were written for %s: "
                                      "both are off, stock tinygrad runs", v, TINYGRAD)
  return False

def kernel_opts_on() -> bool: return os.environ.get("TG_DS4_KERNEL_OPTS", "1") != "0" and internals_match()

def per_thread_compile_cache() -> None:
  """tinygrad opens its compile cache's sqlite database once a process and sqlite refuses a connection's use from
  another thread: a kernel compiled in serve's worker thread (one new kernel, or every kernel under PARALLEL=0) failed
  the request with ProgrammingError once the main thread had opened it. One connection a thread, opened the way tinygrad
  opens its own. Idempotent; nothing on another release."""
  if not internals_match() or getattr(tinygrad_helpers.db_connection, "per_thread", False): return
  local = threading.local()
  def db_connection():
    if (conn := getattr(local, "conn", None)) is None:
      os.makedirs(os.path.dirname(tinygrad_helpers.CACHEDB), exist_ok=True)
      conn = local.conn = sqlite3.connect(tinygrad_helpers.CACHEDB, timeout=60, isolation_level="IMMEDIATE")
      with contextlib.suppress(sqlite3.OperationalError): conn.execute("PRAGMA journal_mode=WAL").fetchone()
      conn.execute("PRAGMA synchronous=NORMAL")
    return conn
  db_connection.per_thread = True
  tinygrad_helpers.db_connection = db_connection

def release_freed_buffers(device: str) -> None:
  """Hand the buffers freed so far back to the system: tinygrad's allocator keeps freed buffers for reuse by size, and a
  load that replaces in-memory weights (stacked q|k|v or gate|up rows of a quantized checkpoint) would otherwise keep
  the replaced ones. Nothing to do if the allocator has no such cache."""
  from tinygrad import Device
  if internals_match() and callable(free := getattr(Device[device].allocator, "free_cache", None)): free()

def copy_in(buf: Buffer, data: memoryview) -> None:
  """Host bytes into an allocated buffer of the same size. On the CPU the allocator's own copy (a memcpy); elsewhere, or
  on another release, tinygrad's copy op (slower: it runs through the executor)."""
  if internals_match() and str(buf.device).startswith("CPU") and buf._base is None and callable(getattr(buf.allocator, "_copyin", None)):
    buf.allocator._copyin(buf._buf, data)
  else: buf.copy_from(Buffer("PYTHON", buf.size, buf.dtype, opaque=data))

def copy_out(buf: Buffer) -> memoryview:
  """An allocated buffer's bytes on the host. Where the allocator has its own copy (CPU, CUDA, NV, AMD, Metal...: it
  waits for the device, then copies) that copy alone; on another release, or a device without one, tinygrad's copy
  op, which builds and runs a copy program through the executor: ~200 us of Python per call, which a GPU's decode
  loop would pay for every token it reads back."""
  if not (internals_match() and buf.is_initialized() and callable(getattr(buf.allocator, "_copyout", None))): return buf.as_memoryview()
  buf.allocator._copyout(out := memoryview(bytearray(buf.nbytes)), buf._buf)
  return out

# A decode step's attention over a symbolic number of chunks of cache rows (nn/mla.py): `pos // size + 1` would be a
# symbolic shape with a division in it, which tinygrad's scheduler does not get through; as a variable of its own it is
# one more input of the captured step, which the JIT derives from the position's on every call (derived_variables_on)
CHUNK_SIZES = (64,)

def chunk_count(pos: "UOp", size: int) -> "UOp":
  """The chunks of `size` rows that rows [0, pos] span, `pos // size + 1`, as a variable bound to it (the position a
  bound variable), named after the position's so that every call of a captured step derives its value."""
  assert size in CHUNK_SIZES, size
  var, val = pos.unbind()
  return UOp.variable(f"{var.expr}_chunks{size}", 1, int(var.vmax) // size + 1).bind(val // size + 1)

def derived_variables_on() -> bool: return os.environ.get("TG_DS4_ATTENTION_CHUNKS", "1") != "0" and internals_match()

def install_derived_variables() -> None:
  """The JIT's inputs with every chunk_count variable added: a captured step binds only the variables it is given."""
  if getattr(tinygrad_jit._prepare_jit_inputs, "derives_chunks", False): return
  orig = tinygrad_jit._prepare_jit_inputs
  def prepare(args, kwargs):
    bufs, var_vals, names, info = orig(args, kwargs)
    for name, val in list(var_vals.items()): var_vals.update({f"{name}_chunks{c}": val // c + 1 for c in CHUNK_SIZES})
    return bufs, var_vals, names, info
  prepare.derives_chunks = True
  tinygrad_jit._prepare_jit_inputs = prepare

def fast_replay_on() -> bool: return os.environ.get("TG_DS4_FAST_REPLAY", "1") != "0" and internals_match()

def fast_schedule_on() -> bool: return os.environ.get("TG_DS4_FAST_SCHEDULE", "1") != "0" and internals_match()

def fast_emulator_on() -> bool: return os.environ.get("TG_DS4_FAST_EMULATOR", "1") != "0" and internals_match()

def batch_compile_on() -> bool: return os.environ.get("TG_DS4_BATCH_COMPILE", "1") != "0" and internals_match()

def no_tf32_on_null_cuda() -> None:
  """tinygrad's tensor-core search skips float32 inputs (TF32) on a CUDA or NV device unless ALLOW_TF32, by the target's
  device name; lowered on NULL the name is NULL and the float32 attention scores took TF32 tensor cores that a GPU never
  runs. The CUDA renderer here offers no float32 ones unless ALLOW_TF32, as a GPU's search would pick."""
  from tinygrad.helpers import ALLOW_TF32
  from tinygrad.renderer.cstyle import CUDARenderer
  if getattr(CUDARenderer.__init__, "_tg_ds4_no_tf32", False): return
  orig = CUDARenderer.__init__
  def init(self, *args, **kwargs):
    orig(self, *args, **kwargs)
    if not ALLOW_TF32: self.tensor_cores = [t for t in self.tensor_cores if t.dtype_in != dtypes.float]
  init._tg_ds4_no_tf32 = True
  CUDARenderer.__init__ = init

def lowering_target(dev: str) -> None:
  """Make a NULL-device GPU target (`DEV=NULL:<renderer>[:<arch>]`: scheduled and lowered, nothing runs) lowerable on
  a machine with no GPU and no vendor toolkit; call before tinygrad opens the device. CUDA compiles with NVRTC from
  NVIDIA's PyPI wheel (nvidia-cuda-nvrtc-cu12, a test dependency), found through NVRTC_PATH, tinygrad's own override.
  Metal's compiler loads macOS frameworks, so elsewhere a stand-in whose "binary" is the Metal source takes its place:
  the renderer, which decides the kernels, is Metal's own. Other targets need nothing."""
  parts = dev.upper().split(":")
  if parts[0] != "NULL" or len(parts) < 2: return
  if parts[1] == "CUDA": no_tf32_on_null_cuda()
  if parts[1] == "CUDA" and not os.environ.get("NVRTC_PATH"):
    import importlib.util, pathlib
    if (spec := importlib.util.find_spec("nvidia.cuda_nvrtc")) is not None and spec.submodule_search_locations:
      libs = sorted(pathlib.Path(next(iter(spec.submodule_search_locations)), "lib").glob("libnvrtc.so*"))
      if libs: os.environ["NVRTC_PATH"] = str(min(libs, key=lambda p: len(p.name)))
  if parts[1] == "METAL":
    try: import tinygrad.runtime.ops_metal  # noqa: F401  (macOS: the real compiler)
    except Exception:  # noqa: BLE001  (it loads libobjc / Metal frameworks at import)
      import sys, types
      class MetalSourceCompiler(Compiler):
        def __init__(self): super().__init__(None)
        def compile(self, src: str) -> bytes: return src.encode()
      sys.modules["tinygrad.runtime.ops_metal"] = types.SimpleNamespace(MetalCompiler=MetalSourceCompiler)
