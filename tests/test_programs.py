"""The program cache (tg_ds4/backend/programs.py): a second process takes the kernels a first one lowered and computes
the same bytes; a corrupt entry is lowered again; a process whose heuristic was changed by hand reads and writes nothing."""
import json, os, subprocess, sys

import numpy as np

SCRIPT = r"""
import json, sys
import numpy as np
import tinygrad.codegen as cg
from tinygrad import Tensor
from tg_ds4 import backend
lowered = []
do_to_program = cg.do_to_program
cg.do_to_program = lambda ast, ren: lowered.append(1) or do_to_program(ast, ren)
backend.prepare_device("CPU")
x = Tensor(np.arange(64 * 48, dtype=np.float32).reshape(64, 48) / 1000)
np.save(sys.argv[1], ((x @ x.T).softmax(-1) * 3 + x.sum(0)[:1]).numpy())
print(json.dumps({"lowered": len(lowered)}))
"""

def _run(tmp_path, name: str) -> tuple[int, np.ndarray]:
  env = {**os.environ, "DEV": "CPU", "TG_DS4_CACHE": str(tmp_path), "TG_DS4_PROGRAM_CACHE": "1", "PARALLEL": "0"}
  r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / f"{name}.npy")], capture_output=True, text=True, env=env, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])["lowered"], np.load(tmp_path / f"{name}.npy")

def test_a_second_process_lowers_nothing_and_computes_the_same(tmp_path):
  (n1, a), (n2, b) = _run(tmp_path, "first"), _run(tmp_path, "second")
  entries = sorted((tmp_path / "programs").glob("*.prg"))
  assert n1 >= 2 and len(entries) == n1 and n2 == 0, (n1, n2, len(entries))
  assert a.tobytes() == b.tobytes()
  data = bytearray(entries[0].read_bytes())
  data[len(data) // 2] ^= 0xFF
  entries[0].write_bytes(bytes(data))  # fails its checksum: that kernel alone is lowered again, and rewritten
  n3, c = _run(tmp_path, "third")
  assert n3 == 1 and c.tobytes() == a.tobytes() and _run(tmp_path, "fourth")[0] == 0

def test_a_heuristic_changed_by_hand_reads_and_writes_nothing(monkeypatch):
  from tg_ds4.backend import programs
  from tg_ds4.backend.cpu import kernel_opts
  assert programs._environment() is not None
  monkeypatch.setattr(kernel_opts, "CPU", kernel_opts.SSE if kernel_opts.CPU is not kernel_opts.SSE else kernel_opts.AVX2)
  assert programs._environment() is None
