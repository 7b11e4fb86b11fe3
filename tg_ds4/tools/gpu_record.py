"""Records what a checkout of tg_ds4 launches when its steps are lowered for an NVIDIA GPU, without a GPU: run as a
script, it runs that checkout's own `profile` command on tinygrad's NULL device with the CUDA renderer
(`NULL:CUDA:sm_90`: scheduled, lowered and compiled by NVRTC, nothing executed) and writes, for every kernel launch
of the profiled steps, what the GPU cost model needs: launch dimensions, the per-thread loop structure, the bytes each
kernel reads and writes from its lowered index expressions, FLOPs, and which buffers are the model's weights.

    python tg_ds4/tools/gpu_record.py OUT.json [CHECKOUT] -- profile -m FILE [--prefill] [--parallel N]

This file runs beside whichever checkout is on sys.path (an older commit's included), so it imports no tg_ds4 module
by name: tinygrad's internals come from this checkout's seam, backend/compat.py (which imports nothing of tg_ds4),
loaded from its path. It hooks tinygrad's runtime lookup, its parameter resolution and the captured JIT's replay, and
the checkout's profile module's `named_buffers`, which old and new checkouts have.

Bytes are a footprint, not a count of load instructions: a load's distinct addresses are bounded by the product of
the sizes of the loops and thread indices its index expression depends on (through loaded values too: a gathered
expert's rows depend on the expert slot's range, not on the whole tensor), capped at the buffer's size. A value
re-read by every thread (the GEMV's input vector) counts once, as the caches serve it."""
from __future__ import annotations

import os, sys

if __name__ == "__main__":  # run as a script: its folder (tools/, with an inspect.py) must not shadow the standard library
  sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import contextlib, importlib, importlib.metadata, importlib.util, io, itertools, json, math, pathlib, re, runpy  # noqa: E402

UNROLLED = 16  # constant loop trips NVRTC unrolls fully (innermost loops only)
# What a thread's instructions cost in issue slots (an SM issues 4 x 32 lanes a clock, one warp instruction per scheduler):
# every instruction takes one, and each pipe has its own rate, so a kernel takes the busier of its issue and its
# busiest pipe, in FP32 lanes: NVIDIA's throughput table for compute capability 9.0 (CUDA C Programming Guide,
# "Arithmetic Instructions": FP32 add, multiply, multiply-add 128 results a clock an SM; 32-bit integer add, logic,
# shift, compare 64; type conversions and the special functions (exp2, log2, sin, rsqrt, reciprocal) 16) and the 32
# LD/ST units of a Hopper SM (H100 architecture whitepaper), which take a warp's load or store of any width.
PIPES = {"fp32": 1, "int": 2, "xu": 8, "lsu": 4}  # issue slots a lane's instruction takes of its pipe
ANSI = re.compile(r"\x1b\[[0-9;]*m")

def nvrtc_path() -> None:
  """tinygrad's CUDA compiler is NVRTC: NVIDIA's PyPI wheel (nvidia-cuda-nvrtc-cu12) holds it, found through
  NVRTC_PATH (tinygrad's own override) when the loader does not."""
  if os.environ.get("NVRTC_PATH"): return
  if (spec := importlib.util.find_spec("nvidia.cuda_nvrtc")) is not None and spec.submodule_search_locations:
    libs = sorted(pathlib.Path(next(iter(spec.submodule_search_locations)), "lib").glob("libnvrtc.so*"))
    if libs: os.environ["NVRTC_PATH"] = str(min(libs, key=lambda p: len(p.name)))

def _alu():
  """Integer index arithmetic as Python evaluates it (the ops a lowered index expression is made of)."""
  Ops = seam().Ops
  return {Ops.ADD: lambda a, b: a + b, Ops.MUL: lambda a, b: a * b, Ops.CDIV: lambda a, b: int(a / b) if b else 0,
          Ops.CMOD: lambda a, b: a - b * int(a / b) if b else 0, Ops.FLOORDIV: lambda a, b: a // b if b else 0,
          Ops.FLOORMOD: lambda a, b: a % b if b else 0, Ops.SHL: lambda a, b: a << b, Ops.SHR: lambda a, b: a >> b,
          Ops.AND: lambda a, b: a & b, Ops.OR: lambda a, b: a | b, Ops.XOR: lambda a, b: a ^ b, Ops.MAX: max, Ops.NEG: lambda a: -a,
          Ops.CMPLT: lambda a, b: a < b, Ops.CMPNE: lambda a, b: a != b, Ops.CMPEQ: lambda a, b: a == b,
          Ops.WHERE: lambda c, a, b: a if c else b, Ops.CAST: lambda a: int(a), Ops.SUB: lambda a, b: a - b}

def seam():
  """This checkout's backend/compat.py, loaded from its path under a name of its own."""
  if (m := sys.modules.get("_gpu_record_compat")) is None:
    spec = importlib.util.spec_from_file_location("_gpu_record_compat", pathlib.Path(__file__).resolve().parents[1] / "backend" / "compat.py")
    m = sys.modules["_gpu_record_compat"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
  return m

def features(prg, vals: tuple, weight_slots: frozenset, buf_bytes: dict) -> dict:
  """The cost model's inputs for one launch of the PROGRAM `prg` with variable values `vals`: `weight_slots` are the
  parameter slots bound to model weights (read from DRAM each step), `buf_bytes` each slot's buffer size."""
  from tinygrad import dtypes
  c = seam()
  GroupOp, Ops, sym_infer = c.GroupOp, c.Ops, c.sym_infer
  info, lin = prg.arg, prg.src[1].src
  var_vals = {v.expr: x for v, x in zip(info.vars, vals) if x is not None}
  def ev(x) -> int: return int(sym_infer(x, var_vals)) if not isinstance(x, int) else x
  trip: dict = {}
  for u in lin:
    if u.op in (Ops.RANGE, Ops.SPECIAL): trip[u] = max(ev(u.src[0]), 1)
  def param_of(idx):
    b = idx.src[0]
    while b.op is not Ops.PARAM and len(b.src): b = b.src[0]
    return b if b.op is Ops.PARAM else None
  # a loop of a few constant iterations with no loop inside is unrolled by the compiler (NVRTC at -O3): its loads are
  # issued with its parent's, so it adds no round trips of its own
  ends = {s: i for i, u in enumerate(lin) if u.op is Ops.END for s in u.src if s.op is Ops.RANGE}
  unrolled = {u for i, u in enumerate(lin) if u.op is Ops.RANGE and u.src[0].vmin == u.src[0].vmax
              and trip[u] <= UNROLLED and not any(v.op is Ops.RANGE for v in lin[i + 1:ends.get(u, i + 1)])}
  # an instruction runs once per iteration of the loops it depends on, down to the innermost: the compiler hoists what
  # an inner loop does not change (the row's scale, a norm's reciprocal) out of it
  loops: dict = {}  # uop -> the RANGEs its value depends on
  opened: list = []  # open RANGEs, outermost first (unrolled ones too)
  rounds = {"dram": 0, "l2": 0, "smem": 0, "alu": 0}  # per-thread loop iterations, by what the loop body waits on
  RANK = {None: 0, "alu": 0, "smem": 1, "l2": 2, "dram": 3}  # a body waits on the slowest memory it loads from
  body: dict = {}   # real loop -> the memory its body's loads come from ("dram" beats "l2" beats nothing)
  footprint: dict = {}  # (slot, load|store) -> bytes
  flops = tc_flops = barriers = insts = transactions = 0  # transactions: 32-byte sectors a warp's accesses touch
  straight = [None]  # what the code outside every loop (or hoisted out of them) loads
  waits: dict = {}  # real loop -> the largest share of its iterations that a load in it waits in (a gated load: its gate's)
  def wait(u, kind: str, share: float = 1.0) -> None:
    """A load makes the innermost real loop it depends on wait (or the code before the loops)."""
    real = [r for r in opened[:depth(u)] if r not in unrolled]
    if real: body[real[-1]], waits[real[-1]] = max(body[real[-1]], kind, key=RANK.get), max(waits.get(real[-1], 0.0), share)
    else: straight[0] = max(straight[0], kind, key=RANK.get)
  ALU = _alu()
  gated = {u: u.src[2] for u in lin if u.op is Ops.LOAD and len(u.src) == 3}  # LOAD(address, value if not, gate)
  def valid(gate) -> float:
    """The share of a gated load's executions whose gate holds (a ternary on a load reads memory only when it holds: a
    decode row's attention over its whole slot reads the rows up to its position). 1 when too many to count."""
    order = list(gate.toposort(lambda x: x.op is not Ops.LOAD))
    leaves = [v for v in order if v.op in (Ops.RANGE, Ops.SPECIAL)]
    if not leaves or math.prod(trip[v] for v in leaves) > 1 << 16: return 1.0
    fixed, hold = {v: var_vals.get(v.expr, 0) for v in order if v.op is Ops.PARAM and v.addrspace is c.AddrSpace.ALU}, 0
    for combo in itertools.product(*(range(trip[v]) for v in leaves)):
      val = {**fixed, **dict(zip(leaves, combo))}
      for v in order:
        if v not in val: val[v] = v.arg if v.op is Ops.CONST else ALU[v.op](*(val.get(x, 0) for x in v.src)) if v.op in ALU else 0
      hold += bool(val[gate])
    return hold / math.prod(trip[v] for v in leaves)
  locals_ = sorted((u for u in lin if u.op is Ops.SPECIAL and u.arg.startswith("lidx")), key=lambda u: u.arg)
  def sectors(index, item: int, nbytes: int) -> int:
    """32-byte sectors one warp's load or store touches (its first warp, first iteration): a warp whose lanes read
    addresses far apart takes a memory transaction per lane where adjacent lanes share one. Recorded beside each GPU
    measurement (profiles/gpu/), not yet a bound of the model: no measurement has told its cost apart."""
    order = list(index.toposort(lambda x: x.op is not Ops.LOAD))
    fixed = {v: var_vals.get(v.expr, 0) for v in order if v.op is Ops.PARAM and v.addrspace is c.AddrSpace.ALU}
    lanes, seen = min(32, math.prod(trip[u] for u in locals_)), set()
    for t in range(lanes):
      val, rest = dict(fixed), t
      for u in locals_: val[u], rest = rest % trip[u], rest // trip[u]
      for v in order:  # everything else at its first value: blocks, loop counters and loaded indices at 0
        if v not in val: val[v] = v.arg if v.op is Ops.CONST else ALU[v.op](*(val.get(x, 0) for x in v.src)) if v.op in ALU else 0
      a = int(val[index]) * item
      seen.update(range(a // 32, (a + nbytes - 1) // 32 + 1))
    return len(seen)
  def spans(d, index) -> int:
    """The distinct values loop or thread index `d` gives `index`: its trip count, or where the index reads it only as
    `d % m` (tinygrad merges adjacent loops into one: a block's 64 bytes read inside a 256-value loop) m of them, or only
    as `d // q` its trip over q."""
    n, users = trip.get(d, 1), [v for v in index.toposort() if d in v.src]
    def only(*ops) -> bool: return bool(users) and all(v.op in ops and v.src[0] is d and v.src[1].op is Ops.CONST for v in users)
    if only(Ops.CMOD, Ops.FLOORMOD): return min(n, max(v.src[1].arg for v in users))  # (non-negative indices: C and floor agree)
    if only(Ops.CDIV, Ops.FLOORDIV): return -(-n // min(v.src[1].arg for v in users))
    return n
  def depth(u) -> int: return max((i + 1 for i, r in enumerate(opened) if r in loops[u]), default=0)
  users: dict = {}
  for u in lin:
    for s_ in u.src: users.setdefault(s_, []).append(u)
  BITWISE, SPECIAL = (Ops.AND, Ops.OR, Ops.XOR), (Ops.EXP2, Ops.LOG2, Ops.SIN, Ops.SQRT, Ops.RECIPROCAL)
  def bare(v):  # through casts between integer widths (register moves): the constant or the op they carry
    while v.op is Ops.CAST and not dtypes.is_float(v.dtype) and not dtypes.is_float(v.src[0].dtype): v = v.src[0]
    return v
  def once(v, *ops) -> bool: return (v := bare(v)).op in ops and len(users.get(v, ())) == 1
  def pipe(u) -> tuple[str | None, int]:
    """The pipe of `u` as NVRTC compiles it, and how many instructions: a load or store is one whatever its width (and
    none from registers); casts between integer widths and bitcasts are register moves (the loads extend); a float add
    of a product used once is the FMA's; a bitwise op of another used once is one LOP3; an integer constant added or
    multiplied into an address only is the load's immediate offset."""
    if u.op in (Ops.LOAD, Ops.STORE): return (None, 0) if getattr(u.src[0], "addrspace", None) is c.AddrSpace.REG else ("lsu", 1)
    if u.op in (Ops.BARRIER, Ops.WMMA): return "fp32", 1
    if u.op is Ops.BITCAST or u.op not in (*GroupOp.ALU, Ops.CAST): return None, 0
    n = ev(u.max_numel())
    if u.op is Ops.CAST: return ("xu", n) if dtypes.is_float(u.dtype) or dtypes.is_float(u.src[0].dtype) else (None, 0)
    if dtypes.is_float(u.dtype) or (u.src and dtypes.is_float(u.src[0].dtype)):  # float math and float compares
      if u.op in SPECIAL: return "xu", n
      if u.op is Ops.ADD and any(once(v, Ops.MUL) and dtypes.is_float(v.dtype) for v in u.src): return None, 0
      return "fp32", n
    if u.op in (Ops.ADD, Ops.MUL) and any(bare(v).op is Ops.CONST for v in u.src) and users.get(u) and all(v.op is Ops.INDEX for v in users[u]):
      return None, 0
    if u.op in BITWISE and any(once(v, *BITWISE) for v in u.src): return None, 0
    return "int", n
  pipes = dict.fromkeys(PIPES, 0)
  def runs(u) -> int: return math.prod(trip[r] for r in opened[:depth(u)])
  for u in lin:
    loops[u] = set().union(*(loops.get(s, ()) for s in u.src)) | ({u} if u.op is Ops.RANGE else set())
    if u.op is Ops.RANGE:
      opened.append(u); body[u] = None
      continue
    if u.op is Ops.END:
      if (r := next((s for s in u.src if s.op is Ops.RANGE), None)) is not None and r in opened:
        if r not in unrolled:
          n, w = math.prod(trip[o] for o in opened[:opened.index(r) + 1]), waits.get(r, 1.0) if body[r] else 0.0
          rounds[body[r] or "alu"] += round(n * w)
          rounds["alu"] += n - round(n * w)  # the iterations whose gated loads read nothing
        opened.remove(r)
      continue
    if (p_ := pipe(u))[1]: insts, pipes[p_[0]] = insts + runs(u) * p_[1], pipes[p_[0]] + runs(u) * p_[1]
    if u.op is Ops.BARRIER: barriers += runs(u)
    elif u.op is Ops.WMMA: tc_flops += 2 * math.prod(u.arg[0]) // u.arg[3] * runs(u)
    elif u.op in GroupOp.ALU and dtypes.is_float(u.dtype): flops += runs(u) * ev(u.max_numel()) * (2 if u.op is Ops.MULACC else 1)
    if u.op not in (Ops.LOAD, Ops.STORE): continue
    idx = u.src[0].src[0] if u.src[0].op is Ops.CAST else u.src[0]
    if u.op is Ops.LOAD and getattr(u.src[0], "addrspace", None) is c.AddrSpace.LOCAL: wait(u, "smem")
    if idx.op not in (Ops.INDEX, Ops.SHRINK) or (p := param_of(idx)) is None: continue  # registers, shared memory (SHRINK: a vector)
    slot = p.arg.slot
    deps = [v for v in idx.src[1].toposort() if v.op in (Ops.RANGE, Ops.SPECIAL)] if len(idx.src) > 1 else []
    v = u if u.op is Ops.LOAD else u.src[1]
    size = ev(v.max_numel()) * v.dtype.itemsize
    key = (slot, u.op.name.lower())
    if len(idx.src) > 1: transactions += runs(u) * sectors(idx.src[1], v.dtype.itemsize, size)
    share = valid(gated[u]) if u in gated else 1.0
    footprint[key] = min(footprint.get(key, 0) + int(math.prod(spans(d, idx.src[1]) for d in deps) * size * share), buf_bytes.get(slot, 1 << 62))
    if u.op is Ops.LOAD: wait(u, "dram" if slot in weight_slots else "l2", share)
  rounds[straight[0] if straight[0] in ("dram", "l2") else "l2"] += 1  # the code outside the loops: one round trip to memory at least
  slots = max(insts, *(PIPES[p] * n for p, n in pipes.items()))
  return {"rounds": rounds, "barriers": barriers, "instructions": slots, "pipes": {"issue": insts, **pipes}, "sectors": transactions,
          "flops": flops, "tc_flops": tc_flops,
          "bytes": {f"{s}:{k}": b for (s, k), b in footprint.items()}}

class Recorder:
  """Hooks tinygrad's launches: every kernel the runtime is asked to run is recorded with its features, in segments
  that each start where a captured JIT replays."""
  def __init__(self):
    self.segments: list[list[dict]] = [[]]
    self.names: dict = {}     # Buffer -> tensor name (from the checkout's profile.named_buffers)
    self._resolved: list = []
    self._cache: dict = {}

  def install(self) -> None:
    jit, realize = seam().tinygrad_jit, seam().realize
    rec = self
    orig_runtime, orig_resolve, orig_call = realize.get_runtime, realize.resolve_params, jit.CapturedJit.__call__
    def resolve_params(call, inputs):
      rec._resolved = orig_resolve(call, inputs)
      return rec._resolved
    class Launch:
      def __init__(self, rt, prg): self.rt, self.prg = rt, prg
      def __call__(self, *bufs, global_size=(1, 1, 1), local_size=(1, 1, 1), vals=(), **kw):
        rec.launch(self.prg, tuple(global_size), tuple(local_size or (1, 1, 1)), tuple(vals))
        return self.rt(*bufs, global_size=global_size, local_size=local_size, vals=vals, **kw)
    def get_runtime(device, ast, cache=True): return Launch(orig_runtime(device, ast, cache), ast)
    def replay(self_jit, *a, **kw):
      rec.segments.append([])
      return orig_call(self_jit, *a, **kw)
    realize.get_runtime, realize.resolve_params, jit.CapturedJit.__call__ = get_runtime, resolve_params, replay
    # no graph batching: every kernel is launched (and recorded) on its own, as the profile's replays launch them
    jit.graph_split_rewrite = lambda linear, max_batch_size=0: linear

  def watch_names(self) -> None:
    """Wrap the checkout's profile.named_buffers (tg_ds4.tools.profile, or tg_ds4.profile in older layouts) to learn
    which buffers are weights and caches."""
    for mod in ("tg_ds4.tools.profile", "tg_ds4.profile"):
      try: m = importlib.import_module(mod)
      except ImportError: continue
      orig = m.named_buffers
      def named_buffers(obj, _orig=orig):
        self.names = _orig(obj)
        return self.names
      m.named_buffers = named_buffers
      return

  def _name(self, b) -> str | None: return self.names.get(b) or self.names.get(getattr(b, "_base", None))

  def launch(self, prg, gs: tuple, ls: tuple, vals: tuple) -> None:
    info = prg.arg
    bufs = [getattr(self._resolved[g], "buffer", None) if g < len(self._resolved) else None for g in info.globals]
    names = [self._name(b) if b is not None else None for b in bufs]
    slots = list(info.globals)
    weight = frozenset(s for s, n in zip(slots, names) if n and n.endswith((".weight", ".bias")))  # GGUF tensor names
    nbytes = {s: b.nbytes for s, b in zip(slots, bufs) if b is not None}
    key = (prg.key, vals, weight, tuple(sorted(nbytes.items())))
    if (f := self._cache.get(key)) is None: f = self._cache[key] = features(prg, vals, weight, nbytes)
    self.segments[-1].append({"name": ANSI.sub("", info.name), "global": list(gs), "local": list(ls), **f,
                              "buffers": {str(s): n for s, n in zip(slots, names) if n}})

def main(argv: list[str]) -> int:
  if "--" not in argv or len(argv[:argv.index("--")]) not in (1, 2):
    print(__doc__.splitlines()[6].strip(), file=sys.stderr); return 2
  out, checkout = (argv[:argv.index("--")] + [None])[:2]
  if checkout: sys.path.insert(0, str(pathlib.Path(checkout).resolve()))
  nvrtc_path()
  seam().lowering_target("NULL:CUDA:sm_90")  # as a GPU lowers: no TF32 tensor cores for float32 inputs
  os.environ["NULL_ALLOW_COPYOUT"] = "1"  # the checkout reads tokens back: NULL gives it zeros
  if not seam().internals_match():
    print(f"gpu_record: written for tinygrad {seam().TINYGRAD}, found {importlib.metadata.version('tinygrad')}", file=sys.stderr); return 2
  rec = Recorder(); rec.install(); rec.watch_names()
  sys.argv = ["tg_ds4", *argv[argv.index("--") + 1:]]
  stdout, code = io.StringIO(), 0
  try:
    with contextlib.redirect_stdout(stdout): runpy.run_module("tg_ds4", run_name="__main__")
  except SystemExit as e: code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  if code: print(stdout.getvalue(), file=sys.stderr); return code
  text = stdout.getvalue()
  profile = json.loads(text[text.index("{"):])
  steps = {}
  for step in ("decode", "prefill"):
    if step not in profile: continue
    # the profile lists the step's copies (a prompt chunk's token ids) too: they launch no kernel
    timed = [p for p in profile[step]["kernels"] if not p["name"].startswith(("copy ", "enc/dec"))]
    seg = next((s for s in reversed(rec.segments) if [k["name"] for k in s] == [p["name"] for p in timed]), None)
    if seg is None: print(f"gpu_record: no replay of the {step} step matches its profile", file=sys.stderr); return 1
    for k, p in zip(seg, timed): k.update(block=p["block"], op=p["op"], reads=p.get("reads", []))
    steps[step] = {"position": profile[step]["position"], "tokens": profile[step]["tokens"], "kernels": seg}
  pathlib.Path(out).write_text(json.dumps({"tinygrad": seam().TINYGRAD, "renderer": "CUDA sm_90", "steps": steps}))
  return 0

if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
