"""backend/compat.py: importing tg_ds4 changes nothing in tinygrad; loading a model for a CPU or GPU renderer installs our kernel
heuristic, unless TG_DS4_KERNEL_OPTS=0 or tinygrad is not the release its internals were written for (then one warning
and stock tinygrad). Each case runs in a fresh process: the patches are process-wide."""
import json, os, pathlib, subprocess, sys

DS3 = pathlib.Path(__file__).parent / "fixtures" / "deepseek2" / "ds3" / "ds3-Q4_0.gguf"

PROBE = r"""
import json, sys
import tinygrad.codegen as cg
from tinygrad.codegen.opt import heuristic
from tinygrad.engine import worker
from tinygrad.renderer.cstyle import ClangRenderer
hooks = lambda: [heuristic.hand_coded_optimizations, cg.memory_coalescing, worker._init_worker, ClangRenderer.extra_matcher]
stock = hooks()
if sys.argv[1] == "old": import importlib.metadata as md; real = md.version; md.version = lambda n: "0.13.0" if n == "tinygrad" else real(n)
import tg_ds4, tg_ds4.runtime.runner, tg_ds4.server.app, tg_ds4.backend.cpu.kernel_opts, tg_ds4.backend.cpu.replay  # all, CPU ones too
after_import = [a is b for a, b in zip(hooks(), stock)]
from tg_ds4.backend.compat import fast_replay_on
from tg_ds4.runtime.runner import Runner
Runner.load(sys.argv[2], max_ctx=32)
print(json.dumps({"import": after_import, "load": [a is b for a, b in zip(hooks(), stock)], "fast_replay": fast_replay_on()}))
"""

def probe(case: str, dev: str = "CPU", **env) -> tuple[dict, str]:
  r = subprocess.run([sys.executable, "-c", PROBE, case, str(DS3)], capture_output=True, text=True, timeout=300,
                     env={**os.environ, "DEV": dev, "TG_DS4_STEP_CACHE": "0", **env})
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr

def test_import_changes_nothing_and_a_cpu_load_installs():
  res, err = probe("cpu")
  assert res == {"import": [True] * 4, "load": [False] * 4, "fast_replay": True}, res
  assert "tinygrad" not in err

def test_off_switch_keeps_stock_tinygrad():
  res, _ = probe("cpu", TG_DS4_KERNEL_OPTS="0")
  assert res["import"] == [True] * 4 and res["load"] == [True] * 4

def test_another_tinygrad_release_runs_stock_with_one_warning():
  res, err = probe("old")
  assert res == {"import": [True] * 4, "load": [True] * 4, "fast_replay": False}, res
  assert err.count("tinygrad 0.13.0 is installed") == 1, err

def test_a_device_with_neither_a_cpu_nor_a_gpu_renderer_stays_stock():
  res, _ = probe("cpu", dev="NULL")
  assert res["import"] == [True] * 4 and res["load"] == [True] * 4

def test_a_gpu_renderer_installs_the_heuristic():
  """PYTHON emulates a GPU (workgroups, shared memory): the packed GEMVs' opts (backend/gpu/kernel_opts.py) apply there."""
  res, _ = probe("cpu", dev="PYTHON")
  assert res["import"] == [True] * 4 and res["load"] == [False] * 4

def test_tinygrad_internals_are_imported_in_compat_only():
  """One seam: outside backend/compat.py, tg_ds4 imports only what the tinygrad package itself exports."""
  import ast
  root, seen = pathlib.Path(__file__).parents[1], []
  for p in [*(root / "tg_ds4").rglob("*.py"), *(root / "scheduling").glob("*.py"), *(root / "profiles").glob("*.py")]:
    if p == root / "tg_ds4" / "backend" / "compat.py": continue
    for node in ast.walk(ast.parse(p.read_text())):
      names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
      seen += [f"{p.relative_to(root)}: {n}" for n in names if n.startswith("tinygrad.")]
  assert not seen, seen

RECYCLE = r"""
import sys
from tinygrad import Tensor
lower = lambda n: (Tensor.ones(n, n).contiguous().sum(1).softmax() + 1).realize()  # several kernels: compiled in the pool
lower(60)                                        # tinygrad's pool starts, with tinygrad's own worker initializer
from tg_ds4.runtime.runner import Runner
Runner.load(sys.argv[1], max_ctx=32)             # installs the CPU heuristic
for n in range(61, 67): lower(n)                 # workers recycled after every task (BEAM_MAX_TASKS_PER_CHILD=1)
print("done")
"""

def test_a_compile_pool_started_before_a_model_load_keeps_working():
  """A pool started before the heuristic is installed would respawn its workers with tinygrad's initializer, which
  cannot be pickled by name once ours replaces it: the pool's worker thread would die and the next compile wait forever
  (a hung suite). install() shuts such a pool down."""
  r = subprocess.run([sys.executable, "-c", RECYCLE, str(DS3)], capture_output=True, text=True, timeout=120,
                     env={**os.environ, "DEV": "CPU", "PARALLEL": "2", "BEAM_MAX_TASKS_PER_CHILD": "1", "TG_DS4_STEP_CACHE": "0",
                          "TG_DS4_PROGRAM_CACHE": "0"})  # every kernel compiled here, in the pool
  assert r.returncode == 0 and r.stdout.strip().endswith("done"), r.stderr[-3000:]
  assert "PicklingError" not in r.stderr, r.stderr[-3000:]

def test_a_device_buffer_is_read_back_by_its_allocator_alone():
  """host_copy reads a realized buffer on a GPU-style device (PYTHON) by the allocator's copy (compat.copy_out), the same
  bytes as tinygrad's own read, views at an offset included, without running tinygrad's copy program (~200 us of
  Python a token in a GPU's decode loop)."""
  import numpy as np
  from tinygrad import Tensor
  from tinygrad.engine import realize
  from tg_ds4.backend.buffers import host_copy
  from tinygrad import dtypes
  from tg_ds4.backend.compat import Buffer, copy_out
  t = (Tensor(np.arange(24, dtype=np.int32), device="PYTHON").reshape(4, 6) * 3).contiguous().realize()
  want = t.numpy()
  runs, real = [], realize.run_linear
  realize.run_linear = lambda *a, **k: (runs.append(1), real(*a, **k))[1]
  try: got = host_copy(t.reshape(6, 4))
  finally: realize.run_linear = real
  assert runs == [] and got.shape == (6, 4) and np.array_equal(got, want.reshape(6, 4))
  base = t.uop.buffer
  view = Buffer("PYTHON", 5, dtypes.int32, base=base, offset=7 * 4).ensure_allocated()
  assert np.array_equal(np.frombuffer(copy_out(view), np.int32), want.reshape(-1)[7:12])
