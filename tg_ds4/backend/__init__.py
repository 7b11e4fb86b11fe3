"""What differs per device, behind one seam. For the CPU (backend/cpu): tinygrad's kernel heuristic patched for
quantized GEMVs and chunk GEMMs (kernel_opts), captured steps replayed by a native multi-core runner (replay,
cpu_runner.c), and whether some weight formats are re-encoded for the CPU's code (models/widen.py). Each is installed when a model is loaded
for the CPU, never on import, and only where backend/compat.py says tinygrad's internals are the ones they were written for.
For GPU renderers (backend/gpu): the packed GEMVs' kernel opts; everything else is stock tinygrad."""
from __future__ import annotations

import functools, os, platform

from tinygrad import Device

from tg_ds4.backend import compat, programs
from tg_ds4.backend.compat import CapturedJit

def on_cpu(device: str | None) -> bool: return (device or Device.DEFAULT).split(":")[0] == "CPU"

def gemm_panel(device: str) -> int | None:
  """How many outputs a panel of a prefill GEMM's unpacked weight holds on `device` (nn/layers.py's matmul lays the
  float copy out as `[out / n, in, n]`: every iteration of the GEMM kernel then reads one contiguous run), or None for
  the plain `[in, out]` copy. On the CPU, kernel_opts' `CPU.panel`: the outputs of one vector GEMM iteration, or half
  of them."""
  if not on_cpu(device) or not compat.kernel_opts_on(): return None
  from tg_ds4.backend.cpu.kernel_opts import CPU
  return CPU.panel

def in_range_gathers(device: str) -> bool:
  """Whether a gather index (expert or token ids, always in range) is taken modulo its axis as unsigned before it
  indexes packed weights on `device`: the CPU's C compiler can then prove every gathered row in range and vectorizes
  its loads (quant/formats.py's QTensor.__getitem__). Off elsewhere: a GPU gains nothing, and tinygrad 0.14's WGSL
  renderer cannot render the 64-bit cast the unsigned modulo lowers to (`KeyError: dtypes.long`)."""
  return getattr(Device[device].renderer, "has_threads", False)

def affine_gemv(device: str) -> bool:
  """Whether a GEMV over a format with one scale per block (Q4_0, Q8_0, ...) sums each block's products before scaling
  them (quant/formats.py's linear): on the CPU this saves a multiply per weight, and an integer add per weight where
  the format has an offset (Q4_0's -8), which is what its code is bound by. GPU renderers keep the per-value form
  their kernel opts (backend/gpu) were written for; NULL's generic renderer schedules as the CPU does (its kernel
  budgets are the CPU's). `TG_DS4_AFFINE_GEMV=0` keeps the per-value form."""
  return not Device[device].renderer.has_local and compat.kernel_opts_on() and os.environ.get("TG_DS4_AFFINE_GEMV", "1") != "0"

def expert_tiles(device: str) -> bool:
  """Whether a prefill chunk's routed experts run as tiles of tokens grouped by expert (nn/moe.py's MoE.experts): each
  weight value unpacked once per tile instead of once per (token, expert) pair, which bounds the CPU's packed GEMVs.
  On the CPU and NULL's generic renderer; GPU renderers keep the per-pair GEMVs their kernel budgets were counted
  with. `TG_DS4_EXPERT_TILES=0` keeps the per-pair GEMVs."""
  return not Device[device].renderer.has_local and os.environ.get("TG_DS4_EXPERT_TILES", "1") != "0"

def rotated_q_stored(device: str) -> bool:
  """Whether a decode step's GQA attention stores its rotated q once (one more kernel per layer) instead of rotating q
  again for every cached key its scores kernel reads: on the CPU (and NULL's generic renderer, which schedules as the
  CPU does) the rotation per key costs more than the scores themselves; GPU renderers keep the kernel count their
  budgets hold."""
  return not Device[device].renderer.has_local

def norm_stored(device: str) -> bool:
  """Whether a norm's output is materialised before the matmuls that read it (one more kernel per norm). Left lazy it
  fuses into every GEMV and GEMM that reads it and is recomputed for each output row: a multiply by the norm's weight
  and a division by the root mean square per weight value, which bound the CPU's packed GEMVs. On the CPU and NULL's
  generic renderer; GPU renderers keep the kernel count their budgets hold."""
  return not Device[device].renderer.has_local

def absorb_gemm(device: str) -> bool:
  """Whether a chunk's attn_v_b product (nn/mla.py's _absorb) unpacks its weight as `[H, in, out]` for kernel_opts'
  GEMM. On the CPU and NULL's generic renderer; GPU renderers keep the `[H, out, in]` copy their kernels were counted
  with."""
  return not Device[device].renderer.has_local and compat.kernel_opts_on()

INT_DOT_FORMATS = ("Q4_0", "Q4_1", "Q8_0")  # the weight formats quant/intdot.py has kernels for

@functools.cache
def _avx2_cpu() -> bool:
  from tg_ds4.backend.cpu.kernel_opts import _cpu_flags  # the one reading of /proc/cpuinfo; imported only where compat allows
  return platform.machine().lower() in ("x86_64", "amd64") and {"avx2", "f16c", "fma"} <= set(_cpu_flags().split())

def int_dot_available(device: str) -> bool:
  """Whether `device` runs integer block dot products (quant/intdot.py): the CPU device, tinygrad's internals as
  backend/compat.py expects, an x86 CPU with AVX2, F16C and FMA, `TG_DS4_INT_DOT` not 0."""
  return (on_cpu(device) and compat.internals_match() and os.environ.get("TG_DS4_INT_DOT", "1") != "0" and _avx2_cpu()
          and isinstance(Device[device].renderer, compat.ClangRenderer))

def int_dot_format(weight_type: str | None, device: str) -> bool:
  """Whether `device` takes integer block dot products for `weight_type` weights (None: for any type): Q4_0/Q4_1/Q8_0
  where int_dot_available. The "auto" numerics (quant/activations.py) round exactly these."""
  return int_dot_available(device) and (weight_type is None or weight_type in INT_DOT_FORMATS)

def prepare_device(device: str) -> None:
  """Before anything is lowered for `device`: our kernel heuristic (backend/cpu/kernel_opts.py on CPU renderers, the
  CPU device or NULL lowering for it; backend/gpu/kernel_opts.py's packed GEMVs on GPU renderers) and, where clang
  compiles the kernels, its vectorizer's cap (backend/cpu/compiler.py), unless backend/compat.py says they stay off."""
  programs.install()  # kernels lowered by other processes (TG_DS4_PROGRAM_CACHE=1)
  compat.per_thread_compile_cache()  # serve compiles in its worker thread
  ren = Device[device].renderer
  cpu, gpu = getattr(ren, "has_threads", False), ren.has_local and ren.has_shared  # (NULL's generic renderer is neither)
  if (cpu or gpu) and compat.kernel_opts_on():
    from tg_ds4.backend.cpu import kernel_opts  # CPU GEMVs keep their lane accumulators without a row upcast (see kernel_opts)
    kernel_opts.install()
  if cpu and compat.kernel_opts_on() and isinstance(ren.compiler, compat.ClangCompiler):
    from tg_ds4.backend.cpu import compiler  # a batched GEMV's accumulators vectorized per row (see compiler.py)
    compiler.add_flags(ren.compiler)

def widens_weights(device: str) -> bool:
  """Whether dense weights in formats the CPU's code handles slowly are re-encoded with the same values at load
  (models/widen.py): on the CPU, unless `TG_DS4_WIDEN=0`."""
  return on_cpu(device) and os.environ.get("TG_DS4_WIDEN", "1") != "0"

def replay(captured: CapturedJit, device: str | None) -> CapturedJit:
  """How a captured step is replayed on `device`: natively on the CPU (backend/cpu/replay.py), else as tinygrad does."""
  if not on_cpu(device) or not compat.fast_replay_on(): return captured
  from tg_ds4.backend.cpu import replay as cpu_replay
  return cpu_replay.fast(captured)
