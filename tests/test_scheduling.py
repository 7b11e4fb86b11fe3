"""Kernel budgets per block kind and backend (scheduling/budgets.toml), counted by scheduling/count.py in a subprocess
(nothing runs): decode and prefill chunk on DEV=NULL for the CPU, decode lowered for CUDA (NVRTC), Metal and WebGPU, on the
deepseek2, deepseek4, DSA, gpt2, bitnet and gemma4 fixtures and the real dense models; CUDA's decode kernels with a poor
launch shape (count.py's launch_flaws) within their own budgets; and no block may read a dequantized copy of its weights."""
import json, os, pathlib, subprocess, sys, tomllib

import pytest

from tg_ds4.io.registry import resolve

import background

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUDGETS = tomllib.loads((ROOT / "scheduling" / "budgets.toml").read_text())
FIXTURES = ["deepseek2/ds2lite/ds2lite-Q4_0.gguf", "deepseek2/ds3/ds3-Q4_0.gguf", "deepseek2/glm/glm-Q8_0.gguf", "deepseek2/youtu/youtu-Q8_0.gguf",
            "deepseek2/ds3k/ds3k-Q4_K_M.gguf", "deepseek4/flash/flash-MXFP4.gguf", "deepseek4/flash/flash-IQ2_XXS.gguf",
            "gpt2/gpt2-Q8_0.gguf", "bitnet/bitnet-TQ1_0.gguf", "gemma4/gemma4-ple-Q8_0.gguf", "gemma4/gemma4-plain-F32.gguf",
            "dsa/ds32/ds32-Q8_0.gguf", "dsa/glmdsa/glmdsa-Q8_0.gguf"]
# realistic dims only, and the ternary file (its TQ1_0 base-3 unpack must stay in the GEMV too)
BYTES_FILES = {"ds3k-Q4_K_M.gguf", "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf", "bitnet-TQ1_0.gguf"}

# run -> (budget backend, DEV, steps, files): decode on every file for the CPU; for the GPU renderers every block kind
# once (ds3: MLA dense and MoE; glm-dsa: all three DSA kinds; deepseek4's three; gpt2, bitnet, the two gemma4 files,
# gemma3, qwen2), between them every packed format of the other files but IQ2_XXS (K-quants in gemma3 and qwen2,
# TQ1_0 in bitnet); the prefill chunk on one file of each block kind, the V4 one the IQ2_XXS file, whose chunk has the
# most kernels
FILES = [str(ROOT / "tests" / "fixtures" / f) for f in FIXTURES]
REAL = {m: str(resolve(m)) for m in ("smollm2", "gemma3-270m", "qwen2.5-coder-0.5b")}
GPU_FILES = [f for f in FILES if f.endswith(("ds3-Q4_0.gguf", "flash-MXFP4.gguf", "gpt2-Q8_0.gguf", "bitnet-TQ1_0.gguf", "gemma4-ple-Q8_0.gguf",
                                             "gemma4-plain-F32.gguf", "glmdsa-Q8_0.gguf"))] + [REAL["gemma3-270m"], REAL["qwen2.5-coder-0.5b"]]
PREFILL_FILES = [f for f in FILES if f.endswith(("ds3-Q4_0.gguf", "flash-IQ2_XXS.gguf", "gpt2-Q8_0.gguf", "bitnet-TQ1_0.gguf", "gemma4-ple-Q8_0.gguf",
                                                 "gemma4-plain-F32.gguf", "ds32-Q8_0.gguf", "glmdsa-Q8_0.gguf"))] + \
  [REAL["smollm2"], REAL["gemma3-270m"]]
TARGETS = {"CPU": ("CPU", "NULL", "decode", FILES + [REAL["smollm2"], REAL["gemma3-270m"]]),
           "CPU-prefill": ("CPU", "NULL", "prefill", PREFILL_FILES),
           "CUDA": ("CUDA", "NULL:CUDA:sm_90", "decode", GPU_FILES), "METAL": ("METAL", "NULL:METAL", "decode", GPU_FILES),
           "WEBGPU": ("WEBGPU", "NULL:WGSL", "decode", GPU_FILES)}
# the CPU runs count kernels (`count.py --kernels-only`: the same counts from the schedule, nothing lowered)
# but for the files whose bytes test_no_dequantized_weight_copies reads; the GPU runs lower with their renderer's opts,
# which must render
WITH_BYTES = {"CPU": BYTES_FILES, "CPU-prefill": set()}

LAUNCH_CHECKED = {"CUDA"}  # backends whose decode kernels' launch shapes have budgets (budgets.toml [launch])

JOBS = background.Jobs()

def _count(run: str, jobs: background.Jobs) -> dict:
  backend, dev, steps, files = TARGETS[run]
  env = {**os.environ, "DEV": dev, "PYTHONPATH": str(ROOT)}
  env.pop("DEBUG", None)
  runs = [(files, [])] if (full := WITH_BYTES.get(run)) is None else \
    [(fs, flags) for fs, flags in (([f for f in files if pathlib.Path(f).name in full], []),
                                   ([f for f in files if pathlib.Path(f).name not in full], ["--kernels-only"])) if fs]
  got = {}
  for fs, flags in runs:
    proc = jobs.popen([sys.executable, str(ROOT / "scheduling" / "count.py"), *fs, "--json", "--steps", steps, *flags], env=env,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert res["backend"] == {"NULL": "NULL"}.get(dev, backend) and sorted(res["files"]) == sorted(fs)
    got.update(res["files"])
  return got

# each run lowers a dozen files in one single-threaded process: a background job (see background.py)
def start_job(run: str) -> None: JOBS.start(run, lambda jobs: _count(run, jobs))

def counts(run: str) -> dict:
  start_job(run)  # (when the test runs without the conftest hook)
  return JOBS.result(run)

@pytest.mark.parametrize("run", [pytest.param(r, marks=pytest.mark.background(r)) for r in TARGETS])
def test_kernel_budgets(run):
  seen, (backend, _, steps, _) = set(), TARGETS[run]
  for path, r in counts(run).items():
    for step in steps.split(","):
      for kind, c in r[step].items():
        assert kind in BUDGETS[step] and backend in BUDGETS[step][kind], f"no {backend} {step} budget for block kind {kind!r} ({path})"
        budget = BUDGETS[step][kind][backend]
        assert c["kernels"] <= budget, f"{pathlib.Path(path).name} {backend} {step} {kind}: {c['kernels']} kernels > budget {budget}"
        if backend in LAUNCH_CHECKED:  # (count.py reports these for every GPU renderer; CUDA's are budgeted)
          flawed = BUDGETS["launch"].get(kind, {}).get(backend, 0)
          assert c["launch"] <= flawed, f"{pathlib.Path(path).name} {backend} {step} {kind}: {c['launch']} kernels with a poor launch shape " \
                                        f"(scheduling/count.py launch_flaws) > budget {flawed}"
        seen.add((step, kind))
  for step, kind in sorted(seen):
    print(f"\n{backend} {step} {kind}: max {max(r[step][kind]['kernels'] for r in counts(run).values() if kind in r[step])}"
          f" (budget {BUDGETS[step][kind][backend]})", end="")
  kinds = ("MLA dense", "MLA MoE", "GQA dense", "GQA dense sandwich SWA", "GQA dense layernorm", "GQA dense sub-norm",
           "GQA dense sandwich V-norm SWA PLE shared-KV", "MLA MoE DSA", "MLA MoE DSA-shared", "DS4 SWA hash-MoE",
           "DS4 CSA MoE", "DS4 HCA MoE")
  assert {(steps, k) for k in kinds} <= seen

@pytest.mark.background("CPU")
def test_no_dequantized_weight_copies():
  read = {pathlib.Path(path).name: r for path, r in counts("CPU").items() if pathlib.Path(path).name in BYTES_FILES}
  assert read.keys() == BYTES_FILES
  for path, r in read.items():
    for kind, c in r["decode"].items():
      if (limit := BUDGETS["bytes_ratio"].get(kind)) is not None:
        assert c["bytes"] <= limit * c["packed"], f"{pathlib.Path(path).name} {kind}: {c['bytes'] / c['packed']:.2f}x packed bytes > {limit}"
