"""What differs per device, behind one seam.
- `Capabilities` (`capabilities(device)`): what the maths may count on and should prefer on a device, resolved once
  when a model is loaded; the blocks and packed matmuls read it, never the device itself.
- `prepare_device`: for every device, the scheduler's store-hazard checks without a walk of the whole graph per store
  (store_hazard); for the CPU (backend/cpu), tinygrad's kernel heuristic patched for quantized GEMVs and chunk GEMMs
  (kernel_opts) and clang's vectorizer capped (compiler); for GPU renderers (backend/gpu), the packed GEMVs' kernel
  opts. Installed when a model is loaded, never on import, and only where backend/compat.py says tinygrad's internals
  are the ones they were written for.
- `replay`: captured steps replayed on the CPU by a native multi-core runner (backend/cpu/replay.py, cpu_runner.c)."""
from __future__ import annotations

import functools, os, platform
from dataclasses import dataclass

from tinygrad import Device

from tg_ds4.backend import compat, emulator, programs, store_hazard
from tg_ds4.backend.cpu import batch_compile
from tg_ds4.backend.compat import CapturedJit

def on_cpu(device: str | None) -> bool: return (device or Device.DEFAULT).split(":")[0] == "CPU"

@dataclass(frozen=True)
class Capabilities:
  """What the maths may count on, and what it should prefer, on one device: resolved once when a model is loaded
  (`capabilities`) and read by the blocks and the packed matmuls while its graphs are built (quant/settings.py). Most
  fields hold "the CPU's code" against "a GPU renderer's": the CPU device and NULL's generic renderer (which schedules as
  the CPU does: its kernel budgets are the CPU's) take the CPU forms; GPU renderers keep the forms their kernel opts
  (backend/gpu) and kernel budgets were written for."""
  device: str
  half: bool                # a GPU renderer (it launches workgroups): float16 matmul inputs and KV caches by default
  gemm_panel: int | None    # outputs per panel of a prefill GEMM's unpacked weight (nn/layers.py's matmul lays it out
                            # `[out / n, in, n]`: each GEMM iteration reads one contiguous run); None: the plain `[in, out]`
  in_range_gathers: bool    # gather indices taken modulo their axis as unsigned before they index packed weights
                            # (quant/formats.py's QTensor.__getitem__): clang then proves every row in range and vectorizes
                            # its loads. A GPU gains nothing, and tinygrad 0.14's WGSL renderer cannot render the 64-bit
                            # cast it lowers to
  affine_gemv: bool         # a GEMV over a format with one scale per block sums each block's products before scaling
                            # them (quant/formats.py's linear): a multiply per weight saved, and an integer add where the
                            # format has an offset (Q4_0's -8), which is what the CPU's code is bound by
  expert_tiles: bool        # a prefill chunk's routed experts run as tiles of tokens grouped by expert (nn/moe.py): each
                            # weight value unpacked once per tile, not once per (token, expert) pair
  rotated_q_stored: bool    # a decode step's GQA stores its rotated q once (one more kernel a layer) instead of rotating it
                            # again for every cached key its scores kernel reads (nn/gqa.py)
  norm_stored: bool         # a norm's output materialised before the matmuls that read it (one more kernel a norm): left
                            # lazy it is recomputed per output row of every GEMV that reads it, a multiply and a division
                            # per weight value, which bound the CPU's packed GEMVs
  absorb_gemm: bool         # a chunk's attn_v_b product unpacks its weight as `[H, in, out]` for kernel_opts' GEMM
                            # (nn/mla.py)
  int_dot_formats: frozenset[str]  # weight formats whose GEMVs take llama.cpp's integer block dot products
                            # (quant/intdot.py), which "auto" numerics round for (quant/activations.py)
  int_gemm: bool            # a prefill chunk's matmuls over those formats take them too, in tiles of rows, instead of a
                            # float GEMM over the weight dequantized once per chunk
  int_dot_vnni: bool        # those block dots take VNNI's one multiply-add of unsigned by signed bytes into int32 lanes
                            # (AVX-512 VNNI or AVX-VNNI) where AVX2 needs two (bytes to int16 pairs, pairs to int32): the
                            # same integers, as no int16 pair sum of these formats reaches the saturation bound
  c_gemm: tuple[int, int] | None  # (rows, outputs) per statement of a prefill chunk's float GEMM over a panel copy as our
                            # C kernel with vector accumulators (quant/cgemm.py), where tinygrad's renders them scalar
  c_attention: tuple[int, int] | None  # (float lanes, vector registers) of the CPU's vector unit for MLA's and GQA's attention
                            # as our C kernel (nn/attention_kernel.py: scores, softmax and attn·v in one pass over the cache)
  widen_weights: bool       # dense weights in formats the CPU's code handles slowly re-encoded at load (models/widen.py)
  dot_lanes: bool           # a dot product over a long axis sums lanes of partial sums first (quant/formats.py dot_lanes): the
                            # CPU's vector accumulators. A GPU's threads are its lanes: the nested sum kept its kernel opts from
                            # splitting the reduce over a workgroup (backend/gpu's wide_reduce), 16 threads walking 16384 values
  attention_chunk: int | None  # rows per chunk of a decode step's MLA attention over its cache (nn/mla.py): the GPU's
                            # threads split a chunk's rows, each thread looping over the chunks (a symbolic count, where
                            # a loop over the symbolic rows left each head's softmax to one thread); None: one loop
  gemv_lanes: bool          # a packed GEMV sums per lane of a block's layout first, then the lanes (quant/formats.py linear):
                            # the CPU's vector accumulators. On a GPU renderer the blocks are the outer sum instead, so its
                            # kernel opts spread a row's blocks over a warp's threads, each unpacking whole blocks
                            # (backend/gpu's packed_gemv); split over the lanes, each thread unpacked one byte a block
  stacked_projections: bool # MLA's two projections of the normed input (q or q_a, and kv_a) stacked into one weight at load
                            # (nn/mla.py MLA.stack): one GEMV launch a layer fewer on a GPU, where a launch costs more than
                            # the GEMV's tail; the CPU keeps its two
  float_bits: bool          # a packed GEMV's small integers become float32 through their bits (quant/formats.py small_float:
                            # an or and a subtract, full-rate ALU) and it multiplies in float32: an NVIDIA SM converts
                            # int -> float and float <-> half at 16 a clock against 128 FMAs (CUDA C Programming Guide,
                            # arithmetic instruction throughput), and a half product took four conversions a value

# the formats quant/intdot.py (and intdot_k.py) have kernels for
INT_DOT_FORMATS = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "IQ2_XXS", "Q4_K", "Q6_K"})

def capabilities(device: str | None = None) -> Capabilities:
  """`device`'s capabilities under the current TG_DS4_* knobs: `TG_DS4_AFFINE_GEMV=0`, `TG_DS4_EXPERT_TILES=0`,
  `TG_DS4_INT_DOT=0`, `TG_DS4_INT_GEMM=0`, `TG_DS4_GEMV_BLOCKS=0`, `TG_DS4_FLOAT_BITS=0`, `TG_DS4_STACKED_PROJECTIONS=0`,
  `TG_DS4_ATTENTION_CHUNKS=0`,
  `TG_DS4_C_GEMM=0`, `TG_DS4_C_ATTENTION=0`, `TG_DS4_VNNI=0` and `TG_DS4_WIDEN=0` turn their field off;
  `TG_DS4_KERNEL_OPTS=0` (or another tinygrad release) the forms made for our kernel heuristic."""
  device = Device.canonicalize(device or Device.DEFAULT)
  ren, on = Device[device].renderer, lambda knob: os.environ.get(knob, "1") != "0"
  cpu_forms, opts = not ren.has_local, compat.kernel_opts_on()
  int_dot = (on_cpu(device) and compat.internals_match() and on("TG_DS4_INT_DOT") and _avx2_cpu() and isinstance(ren, compat.ClangRenderer))
  return Capabilities(
    device=device, half=ren.has_local, gemm_panel=_cpu_panel() if on_cpu(device) and opts else None,
    in_range_gathers=getattr(ren, "has_threads", False), affine_gemv=cpu_forms and opts and on("TG_DS4_AFFINE_GEMV"),
    expert_tiles=cpu_forms and on("TG_DS4_EXPERT_TILES"), rotated_q_stored=cpu_forms, norm_stored=cpu_forms, absorb_gemm=cpu_forms and opts,
    int_dot_formats=INT_DOT_FORMATS if int_dot else frozenset(), int_gemm=int_dot and on("TG_DS4_INT_GEMM"),
    int_dot_vnni=int_dot and _vnni_cpu() and on("TG_DS4_VNNI"), c_gemm=_cpu_gemm() if int_dot and opts and on("TG_DS4_C_GEMM") else None,
    c_attention=_cpu_unit() if int_dot and opts and on("TG_DS4_C_ATTENTION") else None, widen_weights=on_cpu(device) and on("TG_DS4_WIDEN"),
    dot_lanes=cpu_forms or not opts, gemv_lanes=cpu_forms or not opts or not on("TG_DS4_GEMV_BLOCKS"),
    float_bits=not cpu_forms and opts and on("TG_DS4_GEMV_BLOCKS") and on("TG_DS4_FLOAT_BITS"),
    stacked_projections=not cpu_forms and opts and on("TG_DS4_STACKED_PROJECTIONS"),
    attention_chunk=None if cpu_forms or not opts or not compat.derived_variables_on() else compat.CHUNK_SIZES[0])

def _cpu_gemm() -> tuple[int, int]:
  from tg_ds4.backend.cpu.kernel_opts import CPU  # as _cpu_panel
  return CPU.gemm

def _cpu_unit() -> tuple[int, int]:
  from tg_ds4.backend.cpu.kernel_opts import CPU  # as _cpu_panel
  return CPU.floats, CPU.registers

def _cpu_panel() -> int:
  from tg_ds4.backend.cpu.kernel_opts import CPU  # imported only where compat allows (it patches tinygrad's internals)
  return CPU.panel

@functools.cache
def _avx2_cpu() -> bool:
  from tg_ds4.backend.cpu.kernel_opts import _cpu_flags  # the one reading of /proc/cpuinfo; imported only where compat allows
  return platform.machine().lower() in ("x86_64", "amd64") and {"avx2", "f16c", "fma"} <= set(_cpu_flags().split())

@functools.cache
def _vnni_cpu() -> bool:
  from tg_ds4.backend.cpu.kernel_opts import _cpu_flags  # as _avx2_cpu
  flags = set(_cpu_flags().split())
  return "avx_vnni" in flags or {"avx512_vnni", "avx512vl"} <= flags

def prepare_device(device: str) -> None:
  """Before anything is scheduled or lowered for `device`: the store-hazard checks (backend/store_hazard.py), our
  kernel heuristic (backend/cpu/kernel_opts.py on CPU renderers, the CPU device or NULL lowering for it;
  backend/gpu/kernel_opts.py's packed GEMVs on GPU renderers) and, where clang compiles the kernels, its vectorizer's
  cap (backend/cpu/compiler.py), unless backend/compat.py says they stay off."""
  batch_compile.install()  # a schedule's CPU kernels compiled by one clang process (before programs: it saves their binaries)
  programs.install()  # kernels lowered by other processes (TG_DS4_PROGRAM_CACHE=1)
  store_hazard.install()  # the scheduler's per-store hazard checks without a walk of the whole graph each
  compat.per_thread_compile_cache()  # serve compiles in its worker thread
  if Device.canonicalize(device).startswith("PYTHON"): emulator.install(device)  # the GPU emulator on whole-grid arrays
  if compat.derived_variables_on(): compat.install_derived_variables()  # decode attention's chunk counts (nn/mla.py)
  ren = Device[device].renderer
  cpu, gpu = getattr(ren, "has_threads", False), ren.has_local and ren.has_shared  # (NULL's generic renderer is neither)
  if (cpu or gpu) and compat.kernel_opts_on():
    from tg_ds4.backend.cpu import kernel_opts  # CPU GEMVs keep their lane accumulators without a row upcast (see kernel_opts)
    kernel_opts.install()
  if cpu and compat.kernel_opts_on() and isinstance(ren.compiler, compat.ClangCompiler):
    from tg_ds4.backend.cpu import compiler  # a batched GEMV's accumulators vectorized per row (see compiler.py)
    compiler.add_flags(ren.compiler)

def replay(captured: CapturedJit, device: str | None) -> CapturedJit:
  """How a captured step is replayed on `device`: natively on the CPU (backend/cpu/replay.py), else as tinygrad does."""
  if not on_cpu(device) or not compat.fast_replay_on(): return captured
  from tg_ds4.backend.cpu import replay as cpu_replay
  return cpu_replay.fast(captured)
