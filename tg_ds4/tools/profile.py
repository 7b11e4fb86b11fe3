"""`tg_ds4 profile`: one decode step (and optionally one prefill chunk) timed kernel by kernel, each kernel attributed
to its block and to an op (attn q, scores, softmax, experts, ...), written as CSV, JSON and a PNG chart.

The step is the same capture (tg_ds4.runtime.jit.Jit) the engine replays, captured without graph batching so each kernel is its own
launch, then replayed with synchronous per-kernel timing (through tinygrad's executor: a kernel split over cores runs
its parts one after another, so the times are one core's; the wall time is the engine's multi-core replay). tinygrad
does not carry tensor provenance into kernels, so a kernel is attributed by the buffers it reads: module attributes
are GGUF tensor names, so a kernel reading
`blk.3.ffn_up_exps.weight` is layer 3's experts. Kernels that read no weight (softmax, top-k, norm statistics, argmax)
take the op implied by their place in the block: after the attention scores and before attn.v is softmax, between
the router and the experts is top-k, after the head is sampling; a lone square-root reduce is a norm."""
from __future__ import annotations

import contextlib, csv, io, json, pathlib, re, statistics, time
from collections import defaultdict

from tinygrad import Context, Device, Tensor, UOp, dtypes

from tg_ds4.backend.compat import Ops, realize, sym_infer
from tg_ds4.nn.cache_rows import Rows
from tg_ds4.nn.layers import named_tensors
from tg_ds4.runtime.jit import Jit
from tg_ds4.runtime.sampling import greedy

# (pattern on the tensor name, op); the first op in this list that any read buffer maps to wins, so a kernel that
# fuses a norm's weight into a matmul counts as the matmul, and an expert GEMV that reads its ids through a hash table
# (V4's first layers, `ffn_gate_tid2eid`) counts as experts
OPS = [(r"attn_(q|qk|q_kv|q_a|q_b|q_a_norm|q_norm)\.", "attn q"), (r"attn_(kv_a_mqa|kv_a_norm|k|v|k_norm|kv|kv_a)\.", "attn kv"),
       (r"attn_(k_b|v_b)\.", "absorb"), (r"attn_output(_a|_b)?\.", "attn out"), (r"indexer", "indexer"), (r"compress", "compressor"),
       (r"_exps\.", "experts"), (r"ffn_gate_inp|exp_probs_b|ffn_gate_tid2eid", "router"), (r"_shexp\.", "shared expert"),
       (r"ffn_(gate|up|down|gate_up)\.", "ffn"), (r"^output\.", "head"), (r"hc_", "hyper-conn"), (r"sinks", "softmax"),
       (r"cache", "cache"), (r"norm", "norm"), (r"token_embd", "embed")]
RANK = {op: i for i, (_, op) in enumerate(OPS)}
CATEGORIES = ["embed", "norm", "attn q", "attn kv", "absorb", "scores", "softmax", "attn·v", "attention", "attn out", "indexer", "compressor",
              "hyper-conn", "router", "top-k", "experts", "shared expert", "ffn", "head", "sampling", "other"]

def named_buffers(obj) -> dict:
  """{Buffer: GGUF-style name} for every weight and state tensor below `obj` (caches included); a buffer several tensors
  view (a fused weight and its parts) gets the last name."""
  out = {}
  for name, t in named_tensors(obj):
    with contextlib.suppress(Exception): out[t.uop.buffer] = name  # unrealized (lazy) tensors have no buffer yet
  return out

def _op_of(name: str) -> str | None: return next((op for pat, op in OPS if re.search(pat, name)), None)

def _block_of(name: str) -> str:
  if m := re.match(r"blk\.(\d+)\.", name): return f"blk.{m.group(1)}"
  return "head" if name.startswith("output") else "embed" if name.startswith("token_embd") else "other"

def attribute(kernels: list[dict]) -> None:
  """Fill `block` and `op` of each kernel dict (which has `reads`: tensor names, `name`, `sqrt`, `exp`), in step order."""
  labelled = []
  for k in kernels:
    ops = sorted({o for n in k["reads"] if (o := _op_of(n))}, key=RANK.get)
    k["op"] = ops[0] if ops else None
    k["block"] = next((_block_of(n) for n in k["reads"] if _op_of(n) == k["op"]), None) if ops else None
    if k["op"] == "embed" and any(_op_of(n) != "embed" for n in k["reads"]): k["op"] = None  # the residual read lazily from the embedding
    labelled.append(k["op"] is not None)
  # the attention's kernels run over a symbolic count of cache rows, named by its variable: `start_pos`, or in a batched
  # step each row's `pos0`, `pos1`, ... (whose kernels interleave), so its phase is followed per variable
  phase, block, row_phase = "embed", "embed", {}
  for i, k in enumerate(kernels):
    row = m.group(0) if (m := re.search(r"start_pos|pos\d+", k["name"])) else None
    prev = row_phase.get(row, phase) if row else phase
    if k["name"].startswith("attention_"): k["op"] = "attention"  # nn/attention_kernel.py: scores, softmax and attn·v in one
    elif k["op"] == "cache":  # the cache write, the scores against it, or the weighted sum of its rows
      k["op"] = "attn·v" if prev in ("scores", "softmax") else "scores" if row else "attn kv"
    elif k["op"] is None:
      nxt = next((kernels[j] for j in range(i + 1, len(kernels)) if labelled[j]), None)
      if k["sqrt"] and not k["exp"]: k["op"], k["block"] = "norm", nxt["block"] if nxt else block  # statistics for the next norm
      elif prev in ("scores", "softmax"): k["op"] = "softmax"
      elif phase in ("router", "top-k"): k["op"] = "top-k"
      elif phase in ("head", "sampling"): k["op"] = "sampling"
      else: k["op"] = phase
    if k["block"] is None: k["block"] = block
    if k["op"] == "embed": k["block"] = "embed"
    if row: row_phase[row] = k["op"]
    phase, block = k["op"], k["block"]

class _Recorder:
  """Stands in for tinygrad's per-call stats hook during a replay: records each kernel's time, bytes and buffers.
  A buffer written by a kernel that only reads one named tensor (elementwise) inherits its name (a weight dequantized once for a
  prefill GEMM is still that weight); any other write clears a scratch buffer's name (the JIT reuses buffers)."""
  def __init__(self, names: dict): self.names, self.fixed, self.calls = dict(names), set(names), []
  def _name(self, b) -> str | None: return self.names.get(b) or self.names.get(getattr(b, "_base", None))
  def __call__(self, ctx, call, st, ets):
    bufs = [u.buffer for u in realize.resolve_params(call, ctx.input_uops)]
    ast, (outs, ins) = call.src[0], realize.get_call_outs_ins(call)
    ops = {u.op for u in ast.toposort()} if ast.op is Ops.PROGRAM else set()
    reads = [n for b in bufs if (n := self._name(b))]
    self.calls.append({"name": re.sub(r"\x1b\[[0-9;]*m", "", realize.get_call_name(call, bufs, ctx.var_vals)),
                       "time_s": sum(e for e in ets if e is not None), "bytes": int(sym_infer(realize.estimate_uop(call).mem, ctx.var_vals)),
                       "reads": reads, "sqrt": Ops.SQRT in ops, "exp": Ops.EXP2 in ops})
    src = [self._name(bufs[i]) for i in ins if i < len(bufs)]
    for i in outs:
      if i >= len(bufs) or bufs[i] in self.fixed: continue
      if len(set(src)) == 1 and src[0] and Ops.REDUCE not in ops: self.names[bufs[i]] = src[0]  # a pure unpack of one tensor
      else: self.names.pop(bufs[i], None)

def _timed_replays(step, args_fn, names: dict, repeat: int) -> tuple[list[dict], list[float]]:
  """Replay a captured step `repeat` times: per-kernel times (synchronous, one launch at a time) and plain wall times."""
  runs, walls = [], []
  for _ in range(repeat):
    t0 = time.perf_counter(); step(*args_fn()); Device[Device.DEFAULT].synchronize(); walls.append(time.perf_counter() - t0)  # a GPU runs it async
  orig, rec = realize.track_stats, None
  try:
    for _ in range(repeat):
      rec = _Recorder(names)
      realize.track_stats = rec
      with Context(DEBUG=2), contextlib.redirect_stdout(io.StringIO()): step(*args_fn())
      runs.append(rec.calls)
  finally: realize.track_stats = orig
  kernels = runs[0]
  for i, k in enumerate(kernels): k["time_s"] = statistics.median(r[i]["time_s"] for r in runs)
  return kernels, walls

def profile_model(model, pos: int = 127, repeat: int = 10, prefill: bool = False, rows: int = 1) -> dict:
  """Per-kernel profile of one decode step at position `pos` (the attention reads pos+1 cache rows), and of one
  JIT prefill chunk with `prefill`. The cache content is whatever is there: timing does not depend on it. `rows` > 1
  (a model with that many slots, nn/cache_rows.py): the batched step of that many sequences, each in its own slot at `pos`,
  each with its own token (so MoE rows choose different experts)."""
  names, res = named_buffers(model), {}
  with Context(JIT=2):  # no graph batching: every kernel stays a separate, timeable launch
    var = lambda name, hi, v: UOp.variable(name, 0, hi).bind(v)
    if rows == 1:
      step = Jit(lambda tok, sp: greedy(model.forward(tok, sp, last_only=True)[:, -1]).realize())
      tok = lambda: (var("token", model.cfg.n_vocab - 1, 1), var("start_pos", model.max_ctx - 1, pos))
    else:
      fwd = lambda *a: model.forward(list(a[:rows]), Rows(a[rows:2 * rows], a[2 * rows:]), last_only=True)
      step = Jit(lambda *a: greedy(fwd(*a)[:, -1]).realize())
      tok = lambda: tuple(var(f"token{i}", model.cfg.n_vocab - 1, 1 + 7919 * i % model.cfg.n_vocab) for i in range(rows)) + \
        tuple(var(f"slot{i}", model.slots - 1, i) for i in range(rows)) + tuple(var(f"pos{i}", model.max_ctx - 1, pos) for i in range(rows))
    for _ in range(3): step(*tok())
    res["decode"] = _summarize(*_timed_replays(step, tok, names, repeat), pos=pos, tokens=rows)
    if prefill:
      # the chunk a long prompt runs, of distinct tokens: a MoE's routing (how many tokens share an expert) depends on them
      C = model.PREFILL_CHUNK
      ids = [1 + 7919 * i % (model.cfg.n_vocab - 1) for i in range(C)]
      pstep = Jit(lambda t, sp: model.forward(t, sp, last_only=True).realize())
      chunk = lambda: (Tensor([ids], dtype=dtypes.int32), UOp.variable("start_pos", 0, model.max_ctx - 1).bind(max(pos - C, 0)))
      for _ in range(3): pstep(*chunk())
      res["prefill"] = _summarize(*_timed_replays(pstep, chunk, names, max(3, repeat // 3)), pos=max(pos - C, 0), tokens=C)
  return res

def _summarize(kernels: list[dict], walls: list[float], pos: int, tokens: int = 1) -> dict:
  attribute(kernels)
  for i, k in enumerate(kernels):
    k["index"], k["gbps"] = i, k["bytes"] / k["time_s"] / 1e9 if k["time_s"] else 0.0
    del k["sqrt"], k["exp"]
  by_op, by_block = defaultdict(lambda: [0.0, 0, 0]), defaultdict(lambda: [0.0, 0, 0])
  for k in kernels:
    for d, key in ((by_op, k["op"]), (by_block, k["block"])): d[key][0] += k["time_s"]; d[key][1] += k["bytes"]; d[key][2] += 1
  fmt = lambda d: {k: {"time_s": t, "bytes": b, "kernels": n} for k, (t, b, n) in d.items()}
  return {"position": pos, "tokens": tokens, "wall_s": statistics.median(walls), "kernel_time_s": sum(k["time_s"] for k in kernels),
          "kernels": kernels, "by_op": fmt(by_op), "by_block": fmt(by_block)}

def write(res: dict, out_dir: pathlib.Path, title: str, read_gbps: float) -> list[pathlib.Path]:
  """<step>.csv (a row per kernel), <step>.json (everything) and <step>.png per profiled step."""
  out_dir.mkdir(parents=True, exist_ok=True)
  written = []
  for step, r in res.items():
    if not isinstance(r, dict) or "kernels" not in r: continue
    with open(p := out_dir / f"{step}.csv", "w", newline="") as f:
      w = csv.writer(f)
      w.writerow(["index", "block", "op", "kernel", "time_us", "bytes", "gbps", "reads"])
      for k in r["kernels"]:
        w.writerow([k["index"], k["block"], k["op"], k["name"], f"{k['time_s'] * 1e6:.2f}", k["bytes"], f"{k['gbps']:.3f}", " ".join(k["reads"])])
    written.append(p)
    (p := out_dir / f"{step}.json").write_text(json.dumps({"title": title, "read_gbps": read_gbps, **{k: v for k, v in res.items() if k not in
                                                  ("decode", "prefill")}, step: r}, indent=1)); written.append(p)
    written.append(_chart(r, out_dir / f"{step}.png", f"{title}: {step}", read_gbps))
  return written

def _chart(r: dict, path: pathlib.Path, title: str, read_gbps: float) -> pathlib.Path:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  ops = [c for c in CATEGORIES if c in r["by_op"]] + [c for c in r["by_op"] if c not in CATEGORIES]
  colors = {op: plt.cm.tab20(i % 20) for i, op in enumerate(CATEGORIES + ops)}
  fig, axs = plt.subplot_mosaic([["a", "b"], ["c", "c"]], figsize=(14, 9), height_ratios=[5.5, 3])
  a, b, c = axs["a"], axs["b"], axs["c"]
  ms = [r["by_op"][o]["time_s"] * 1e3 for o in ops]
  a.barh(ops[::-1], ms[::-1], color=[colors[o] for o in ops[::-1]])
  total = r["kernel_time_s"] * 1e3
  for y, (o, v) in enumerate(zip(ops[::-1], ms[::-1])):
    a.text(v, y, f" {v:.2f} ms ({100 * v / total:.0f}%) · {r['by_op'][o]['kernels']} k", va="center", fontsize=8)
  a.set_xlabel("ms per step (sum over blocks)"); a.set_xlim(0, max(ms) * 1.45)
  a.set_title(f"time by op: {total:.1f} ms in {len(r['kernels'])} kernels (wall {r['wall_s'] * 1e3:.1f} ms)", fontsize=10)
  for o in ops:
    ks = [k for k in r["kernels"] if k["op"] == o and k["bytes"] > 0 and k["time_s"] > 0]
    b.scatter([k["bytes"] for k in ks], [k["gbps"] for k in ks], s=12, color=colors[o], label=o)
  xs = [min(k["bytes"] for k in r["kernels"] if k["bytes"] > 0), max(k["bytes"] for k in r["kernels"])]
  if read_gbps: b.plot(xs, [read_gbps] * 2, "k--", lw=1, label=f"one core's streaming read {read_gbps:.1f} GB/s")
  b.set_xscale("log"); b.set_yscale("log"); b.set_xlabel("bytes moved by the kernel"); b.set_ylabel("GB/s")
  b.set_title("each kernel (timed alone" + (", one core) against the bandwidth roofline" if read_gbps else ")"), fontsize=10)
  b.legend(fontsize=7, ncol=2, loc="lower right")
  blocks = list(dict.fromkeys(k["block"] for k in r["kernels"]))
  bottom = [0.0] * len(blocks)
  for o in ops:
    v = [sum(k["time_s"] for k in r["kernels"] if k["block"] == bl and k["op"] == o) * 1e3 for bl in blocks]
    c.bar(range(len(blocks)), v, bottom=bottom, color=colors[o], width=0.8); bottom = [x + y for x, y in zip(bottom, v)]
  c.set_xticks(range(len(blocks)), [bl.removeprefix("blk.") for bl in blocks], fontsize=7); c.set_ylabel("ms")
  c.set_title("time per block (blk.N by index), stacked by op", fontsize=10)
  fig.suptitle(title); fig.tight_layout(); fig.savefig(path, dpi=90); plt.close(fig)
  return path

def format_text(res: dict, top: int = 12) -> str:
  lines = []
  for step in ("decode", "prefill"):
    if step not in res: continue
    r, total = res[step], res[step]["kernel_time_s"]
    lines.append(f"{step} ({r['tokens']} token{'s' if r['tokens'] > 1 else ''} at position {r['position']}): {len(r['kernels'])} kernels, "
                 f"{total * 1e3:.2f} ms kernel time, {r['wall_s'] * 1e3:.2f} ms wall")
    if rf := res.get("roofline"):
      moved = sum(k["bytes"] for k in r["kernels"])
      lines.append(f"  kernels timed one at a time on one core (one core streams {rf['read_gbps_one_core']:.1f} GB/s); the wall runs on "
                   f"{rf['threads']} threads: {moved / r['wall_s'] / 1e9:.2f} GB/s = {100 * moved / r['wall_s'] / 1e9 / rf['read_gbps']:.1f}% "
                   f"of {rf['read_gbps']:.1f} GB/s streaming read on {rf['threads']} threads")
    for op, v in sorted(r["by_op"].items(), key=lambda kv: -kv[1]["time_s"]):
      lines.append(f"  {op:<14} {v['time_s'] * 1e3:8.3f} ms {100 * v['time_s'] / total:5.1f}%  {v['kernels']:4d} kernels  "
                   f"{v['bytes'] / 1e6:8.2f} MB  {v['bytes'] / max(v['time_s'], 1e-12) / 1e9:6.2f} GB/s")
    lines.append("  slowest kernels:")
    for k in sorted(r["kernels"], key=lambda k: -k["time_s"])[:top]:
      lines.append(f"    {k['block']:<8} {k['op']:<14} {k['time_s'] * 1e6:9.1f} us {k['gbps']:6.2f} GB/s  {k['name']}")
  return "\n".join(lines)
