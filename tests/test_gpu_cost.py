"""The GPU cost model (tg_ds4/tools/gpu_cost.py, gpu_record.py): held to every GPU measurement in profiles/gpu/, and its
inputs read off a real lowering for CUDA: the bytes each kernel moves are the footprint of its index expressions (a
gathered expert's rows, not its whole tensor; vector loads counted), run by the code of the checkout it is pointed at."""
import csv, json, os, pathlib, shutil, subprocess, sys

import pytest

from tg_ds4.io.gguf import open_gguf
from tg_ds4.tools import gpu_cost

ROOT = pathlib.Path(__file__).parents[1]
MEASURED = sorted((ROOT / "profiles" / "gpu").glob("*.csv"))
DS3 = ROOT / "tests" / "fixtures" / "deepseek2" / "ds3" / "ds3-Q4_0.gguf"
POS = 40

def test_there_are_measurements():
  assert len(MEASURED) >= 4, MEASURED  # the H200 calibration of 0e65eba at least

@pytest.mark.parametrize("path", MEASURED, ids=[p.stem for p in MEASURED])
def test_the_model_holds_to_every_measurement(path):
  """A step within 30% of the measured tok/s, each measured op class (kernels timed alone) within 2x."""
  res = gpu_cost.check_measurement(path, gpu_cost.HARDWARE[path.name.split("-")[0]])
  predicted, measured = res["step"]
  tps = lambda us: f"{res['tokens'] / us * 1e6:.0f}"
  assert 0.7 <= measured / predicted <= 1.3, f"{path.name}: predicted {tps(predicted)} tok/s, measured {tps(measured)}"
  bad = {op: f"{p:.0f} us predicted, {m:.0f} measured" for op, (p, m) in res["classes"].items() if not 0.5 <= p / m <= 2}
  assert not bad, f"{path.name}: {bad}"

def run_predict(*extra, checkout=None, env=None):
  cmd = [sys.executable, "-m", "tg_ds4", "profile", "--predict", "h200", "-m", str(DS3), "--pos", str(POS), "--json", *extra]
  if checkout: cmd += ["--checkout", str(checkout)]
  return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})

HOST_US = 123.0  # the host's Python work a step, given: timing it is test_another_checkout_runs_its_own_code's

@pytest.fixture(scope="module")
def predicted():
  r = run_predict("--host-us", str(HOST_US))
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout)

def test_weights_are_read_once_by_footprint(predicted):
  """Every weight matrix the step reads is read once at its footprint: the head's whole matrix, a routed expert tensor's
  chosen experts only (used / count of it); with the norm vectors that several fused kernels re-read, about the active
  weights the file says a token needs."""
  gf, d = open_gguf(DS3), predicted["decode"]
  n, used = gf.metadata["deepseek2.expert_count"], gf.metadata["deepseek2.expert_used_count"]
  reads: dict = {}
  for k in d["kernels"]:
    for name, b in k["reads"].items(): reads.setdefault(name, []).append(b)
  matrices = {x: i.nbytes * used // n if "_exps" in x else i.nbytes for x, i in gf.infos.items() if len(i.shape) >= 2 and x != "token_embd.weight"}
  assert "output.weight" in matrices and any("_exps" in x for x in matrices)
  for i in range(gf.metadata["deepseek2.block_count"]):  # a GPU's MLA stacks q (or q_a) and kv_a: both parts read once as one
    parts = [f"blk.{i}.attn_q.weight" if f"blk.{i}.attn_q.weight" in matrices else f"blk.{i}.attn_q_a.weight", f"blk.{i}.attn_kv_a_mqa.weight"]
    if f"blk.{i}.attn_q_kv.weight" in reads: matrices[f"blk.{i}.attn_q_kv.weight"] = sum(matrices.pop(p) for p in parts)
  assert {x: reads.get(x) for x in matrices} == {x: [b] for x, b in matrices.items()}
  weights = sum(b for name, bs in reads.items() if name in gf.infos or name in matrices for b in bs)
  assert d["active_bytes"] <= weights <= 1.05 * d["active_bytes"]

def test_the_cache_rows_are_read(predicted):
  """The attention reads every cached row of every layer (POS + 1 rows of the latent and the rope key, in half): the
  scores' vector loads count."""
  m = open_gguf(DS3).metadata
  row = (m["deepseek2.attention.kv_lora_rank"] + m["deepseek2.rope.dimension_count"]) * 2
  once = m["deepseek2.block_count"] * (POS + 1) * row
  assert once <= predicted["decode"]["kv_bytes"] <= 2 * once

def test_the_prediction_adds_up(predicted):
  d, hw = predicted["decode"], predicted["hardware"]
  assert predicted["kernels"] == len(d["kernels"]) > 0
  assert predicted["host_us"] == pytest.approx(HOST_US + hw["host_sync_us"])
  assert d["step_s"] == pytest.approx(sum(k["time_s"] for k in d["kernels"]) + predicted["host_us"] * 1e-6)
  assert predicted["predicted"]["decode_tps"] == pytest.approx(1 / d["step_s"])
  for k in d["kernels"]:
    assert k["time_s"] >= k["floor_s"] and k["time_s"] == pytest.approx(hw["launch_us"] * 1e-6 + k[f"{k['bound']}_s"])

def test_another_checkout_runs_its_own_code(tmp_path):
  """--checkout runs that checkout's code, its steps and its decode loop: a copy of the package that leaves a mark when it
  starts is the one run, and one whose decode steps sleep 20 ms each has that much more host work timed a step."""
  shutil.copytree(ROOT / "tg_ds4", tmp_path / "tg_ds4", ignore=shutil.ignore_patterns("__pycache__"))
  main = tmp_path / "tg_ds4" / "__main__.py"
  main.write_text("import os, pathlib; pathlib.Path(os.environ['GPU_COST_MARK']).write_text('ran')\n" + main.read_text())
  runner = tmp_path / "tg_ds4" / "runtime" / "runner.py"
  src = runner.read_text()
  step = next(line for line in src.splitlines(keepends=True) if line.startswith("  def _where("))  # every decode step binds its position
  runner.write_text(src.replace(step, step + "    time.sleep(0.02)\n"))
  r = run_predict(checkout=tmp_path, env={"GPU_COST_MARK": str(tmp_path / "mark")})
  assert r.returncode == 0, r.stderr[-3000:]
  assert (tmp_path / "mark").read_text() == "ran"
  res = json.loads(r.stdout)
  assert res["predicted"]["decode_tps"] > 0
  assert 20_000 <= res["host_python_us"] <= 40_000, res["host_python_us"]

def test_a_folder_that_is_no_checkout_is_one_line(tmp_path):
  r = run_predict(checkout=tmp_path)
  assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "not a checkout" in r.stderr, r.stderr

def test_measurement_files_are_read_as_written(tmp_path):
  """A device run's CSV (gpu_measured.py device) round-trips: kernels timed one by one give their op classes."""
  step = {"tokens": 1, "kernels": [{"block": "blk.0", "op": op, "name": f"k{i}", "global": [64, 1, 1], "local": [32, 1, 1],
                                    "rounds": {"dram": 10, "l2": 1, "alu": 0}, "instructions": 100, "flops": 10, "tc_flops": 0,
                                    "bytes": {"1:load": 1 << 20}} for i, op in enumerate(["norm", "experts", "experts"])]}
  gpu_cost.write_measurement(p := tmp_path / "h100-x-test.csv", gpu_cost.measurement_rows(step, measured_us=[5.0, 7.0, 8.0], step_us=40.0,
                                                                                          host=(12.0, 1)))
  assert [r["kind"] for r in csv.DictReader(open(p))] == ["kernel"] * 3 + ["step", "host"]
  res = gpu_cost.check_measurement(p, gpu_cost.H100)
  assert res["classes"]["experts"][1] == 15.0 and res["classes"]["norm"][1] == 5.0 and res["step"][1] == 40.0
  kernels = sum(gpu_cost.kernel_time(k, gpu_cost.H100)["time_s"] for k in step["kernels"]) * 1e6
  assert res["step"][0] == pytest.approx(kernels + 12.0 + gpu_cost.H100.host_sync_us)  # the host's share: timed + fitted

PIPES_SCRIPT = """
import json
from tg_ds4.backend import compat
compat.lowering_target("NULL:CUDA:sm_90")
from tinygrad import Tensor, dtypes
from tg_ds4.backend.compat import Ops
from tg_ds4.tools import gpu_record
def slots(t):  # issue slots a value of the one kernel of t
  (prg,) = [c.src[0] for c in compat.realize.compile_linear(Tensor.linear_with_vars(t)[0]).src if c.src[0].op is Ops.PROGRAM]
  f = gpu_record.features(prg, (), frozenset(), {})
  return f["instructions"] * prg.arg.global_size[0] * prg.arg.local_size[0] / t.numel()
n = 1 << 20
print(json.dumps({"convert": slots(Tensor.empty(n, dtype=dtypes.uint8).cast(dtypes.float32)), "add": slots(Tensor.empty(n) + 1.0),
                  "bits": slots((Tensor.empty(n, dtype=dtypes.uint8).cast(dtypes.uint32) | 0x4B000000).bitcast(dtypes.float32) - 2.0 ** 23)}))
"""

def test_conversions_take_the_slots_of_their_pipe():
  """An NVIDIA SM converts 16 values a clock against 128 FP32 adds (tools/gpu_record.py PIPES): a kernel that converts
  each byte to float takes 8 slots a value, over 3x what one that adds to each float takes (bound by its loads and
  stores, 4 slots a warp instruction), and building the float from the byte's bits (an or and a subtract: its byte
  loads bind it) takes fewer than the conversion. Counted as one slot an instruction, the conversion costs about the
  add and less than the bits."""
  r = subprocess.run([sys.executable, "-c", PIPES_SCRIPT], capture_output=True, text=True, timeout=300,
                     env={**os.environ, "DEV": "NULL:CUDA:sm_90", "PYTHONPATH": str(ROOT)})
  assert r.returncode == 0, r.stderr[-3000:]
  s = json.loads(r.stdout.strip().splitlines()[-1])
  assert s["convert"] == 8 and s["convert"] >= 3 * s["add"] and s["bits"] < s["convert"], s

TF32_SCRIPT = """
import json
from tg_ds4.backend import compat
compat.lowering_target("NULL:CUDA:sm_90")
from tinygrad import Tensor, dtypes
from tg_ds4.backend.compat import Ops
from tg_ds4.tools import gpu_record
def tc_flops(dt):
  t = Tensor.empty(256, 256, dtype=dt).matmul(Tensor.empty(256, 256, dtype=dt), dtype=dtypes.float32)
  prgs = [c.src[0] for c in compat.realize.compile_linear(Tensor.linear_with_vars(t)[0]).src if c.src[0].op is Ops.PROGRAM]
  return sum(gpu_record.features(p, (), frozenset(), {})["tc_flops"] for p in prgs)
print(json.dumps({"float32": tc_flops(dtypes.float32), "half": tc_flops(dtypes.float16)}))
"""

def test_float32_takes_no_tf32_tensor_cores_on_null_cuda():
  """A GPU's tinygrad skips TF32 tensor cores for float32 inputs (unless ALLOW_TF32) by its device's name, which on NULL
  is not CUDA: lowered for NULL:CUDA a float32 matmul (decode's attention scores) took TF32 MMAs a GPU never runs, and
  10-bit mantissas besides. Half inputs keep their tensor cores."""
  r = subprocess.run([sys.executable, "-c", TF32_SCRIPT], capture_output=True, text=True, timeout=300,
                     env={**os.environ, "DEV": "NULL:CUDA:sm_90", "PYTHONPATH": str(ROOT)})
  assert r.returncode == 0, r.stderr[-3000:]
  s = json.loads(r.stdout.strip().splitlines()[-1])
  assert s["float32"] == 0 and s["half"] > 0, s
