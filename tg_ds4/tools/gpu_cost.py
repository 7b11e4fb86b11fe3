"""`tg_ds4 profile --predict h200|h100`: the time of a GPU step predicted from its kernels as tinygrad lowers them for
NVIDIA (`NULL:CUDA:sm_90`), on any machine.

tools/gpu_record.py runs a checkout's own `profile` (this one's, or an older commit's with `--checkout`) with the CUDA
renderer on tinygrad's NULL device and records every kernel of the profiled step: its launch (blocks, threads), the
per-thread loop structure (how many dependent round trips to memory one thread makes), the issue slots its
instructions take (each weighted by its pipe's rate: a conversion takes 8 FMA slots, a load 4), the bytes it moves
(the footprint of its lowered index expressions) and its FLOPs. Each kernel's time is then

    launch + max(round trips x latency x waves, bytes / bandwidth, instructions / issue rate, FLOPs / peak)

A GPU hides latency only with threads in flight: a kernel whose threads each loop over a long row one load at a time
(a norm or softmax on 16 threads) takes its chain of round trips however few bytes it reads; a GEMV that unpacks
bytes one at a time is bound by how fast the SMs issue the instructions (or convert the values); a wide kernel of few instructions a byte
is bound by HBM. The step is the sum of its kernels in a CUDA graph plus the host's share of a step: the Python work
of the checkout's own decode loop, timed by running its `bench` on tinygrad's NULL device (every kernel and the graph
a no-op: what is left is the host), and the part no NULL run shows (the graph's launch on the GPU, waiting for it,
copying the token back). The constants are named in `HARDWARE`, with their source; the fitted ones are fitted to the
H200 measurements in docs/gpu.md."""
from __future__ import annotations

import contextlib, csv, json, math, os, pathlib, subprocess, sys, tempfile
from dataclasses import asdict, dataclass, replace

REPO = pathlib.Path(__file__).resolve().parents[2]
RECORDER = pathlib.Path(__file__).resolve().parent / "gpu_record.py"

@dataclass(frozen=True)
class Hardware:
  """An NVIDIA GPU as the cost model sees it. Sources: NVIDIA's H100/H200 datasheets and the Hopper tuning guide
  (SMs, clock, HBM, peaks, residency limits); the rest as noted."""
  name: str
  sms: int                  # streaming multiprocessors (GH100 as sold: 132)
  clock_ghz: float          # boost clock
  hbm_gbps: float           # HBM peak: H100 SXM 3,350 GB/s, H200 4,800 GB/s
  bw_fraction: float        # of HBM peak that streaming kernels reach (FlashMLA: 3,000 of an H800's 3,350 GB/s)
  launch_us: float          # a kernel node inside a CUDA graph, end to end (~2-3 us at this size, ../shared/docs/gpu_notes.md)
  launch_alone_us: float    # a kernel launched and timed by itself, as `profile` times them (fitted: H200 profile, 95 kernels)
  round_ns: float           # one dependent round trip to memory that a thread waits for, under load (fitted: H200)
  smem_round_ns: float      # a loop iteration that waits on shared memory (~30 cycles: Hopper microbenchmarks)
  alu_round_ns: float       # a loop iteration that waits on no memory: a few dependent ALU ops (~4 cycles each)
  issue_fraction: float     # of the SMs' issue rate (4 schedulers x 32 lanes a clock) that tinygrad's kernels reach: the full
                            # rate, with each instruction weighted by its pipe's rate (tools/gpu_record.py PIPES)
  fp32_tflops: float        # CUDA cores (dense FP32)
  tc_tflops: float          # tensor cores, FP16 inputs with FP32 accumulation (dense)
  host_sync_us: float       # the host's share of a step that a NULL run does not show: the graph's launch on the GPU,
                            # waiting for the step, copying the token back (fitted, beside the NULL-timed Python work)
  warps_per_sm: int = 64    # resident warps (2,048 threads)
  blocks_per_sm: int = 32   # resident blocks

  def issue_per_s(self) -> float: return self.sms * 4 * 32 * self.clock_ghz * 1e9 * self.issue_fraction

# The fitted constants (round_ns, launch_alone_us, host_sync_us) come from the H200 measurements of the
# code at 0e65eba (docs/gpu.md "The cost model"); the H100 shares them but for its clock-independent memory system
H200 = Hardware("NVIDIA H200", sms=132, clock_ghz=1.98, hbm_gbps=4800, bw_fraction=0.9, launch_us=2.5, launch_alone_us=8.0,
                round_ns=100.0, smem_round_ns=15.0, alu_round_ns=4.0, issue_fraction=1.0, fp32_tflops=67, tc_tflops=990, host_sync_us=40.0)
H100 = replace(H200, name="NVIDIA H100 SXM", hbm_gbps=3350)
HARDWARE = {"h200": H200, "h100": H100}

def is_weight(name: str) -> bool: return name.endswith((".weight", ".bias"))  # GGUF tensor names (module attributes)

def is_state(name: str) -> bool:
  """A named buffer that is per-sequence state a step reads back: KV caches, deepseek4's rings and compressor state
  (not a weight, not a rope table)."""
  return bool(name) and not is_weight(name) and not name.startswith(("rope", "tabs"))

def threads(k: dict) -> int: return math.prod(k["global"]) * math.prod(k["local"])

def kernel_time(k: dict, hw: Hardware, alone: bool = False) -> dict:
  """Predicted seconds of one recorded kernel, in a CUDA graph (or launched alone), with each bound and its floor."""
  blocks, block = math.prod(k["global"]), math.prod(k["local"])
  warps = -(-block // 32)
  per_sm = min(hw.blocks_per_sm, hw.warps_per_sm // warps) if warps <= hw.warps_per_sm else 1
  waves = max(1.0, blocks / (hw.sms * per_sm))
  r = k["rounds"]
  moved = sum(k["bytes"].values())
  bounds = {"latency": waves * ((r["dram"] + r["l2"]) * hw.round_ns + r.get("smem", 0) * hw.smem_round_ns + r["alu"] * hw.alu_round_ns) * 1e-9,
            "memory": moved / (hw.hbm_gbps * 1e9 * hw.bw_fraction),
            "issue": k["instructions"] * blocks * warps * 32 / hw.issue_per_s(),
            "compute": k["flops"] * threads(k) / (hw.fp32_tflops * 1e12) + k["tc_flops"] * threads(k) / (hw.tc_tflops * 1e12)}
  launch = (hw.launch_alone_us if alone else hw.launch_us) * 1e-6
  bound = max(bounds, key=bounds.get)
  return {"time_s": launch + bounds[bound], "bound": bound, "floor_s": max(launch, bounds["memory"]), "bytes": moved,
          **{f"{b}_s": v for b, v in bounds.items()}}

def active_bytes(path: str, rows: int = 1) -> int:
  """Packed weight bytes a step of `rows` tokens must read at least once: every tensor of the main layers, the routed
  experts of the experts the rows choose (expected distinct experts of `rows` random picks of `used` of `n`), the
  embedding rows of the tokens; a multi-token-prediction block is not part of the step."""
  from tg_ds4.io.gguf import open_gguf
  gf = open_gguf(path)
  arch, get = gf.arch, gf.metadata.get
  n, used = get(f"{arch}.expert_count", 0) or 0, get(f"{arch}.expert_used_count", 0) or 0
  layers = get(f"{arch}.block_count", 0) - (get(f"{arch}.nextn_predict_layers", 0) or 0)
  vocab = len(get("tokenizer.ggml.tokens", [])) or 1
  total = 0.0
  for name, info in gf.infos.items():
    if name.startswith("blk.") and int(name.split(".")[1]) >= layers: continue
    if "_exps" in name and n: total += info.nbytes * min(1.0, n * (1 - (1 - used / n) ** rows) / n)
    elif name.startswith("token_embd"): total += info.nbytes * rows / vocab
    else: total += info.nbytes
  return int(total)

def host_us(model: str, checkout: str | None, parallel: int) -> tuple[float, int]:
  """Microseconds of host work a decode step of the checkout's generation loop takes (a batched step of `parallel` rows
  with parallel > 1), and how many steps that loop launches before it waits for them (runtime/runner.py's run-ahead;
  1 where its bench does not say): its own `bench` run on tinygrad's NULL device, where kernels and graphs are no-ops
  and a copy back reads nothing, so what its clock measures is the Python of the loop: the captured step's replay,
  binding the position and token, reading the token back."""
  from tg_ds4.io.gguf import open_gguf
  gf = open_gguf(model)
  # the calibration's bench (128 prompt tokens, 64 generated) where the file's context holds it
  prompt, gen = (128, 64) if (gf.metadata.get(f"{gf.arch}.context_length") or 0) >= 200 else (16, 40)
  cmd = [sys.executable, "-m", "tg_ds4", "bench", "-m", model, "--prompt-tokens", str(prompt), "--gen", str(gen), "--repeat", "5", "--json",
         *(["--parallel", str(parallel)] if parallel > 1 else [])]
  env = {**os.environ, "DEV": "NULL", "NULL_ALLOW_COPYOUT": "1", "TG_DS4_STEP_CACHE": "0"}
  r = subprocess.run(cmd, cwd=checkout or REPO, env=env, capture_output=True, text=True)
  if r.returncode != 0: raise RuntimeError(f"timing the host's share on the NULL device failed ({' '.join(cmd[3:])}):\n{r.stderr.strip()[-2000:]}")
  out = json.loads(r.stdout)
  if parallel > 1: return out["parallel"]["ms_per_step"] * 1e3, 1
  return out["tg_ds4"]["ms_per_token"] * 1e3, out["tg_ds4"].get("run_ahead", 1)

def record(model: str, checkout: str | None, prefill: bool, parallel: int, pos: int | None) -> dict:
  """The recorded kernels of a checkout's profiled steps (tools/gpu_record.py in a process of its own)."""
  with tempfile.TemporaryDirectory() as d:
    out = pathlib.Path(d) / "record.json"
    cmd = [sys.executable, str(RECORDER), str(out), str(pathlib.Path(checkout or REPO).resolve()), "--", "profile", "-m", model, "--repeat", "1",
           "--json", *(["--prefill"] if prefill else []), *(["--parallel", str(parallel)] if parallel > 1 else []),
           *(["--pos", str(pos)] if pos is not None else [])]
    env = {**os.environ, "DEV": "NULL:CUDA:sm_90", "TG_DS4_STEP_CACHE": "0"}
    env.pop("TG_DS4_PRECISION", None)  # the GPU's own precision
    r = subprocess.run(cmd, cwd=checkout or REPO, env=env, capture_output=True, text=True)
    if r.returncode != 0:
      raise RuntimeError(f"lowering the steps for CUDA failed ({' '.join(cmd[3:])}):\n{r.stderr.strip()[-2000:]}")
    return json.loads(out.read_text())

def predict(rec: dict, hw: Hardware, model: str, host_python_us: float, run_ahead: int = 1) -> dict:
  """Per-kernel and whole-step predictions for every recorded step; `host_python_us`: the host's Python work a step
  (`host_us`), to which the fitted rest of the host's share is added. A decode loop that launches `run_ahead` > 1 steps
  before it waits for them overlaps its Python with the GPU's kernels, and waits once for all of them: a decode step is
  then max(kernels, Python) + the fitted wait over run_ahead."""
  res = {"hardware": asdict(hw), "renderer": rec["renderer"], "host_python_us": host_python_us, "run_ahead": run_ahead,
         "host_us": host_python_us + hw.host_sync_us}
  for step, s in rec["steps"].items():
    kernels = []
    def named(k: dict, key: str) -> str: return k["buffers"].get(key.split(":")[0], "")
    for i, k in enumerate(s["kernels"]):
      p, alone = kernel_time(k, hw), kernel_time(k, hw, alone=True)
      kernels.append({"index": i, "block": k["block"], "op": k["op"], "name": k["name"], "threads": threads(k), "blocks": math.prod(k["global"]),
                      "rounds": k["rounds"], "instructions": k["instructions"], "flops": k["flops"] * threads(k),
                      "tc_flops": k["tc_flops"] * threads(k), **p, "alone_s": alone["time_s"],
                      "reads": {n: b for key, b in k["bytes"].items() if key.endswith("load") and (n := named(k, key))},
                      "weight_bytes": sum(b for key, b in k["bytes"].items() if is_weight(named(k, key))),
                      "cache_bytes": sum(b for key, b in k["bytes"].items() if is_state(named(k, key)) and key.endswith("load"))})
    rows = s["tokens"]
    kernel_s = sum(k["time_s"] for k in kernels)
    if step == "decode" and run_ahead > 1: step_s = max(kernel_s, host_python_us * 1e-6) + hw.host_sync_us * 1e-6 / run_ahead
    else: step_s = kernel_s + res["host_us"] * 1e-6
    by_op: dict = {}
    for k in kernels:
      o = by_op.setdefault(k["op"], {"time_s": 0.0, "alone_s": 0.0, "bytes": 0, "kernels": 0})
      o["time_s"] += k["time_s"]; o["alone_s"] += k["alone_s"]; o["bytes"] += k["bytes"]; o["kernels"] += 1
    active = active_bytes(model, rows)
    kv = sum(k["cache_bytes"] for k in kernels)
    res[step] = {"position": s["position"], "tokens": rows, "step_s": step_s, "tokens_per_s": rows / step_s, "kernels": kernels,
                 "kernel_time_s": sum(k["time_s"] for k in kernels), "alone_time_s": sum(k["alone_s"] for k in kernels),
                 "bytes_per_step": sum(k["bytes"] for k in kernels), "weight_bytes": sum(k["weight_bytes"] for k in kernels),
                 "active_bytes": active, "kv_bytes": kv, "by_op": by_op,
                 "over_floor": sum(k["time_s"] > 2 * k["floor_s"] for k in kernels)}
  res["predicted"] = {"step_ms": res["decode"]["step_s"] * 1e3 if "decode" in res else None,
                      "decode_tps": res["decode"]["tokens_per_s"] if "decode" in res else None,
                      **({"prefill_tps": res["prefill"]["tokens_per_s"]} if "prefill" in res else {})}
  if "decode" in res:
    d = res["decode"]
    res.update(bytes_per_step=d["bytes_per_step"], active_bytes=d["active_bytes"], kv_bytes=d["kv_bytes"], kernels=len(d["kernels"]))
  return res

def format_text(res: dict, top: int = 12) -> str:
  hw, lines = res["hardware"], []
  overlap = f", overlapped: {res['run_ahead']} steps launched at a time" if res.get("run_ahead", 1) > 1 else ""
  for step in ("decode", "prefill"):
    if step not in res: continue
    r = res[step]
    lines.append(f"{step} on {hw['name']} (predicted from the CUDA lowering; {r['tokens']} token{'s' * (r['tokens'] > 1)} at position "
                 f"{r['position']}): {len(r['kernels'])} kernels, {r['step_s'] * 1e3:.3f} ms a step = {r['tokens_per_s']:,.0f} tok/s (kernels "
                 f"{r['kernel_time_s'] * 1e3:.3f} ms in a graph + host {res['host_us']:.0f} us{overlap if step == 'decode' else ''}; "
                 f"launched alone {r['alone_time_s'] * 1e3:.3f} ms)")
    need = r["active_bytes"] + r["kv_bytes"]
    lines.append(f"  bytes a step {r['bytes_per_step'] / 1e6:,.1f} MB = {r['bytes_per_step'] / need:.2f}x the active weights "
                 f"{r['active_bytes'] / 1e6:,.1f} MB + KV read {r['kv_bytes'] / 1e6:,.2f} MB (weights read {r['weight_bytes'] / 1e6:,.1f} MB); "
                 f"{r['over_floor']} kernels over 2x their floor")
    for op, v in sorted(r["by_op"].items(), key=lambda kv: -kv[1]["time_s"]):
      lines.append(f"  {op:<14} {v['time_s'] * 1e6:9.1f} us {100 * v['time_s'] / r['kernel_time_s']:5.1f}%  {v['kernels']:4d} kernels  "
                   f"{v['bytes'] / 1e6:9.2f} MB  {v['bytes'] / max(v['time_s'], 1e-12) / 1e9:7.1f} GB/s  (alone {v['alone_s'] * 1e6:8.1f} us)")
    lines.append("  slowest kernels (predicted us, bound, floor us, threads, round trips dram/l2/smem/alu, MB):")
    for k in sorted(r["kernels"], key=lambda k: -k["time_s"])[:top]:
      rt = k["rounds"]
      lines.append(f"    {k['block']:<8} {k['op']:<14} {k['time_s'] * 1e6:8.1f} {k['bound']:<8} {k['floor_s'] * 1e6:7.1f} {k['threads']:>8} "
                   f"{rt['dram']:>4}/{rt['l2']}/{rt.get('smem', 0)}/{rt['alu']:<4} {k['bytes'] / 1e6:8.3f}  {k['name']}")
  return "\n".join(lines)

CSV_FIELDS = ["index", "block", "op", "name", "threads", "blocks", "instructions", "bytes", "flops", "tc_flops", "bound", "time_s", "floor_s",
              "latency_s", "memory_s", "issue_s", "compute_s", "alone_s"]

def write(res: dict, out_dir: pathlib.Path, title: str) -> list[pathlib.Path]:
  """predict-<step>.csv (a row per kernel), predict-<step>.json and predict-<step>.png (profile's chart of the predicted times)."""
  from tg_ds4.tools.profile import _chart
  out_dir.mkdir(parents=True, exist_ok=True)
  written = []
  for step in ("decode", "prefill"):
    if step not in res: continue
    r = res[step]
    with open(p := out_dir / f"predict-{step}.csv", "w", newline="") as f:
      w = csv.DictWriter(f, CSV_FIELDS + ["rounds_dram", "rounds_l2", "rounds_smem", "rounds_alu"], extrasaction="ignore")
      w.writeheader()
      for k in r["kernels"]: w.writerow({**k, **{f"rounds_{a}": v for a, v in k["rounds"].items()}})
    written.append(p)
    (p := out_dir / f"predict-{step}.json").write_text(json.dumps({"title": title, **{k: v for k, v in res.items() if k not in ("decode", "prefill")},
                                                                   step: r}, indent=1))
    written.append(p)
    chart = {"kernels": [{**k, "gbps": k["bytes"] / k["time_s"] / 1e9} for k in r["kernels"]], "kernel_time_s": r["kernel_time_s"],
             "wall_s": r["step_s"],
             "by_op": {o: {"time_s": v["time_s"], "kernels": v["kernels"]} for o, v in r["by_op"].items()}}
    written.append(_chart(chart, out_dir / f"predict-{step}.png", f"{title}: {step} predicted on {res['hardware']['name']}", 0.0))
  return written

# A measurement of a GPU step beside what the model needs to predict it: the recorded kernels (features) with their
# measured times where a GPU timed them one by one (`profile`), the measured time of ops summed over a step where only
# that is known, and the step's measured time as `bench` replays it. profiles/gpu/*.csv hold them; tests/test_gpu_cost.py
# holds the model to every one of them.
MEASURED_FIELDS = ["kind", "index", "block", "op", "name", "tokens", "global", "local", "rounds_dram", "rounds_l2", "rounds_smem", "rounds_alu",
                   "instructions", "sectors", "flops", "tc_flops", "bytes", "measured_us"]

def measurement_rows(step: dict, measured_us: list | None = None, classes_us: dict | None = None, step_us: float | None = None,
                     host: tuple[float, int] | None = None) -> list[dict]:
  """CSV rows for one recorded step (gpu_record's `steps[...]`): a row per kernel, a row per measured op class, one for the
  step, and one for the host's Python work a step and its loop's run-ahead (`host_us`; named by the CPU that timed it,
  the run-ahead in its tokens field)."""
  rows = []
  for i, k in enumerate(step["kernels"]):
    rows.append({"kind": "kernel", "index": i, "block": k["block"], "op": k["op"], "name": k["name"], "global": "x".join(map(str, k["global"])),
                 "local": "x".join(map(str, k["local"])), **{f"rounds_{a}": v for a, v in k["rounds"].items()}, "instructions": k["instructions"],
                 "sectors": k.get("sectors", ""),
                 "flops": k["flops"], "tc_flops": k["tc_flops"], "bytes": sum(k["bytes"].values()),
                 "measured_us": "" if measured_us is None else f"{measured_us[i]:.2f}"})
  rows += [{"kind": "class", "op": op, "measured_us": f"{us:.1f}"} for op, us in (classes_us or {}).items()]
  if step_us is not None: rows.append({"kind": "step", "tokens": step["tokens"], "measured_us": f"{step_us:.1f}"})
  if host is not None: rows.append({"kind": "host", "name": f"NULL device on {cpu_name()}", "tokens": host[1], "measured_us": f"{host[0]:.1f}"})
  return rows

def cpu_name() -> str:
  import platform
  with contextlib.suppress(OSError):
    for line in open("/proc/cpuinfo"):
      if line.startswith("model name"): return line.split(":", 1)[1].strip()
  return platform.processor() or platform.machine()

def write_measurement(path: pathlib.Path, rows: list[dict]) -> None:
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, MEASURED_FIELDS, extrasaction="ignore")
    w.writeheader(); w.writerows(rows)

def check_measurement(path: pathlib.Path, hw: Hardware) -> dict:
  """{"step": (predicted us, measured us) or None, "classes": {op: (predicted alone us, measured us)}} for one measurement CSV."""
  rows = list(csv.DictReader(open(path)))
  kernels = [{"op": r["op"], "global": [int(x) for x in r["global"].split("x")], "local": [int(x) for x in r["local"].split("x")],
              "rounds": {a: int(r[f"rounds_{a}"] or 0) for a in ("dram", "l2", "smem", "alu")}, "instructions": int(r["instructions"]),
              "flops": int(r["flops"]),
              "tc_flops": int(r["tc_flops"]), "bytes": {"all": int(r["bytes"])}, "measured_us": r["measured_us"]}
             for r in rows if r["kind"] == "kernel"]
  def alone_us(ops: str) -> tuple[float, float | None]:  # an op, ops joined by "|", or "*" for every kernel
    ks = [k for k in kernels if ops == "*" or k["op"] in ops.split("|")]
    measured = [float(k["measured_us"]) for k in ks if k["measured_us"]]
    return sum(kernel_time(k, hw, alone=True)["time_s"] for k in ks) * 1e6, sum(measured) if ks and len(measured) == len(ks) else None
  classes = {r["op"]: (alone_us(r["op"])[0], float(r["measured_us"])) for r in rows if r["kind"] == "class"}
  for op in dict.fromkeys(k["op"] for k in kernels):  # ops a GPU timed kernel by kernel
    if op not in classes and (m := alone_us(op))[1] is not None: classes[op] = m
  out = {"classes": classes}
  step = next((r for r in rows if r["kind"] == "step"), None)
  host = next((r for r in rows if r["kind"] == "host"), None)
  if step and host is None: raise ValueError(f"{path}: a step's measured time without the host's Python work a step (a 'host' row)")
  if step:
    kernels_us, python, ahead = sum(kernel_time(k, hw)["time_s"] for k in kernels) * 1e6, float(host["measured_us"]), int(host["tokens"] or 1)
    predicted = max(kernels_us, python) + hw.host_sync_us / ahead if ahead > 1 else kernels_us + hw.host_sync_us + python
  out["step"] = (predicted, float(step["measured_us"])) if step else None
  out["tokens"] = int(step["tokens"]) if step else None
  return out
