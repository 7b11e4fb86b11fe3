"""Kernel budgets per decode block kind (scheduling/budgets.toml), counted on DEV=NULL in a subprocess (nothing runs),
on the deepseek2 fixtures and the real dense models; and no block may read a dequantized copy of its weights."""
import json, os, pathlib, subprocess, sys, tomllib

import pytest

from tg_ds4.registry import resolve

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUDGETS = tomllib.loads((ROOT / "scheduling" / "budgets.toml").read_text())
FIXTURES = ["deepseek2/ds2lite/ds2lite-Q4_0.gguf", "deepseek2/ds3/ds3-Q4_0.gguf", "deepseek2/glm/glm-Q8_0.gguf", "deepseek2/youtu/youtu-Q8_0.gguf",
            "deepseek2/ds3k/ds3k-Q4_K_M.gguf", "deepseek4/flash/flash-MXFP4.gguf", "deepseek4/flash/flash-IQ2_XXS.gguf"]
BYTES_FILES = {"ds3k-Q4_K_M.gguf", "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"}  # realistic dims only

@pytest.fixture(scope="module")
def counts() -> dict:
  files = [str(ROOT / "tests" / "fixtures" / f) for f in FIXTURES] + [str(resolve("smollm2")), str(resolve("gemma3-270m"))]
  env = {**os.environ, "DEV": "NULL", "PYTHONPATH": str(ROOT)}
  env.pop("DEBUG", None)
  r = subprocess.run([sys.executable, str(ROOT / "scheduling" / "count.py"), *files, "--json"], env=env, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])

def test_kernel_budgets(counts):
  seen = set()
  for path, kinds in counts.items():
    for kind, c in kinds.items():
      assert kind in BUDGETS, f"no budget for block kind {kind!r} ({path})"
      assert c["kernels"] <= BUDGETS[kind], f"{pathlib.Path(path).name} {kind}: {c['kernels']} kernels > budget {BUDGETS[kind]}"
      seen.add(kind)
  print("\n" + "\n".join(f"{k}: max {max(c[k]['kernels'] for c in counts.values() if k in c)} (budget {BUDGETS[k]})" for k in sorted(seen)))
  assert {"MLA dense", "MLA MoE", "GQA dense", "head+sampling", "DS4 SWA hash-MoE", "DS4 CSA MoE", "DS4 HCA MoE"} <= seen

def test_no_dequantized_weight_copies(counts):
  for path, kinds in counts.items():
    if pathlib.Path(path).name not in BYTES_FILES: continue
    for kind, c in kinds.items():
      if (limit := BUDGETS["bytes_ratio"].get(kind)) is not None:
        assert c["bytes"] <= limit * c["packed"], f"{pathlib.Path(path).name} {kind}: {c['bytes'] / c['packed']:.2f}x packed bytes > {limit}"
