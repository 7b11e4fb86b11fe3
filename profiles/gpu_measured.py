"""Measurements of GPU steps beside the GPU cost model's inputs, as the CSVs in profiles/gpu/ that tests/test_gpu_cost.py
holds the model to (tg_ds4/tools/gpu_cost.py: a row per kernel with its recorded features and, where a GPU timed it,
its time; rows for op classes measured as a sum; a row for the step as `bench` replays it, and one for the host's
Python work a step, timed on tinygrad's NULL device by the CPU that records).

    python profiles/gpu_measured.py calibration --checkout WORKTREE_AT_0e65eba
        the H200 measurements of the code at 0e65eba (below), beside the kernels that checkout lowers for CUDA
    python profiles/gpu_measured.py device --gpu h200 --model FILE --profile MEASURED.json --bench BENCH.json [--parallel N] --out CSV
        a run on a GPU (profiles/gpu_check.sh): `profile --json` timed there and `bench --json`'s decode, beside the
        kernels this checkout lowers for CUDA
    python profiles/gpu_measured.py table OUT
        one table of gpu_check.sh's `bench --json` results beside llama.cpp's llama-bench (`-o json`) on the same files

The bench files are profiles/make_bench_model.py's (v2lite, v2lite --layers 27, v4flash), made where this runs."""
from __future__ import annotations

import argparse, json, pathlib, subprocess, sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tg_ds4.backend.cache import cache_dir  # noqa: E402
from tg_ds4.tools import gpu_cost  # noqa: E402

# NVIDIA H200, driver 580.159.04, the code at 0e65eba (../shared/gpu/README.md, docs/gpu.md "Performance on a GPU"):
# `bench --prompt-tokens 128 --gen 64 --repeat 2` decode tok/s (4 streams: --parallel 4, tokens of all streams a second),
# and the per-op sums of `profile` (every kernel timed alone, position 127), derived from the figures quoted there:
# a class given as GB/s is its profile bytes (tinygrad's estimate, as profile printed them) over that rate
CALIBRATION = {
  ("v2lite", 4, 1): {"decode_tps": 684, "classes": {
    "*": 2300,                                   # 95 kernels, 2.30 ms of kernel time
    "head": 223.25e6 / 1.07e12 * 1e6,            # 1.07 TB/s
    "experts": 234.22e6 / 0.91e12 * 1e6,         # routed experts 0.91 TB/s
    "shared expert": 0.19 * 2300,                # 19% of the step
    "softmax": 12 * 15.0, "norm": 8 * 15.0,      # 12 and 8 kernels, 10-20 us each
    "attn kv|scores|attn·v": (2.92e6 + 1.36e6 + 1.28e6) / 17e9 * 1e6}},  # attention kernels at 11-23 GB/s
  ("v2lite", 4, 4): {"decode_tps": 1135, "classes": {"*": 4830, "head": 335, "ffn": 141}},  # the 4-row step
  ("v2lite", 27, 1): {"decode_tps": 150, "classes": {}},
  ("v4flash", 4, 1): {"decode_tps": 209, "classes": {
    "*": 7350,                                   # 157 kernels, 7.35 ms
    "norm|hyper-conn": 0.30 * 7350,              # norms (40) and hyper-connections (18): 30% of it
    "experts": 1070, "head": 490}},              # routed experts 1.07 ms, head 0.49 ms
}
STEMS = {"v2lite": "v2lite-{layers}L-Q4_0", "v4flash": "v4flash-{layers}L-q2"}

def calibration(checkout: str, out_dir: pathlib.Path) -> None:
  for (preset, layers, parallel), m in CALIBRATION.items():
    model = cache_dir() / "bench" / f"{STEMS[preset].format(layers=layers)}.gguf"
    if not model.exists(): subprocess.run([sys.executable, str(REPO / "profiles/make_bench_model.py"), preset, "--layers", str(layers)], check=True)
    step = gpu_cost.record(str(model), checkout, False, parallel, None)["steps"]["decode"]
    rows = gpu_cost.measurement_rows(step, classes_us=m["classes"], step_us=parallel / m["decode_tps"] * 1e6,
                                     host=gpu_cost.host_us(str(model), checkout, parallel))
    path = out_dir / f"h200-0e65eba-{model.stem}{f'-p{parallel}' if parallel > 1 else ''}.csv"
    gpu_cost.write_measurement(path, rows)
    print(f"wrote {path} ({len(step['kernels'])} kernels)")

def device(args) -> None:
  step = gpu_cost.record(args.model, None, False, args.parallel, None)["steps"]["decode"]
  measured = json.loads(pathlib.Path(args.profile).read_text())["decode"]["kernels"]
  if [k["name"] for k in measured] != [k["name"] for k in step["kernels"]]:
    sys.exit("the GPU's profile and the CUDA lowering launched different kernels: not comparable")
  bench = json.loads(pathlib.Path(args.bench).read_text())
  tps = bench["parallel"]["aggregate_decode_tps"] if args.parallel > 1 else bench["tg_ds4"]["decode_tps"]
  rows = gpu_cost.measurement_rows(step, measured_us=[k["time_s"] * 1e6 for k in measured], step_us=args.parallel / tps * 1e6,
                                   host=gpu_cost.host_us(args.model, None, args.parallel))  # on the GPU machine's own CPU
  gpu_cost.write_measurement(pathlib.Path(args.out), rows)
  print(f"wrote {args.out}")

def _llama(path: pathlib.Path) -> dict:
  """llama-bench's -o json records as {(prompt, gen, depth): tok/s}."""
  if not path.exists(): return {}
  return {(r.get("n_prompt", 0), r.get("n_gen", 0), r.get("n_depth", 0)): r["avg_ts"] for r in json.loads(path.read_text())}

def table(out: pathlib.Path) -> str:
  rows = ["| file | what | tg_ds4 tok/s | llama.cpp tok/s | ratio |", "| --- | --- | --- | --- | --- |"]
  def row(name: str, what: str, ours: float | None, theirs: float | None):
    num = lambda v: f"{v:,.0f}" if v else ""
    rows.append(f"| {name} | {what} | {num(ours)} | {num(theirs)} | {f'{ours / theirs:.2f}x' if ours and theirs else ''} |")
  load = lambda p: json.loads(p.read_text()) if p.exists() and p.stat().st_size else None
  for name in ("v2lite-4L-Q4_0", "v4flash-4L-q2"):
    lc, depth = _llama(out / f"llama-{name}.json"), _llama(out / f"llama-depth-{name}.json")
    b, b512, bd, bp = (load(out / f"{p}{name}{s}.json") for p, s in (("bench-", ""), ("bench-512-", ""), ("bench-depth-", ""), ("bench-", "-p4")))
    if not (b or lc): continue
    row(name, "prefill 128", b and b["tg_ds4"]["prefill_tps"], lc.get((128, 0, 0)))
    row(name, "prefill 512", b512 and b512["tg_ds4"]["prefill_tps"], lc.get((512, 0, 0)))
    row(name, "decode", b and b["tg_ds4"]["decode_tps"], lc.get((0, 64, 0)))
    row(name, "decode at depth 16k", bd and bd["tg_ds4"]["decode_tps"], depth.get((0, 32, 16384)))
    row(name, "4 streams (llama-batched-bench: its log)", bp and bp["parallel"]["aggregate_decode_tps"], None)
  return "\n".join(rows)

def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = ap.add_subparsers(dest="cmd", required=True)
  c = sub.add_parser("calibration")
  c.add_argument("--checkout", required=True, help="a git worktree of this repository at 0e65eba")
  c.add_argument("--out", default=str(REPO / "profiles/gpu"))
  d = sub.add_parser("device")
  d.add_argument("--gpu", choices=sorted(gpu_cost.HARDWARE), required=True)
  d.add_argument("--model", required=True)
  d.add_argument("--profile", required=True, help="`profile --json` of the same file on the GPU")
  d.add_argument("--bench", required=True, help="`bench --json` of the same file on the GPU")
  d.add_argument("--parallel", type=int, default=1)
  d.add_argument("--out", required=True)
  t = sub.add_parser("table")
  t.add_argument("out", help="gpu_check.sh's output folder")
  args = ap.parse_args()
  if args.cmd == "table":
    print(table(pathlib.Path(args.out)))
    return 0
  if args.cmd == "calibration":
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    calibration(args.checkout, pathlib.Path(args.out))
  else: device(args)
  return 0

if __name__ == "__main__":
  sys.exit(main())
