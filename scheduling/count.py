"""Kernels and bytes per block kind for one decode token and one prefill chunk, for the backend that DEV names.

  DEV=<target> python scheduling/count.py FILE.gguf ... [--json] [--steps decode|prefill|decode,prefill] [--kernels-only]

Targets: CPU (the machine's own, kernels run on empty inputs), NULL (scheduled and lowered by tinygrad's generic C
renderer, nothing runs) and NULL-device targets that lower for a GPU without one: NULL:CUDA:sm_90 (NVRTC from NVIDIA's
PyPI wheel), NULL:METAL (rendered; a stand-in compiler off macOS), NULL::gfx1100 (AMD), NULL:OPENCL, NULL:WGSL
(WebGPU). compat.lowering_target prepares the GPU ones; scheduling/budgets.toml holds the budgets per backend.

On a GPU renderer each block kind also counts its kernels with a poor launch shape ("launch", see launch_flaws): a
reduction over more than REDUCE_WIDE values given fewer than REDUCE_THREADS threads per output, or fewer threads
than a kernel's outputs over OUTPUTS_PER_THREAD. Their budgets, CUDA's, fall as GPU kernels improve.

--kernels-only schedules and lowers nothing: how many kernels a step takes is the scheduler's choice, made before
any lowering, so the counts are the scheduled calls, the same that running them counts. The bytes read come from the
lowered kernels (an upcast GEMV reads x once per tile of rows, the plain kernel once per row), so none are reported. A
GPU renderer's kernels must render: its counts lower them."""
import argparse, json, os, sys

from tg_ds4.backend import compat

BACKENDS = {"CPU": "CPU", "NULL": "NULL", "NULL:CUDA:sm_90": "CUDA", "NULL:METAL": "METAL", "NULL::gfx1100": "AMD",
            "NULL:OPENCL": "OPENCL", "NULL:WGSL": "WEBGPU"}
DEV = os.environ.get("DEV", "CPU")
compat.lowering_target(DEV)  # before tinygrad opens the device

from tinygrad import Context, Device, GlobalCounters, Tensor, UOp, dtypes  # noqa: E402

from tg_ds4.backend.compat import PARALLEL, AxisType, Ops, prod  # noqa: E402
from tg_ds4.models.deepseek4 import DS4Transformer  # noqa: E402
from tg_ds4.models.families import Model  # noqa: E402
from tg_ds4.nn.layers import packed_weights  # noqa: E402
from tg_ds4.quant.formats import QTensor  # noqa: E402
from tg_ds4.runtime.runner import Runner  # noqa: E402
from tg_ds4.runtime.sampling import greedy  # noqa: E402

def _packed_bytes(obj) -> int:
  """Packed bytes of every weight below a block (what one decode step must read at least once)."""
  return obj.nbytes if isinstance(obj, QTensor) else sum(w.nbytes for _, _, w in packed_weights(obj))

def block_kind(model: Model, i: int) -> str:
  cfg, b = model.cfg, model.blk[i]
  if isinstance(model, DS4Transformer):  # attention by compression ratio (window / ratio 4 + indexer / ratio 128), routing by hash or top-k
    return f"DS4 {dict([(0, 'SWA'), (4, 'CSA'), (128, 'HCA')])[cfg.compress_ratios[i]]} {'hash-MoE' if i < cfg.n_hash_layer else 'MoE'}"
  return f"{'MLA' if cfg.mla else 'GQA'} {'MoE' if cfg.is_moe_layer(i) else 'dense'}" + \
    (" sandwich" if cfg.sandwich_norm else "") + (" V-norm" if cfg.v_norm else "") + (" SWA" if b.swa else "") + \
    (" layernorm" if cfg.layer_norm else "") + (" sub-norm" if cfg.sub_norm else "") + (" PLE" if cfg.per_layer_dim else "") + \
    (" shared-KV" if getattr(b.attn, "kv_from", None) is not None else "") + \
    ((" DSA" if b.attn.indexer is not None else " DSA-shared") if cfg.idx_top_k else "")  # gemma, gpt2, bitnet, gemma4, DSA

REDUCE_WIDE, REDUCE_THREADS, OUTPUTS_PER_THREAD = 1024, 32, 16

def _vmax(x) -> int: return x if isinstance(x, int) else int(x.vmax)

def _summed(u: UOp) -> int:
  """Values a REDUCE sums per output, with those of a REDUCE nested in it (one whose value varies with its ranges: the
  lanes GEMV's per-lane partial sums), not of one it merely reads (softmax's max under its sum)."""
  own = [r for r in u.src[1:] if r.op is Ops.RANGE]
  inner = [v for v in u.src[0].toposort() if v.op is Ops.REDUCE and any(r in v.backward_slice for r in own)]
  return prod(_vmax(r.src[0]) for r in own) * max((_summed(v) for v in inner), default=1)

def launch_flaws(ast: UOp, info) -> list[str]:
  """What is wrong with the launch of the kernel `ast` (before opts) as lowered (ProgramInfo `info`) for a GPU: its
  widest reduction (the values one REDUCE sums per output) over more than REDUCE_WIDE values with fewer than
  REDUCE_THREADS threads per output (a norm or softmax row summed by one thread), or more outputs than its threads
  times OUTPUTS_PER_THREAD (outputs computed in a loop). Symbolic sizes at their maximum."""
  outputs = prod(_vmax(r.src[0]) for r in ast.toposort() if r.op is Ops.RANGE and r.arg[-1] is not AxisType.REDUCE)
  wide = max((_summed(u) for u in ast.toposort() if u.op is Ops.REDUCE), default=1)
  threads = prod(_vmax(g) for g in info.global_size) * prod(_vmax(g) for g in (info.local_size or (1,)))
  return (["narrow reduction"] if wide > REDUCE_WIDE and threads < REDUCE_THREADS * outputs else []) + \
    (["outputs in a loop"] if threads * OUTPUTS_PER_THREAD < outputs else [])

GPU = not getattr(Device[Device.DEFAULT].renderer, "has_threads", False) and Device[Device.DEFAULT].renderer.has_local
_flawed: list[int] = [0]  # kernels with launch flaws since the last reset (GPU renderers, lowering)

def realize(lower: bool, *ts: Tensor) -> None:
  """Tensor.realize, or without `lower` (--kernels-only) the schedule only: the tensors then stand for their unwritten
  buffers, as after a realize, and GlobalCounters.kernel_count grows by the calls that running them would count. On a
  GPU renderer the lowered kernels' launches are checked (launch_flaws)."""
  if not ts or not (todo := [t for t in ts if not t.uop.is_virtual and not t.uop.has_buffer_identity()]): return
  linear, var_vals = Tensor.linear_with_vars(*todo)
  if not lower:
    GlobalCounters.kernel_count += sum(len(compat.realize.get_call_kernels(c)) for c in linear.src)
    return
  if GPU:
    lowered = compat.realize.compile_linear(linear)
    assert len(lowered.src) == len(linear.src)
    for c, lc in zip(linear.src, lowered.src):
      if c.src[0].op is Ops.SINK and lc.src[0].op is Ops.PROGRAM: _flawed[0] += bool(launch_flaws(c.src[0], lc.src[0].arg))
    linear = lowered  # (run_linear finds nothing left to lower in it)
  compat.realize.run_linear(linear, var_vals)

def counts(model: Model, T: int, lower: bool = True) -> dict[str, dict[str, float]]:
  """{block kind: {kernels, bytes, packed}} for T tokens at position 7 (T=1: a decode step; else a prefill chunk), plus
  the head (with greedy sampling for a decode step); without `lower`, the steps are scheduled only (bytes None)."""
  cfg, out, pos = model.cfg, {}, UOp.variable("start_pos", 0, model.max_ctx - 1).bind(7)
  ds4 = isinstance(model, DS4Transformer)  # hyper-connection streams in, token ids for hash routing
  tokens = UOp.variable("token", 0, cfg.n_vocab - 1).bind(1) if T == 1 else Tensor.zeros(1, T, dtype=dtypes.int32).contiguous().realize()
  kvs: dict = {}  # gemma4: the caches a shared-KV block reads, written by its source block beforehand (not counted)
  pl = Tensor.empty(1, T, cfg.per_layer_dim).realize() if not ds4 and cfg.per_layer_dim else None
  for i, b in enumerate(model.blk):
    if (kind := block_kind(model, i)) in out: continue
    x = Tensor.empty(1, T, *((cfg.hc,) if ds4 else ()), cfg.dim).realize()
    if (src := getattr(b.attn, "kv_from", None)) is not None and src not in kvs:
      s = model.blk[src]
      realize(lower, s(x, pos, model.rope_swa if s.swa else model.rope, kvs, pl))
      realize(lower, kvs[src])
    if not ds4 and cfg.idx_top_k and b.attn.indexer is None:  # a shared DSA layer: its source's selection
      realize(lower, *kvs.get("dsa", {}).values())
    GlobalCounters.reset(); _flawed[0] = 0
    realize(lower, b(x, tokens, pos, model.tabs) if ds4 else b(x, pos, model.rope_swa if b.swa else model.rope, kvs, pl))
    out[kind] = {"kernels": GlobalCounters.kernel_count, "bytes": GlobalCounters.global_mem if lower else None, "packed": _packed_bytes(b),
                 "launch": _flawed[0] if lower and GPU else None}
  x = Tensor.empty(1, T, *((cfg.hc,) if ds4 else ()), cfg.dim).realize()
  GlobalCounters.reset(); _flawed[0] = 0
  logits = model.output(model.output_norm(model.output_hc.head(x) if ds4 else x))
  realize(lower, greedy(logits[:, -1]) if T == 1 else logits)
  out["head+sampling" if T == 1 else "head"] = {"kernels": GlobalCounters.kernel_count, "bytes": GlobalCounters.global_mem if lower else None,
                                                "packed": _packed_bytes(model.output), "launch": _flawed[0] if lower and GPU else None}
  return out

def file_counts(path: str, steps: list[str], with_bytes: bool = True) -> dict:
  model = Runner.load(path, max_ctx=64).model
  res = {"decode": counts(model, 1, with_bytes)} if "decode" in steps else {}
  if "prefill" in steps: res.update(prefill=counts(model, model.PREFILL_CHUNKS[0], with_bytes), prefill_tokens=model.PREFILL_CHUNKS[0])
  return res

if __name__ == "__main__":
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("files", nargs="+")
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--steps", default="decode,prefill", help="decode, prefill or both (default)")
  ap.add_argument("--kernels-only", action="store_true", help="counts only, scheduled and not lowered (no bytes: they come from the lowered kernels)")
  args = ap.parse_args()
  if (backend := BACKENDS.get(DEV)) is None: sys.exit(f"DEV={DEV}: count.py knows {', '.join(BACKENDS)}")
  # compile in this process: a stand-in compiler (compat.lowering_target) exists only here, not in tinygrad's workers
  res, failed = {"backend": backend, "device": Device.DEFAULT, "files": {}}, []
  with Context(PARALLEL=0 if backend == "METAL" else PARALLEL.value):
    for p in args.files:
      try: res["files"][p] = file_counts(p, args.steps.split(","), not args.kernels_only)
      except Exception as e:  # noqa: BLE001  (a renderer that cannot express a kernel: one line, the other files go on)
        failed.append(f"{p}: {backend} cannot lower it: {type(e).__name__}: {e} ({type(Device[Device.DEFAULT].renderer).__name__})")
  if args.json: print(json.dumps(res))
  else:
    for p, r in res["files"].items():
      print(f"{p} ({backend})")
      for step in ("decode", "prefill"):
        for k, v in r.get(step, {}).items():
          read = "" if v["bytes"] is None else f"  {v['bytes'] / max(v['packed'], 1):.3f}x packed bytes"
          flaws = "" if v["launch"] is None else f"  {v['launch']} with a poor launch shape"
          print(f"  {step:<8}{k:<24} {v['kernels']:>3} kernels{read}{flaws}")
  if failed: sys.exit("\n".join(failed))
