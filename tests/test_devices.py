"""Devices other than the CPU, on this CPU-only machine: weights streamed onto a device in bounded pieces (host memory
while loading stays the device copy plus one piece, not a second copy of the file), and a deepseek2 MoE fixture decoded
token by token on DEV=PYTHON, tinygrad's emulator of GPU-style execution (launch dimensions, local sizes, the GPU
heuristic's kernels; no CPU machinery), against the stored transformers references. The GPU renderers' lowering is
tests/test_scheduling.py's."""
import json, os, pathlib, subprocess, sys

import gguf
import numpy as np

from tg_ds4.layers import UPLOAD_PIECE

ROOT = pathlib.Path(__file__).parent / "fixtures"

UPLOAD = r"""
import json, pathlib, sys
import numpy as np
from tg_ds4.gguf import GGUFFile
status = lambda k: int(pathlib.Path("/proc/self/status").read_text().split(k + ":")[1].split()[0]) * 1024
gf = GGUFFile(sys.argv[1])
pathlib.Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
base = status("VmRSS")
ts = {n: gf.tensor(n, "PYTHON") for n in gf.infos}; [t.blocks.realize() for t in ts.values()]
peak = status("VmHWM")
file = np.memmap(sys.argv[1], mode="r")
same = all(bytes(t.blocks.uop.base.buffer.as_memoryview(force_zero_copy=True)) == bytes(file[i.offset:i.offset + i.nbytes])
           for n, i in gf.infos.items() for t in [ts[n]])
print(json.dumps({"grew": peak - base, "device": sum(i.nbytes for i in gf.infos.values()), "same": same}))
"""

def test_weights_stream_onto_a_device_in_bounded_pieces(tmp_path):
  """A 320 MB file onto the PYTHON device, whose memory is host memory: the load's peak host memory is the device copy
  plus at most two pieces in flight (measured: 384 MiB for 320 MiB), where tinygrad's own disk-to-device copy (the file
  mapped whole, every page touched while the device copy fills) grew it by 514 MiB."""
  path, rng = tmp_path / "big.gguf", np.random.default_rng(0)
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_tensor("token_embd.weight", rng.integers(0, 255, (64, 4 << 20), dtype=np.uint8).view(np.float32).reshape(64, 1 << 20))  # 256 MB
  w.add_tensor("output.weight", rng.standard_normal((16, 1 << 20)).astype(np.float32))  # 64 MB
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  r = subprocess.run([sys.executable, "-c", UPLOAD, str(path)], capture_output=True, text=True, timeout=300,
                     env={**os.environ, "DEV": "CPU"})
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads(r.stdout.strip().splitlines()[-1])
  print(f"\nload onto PYTHON: host memory grew {res['grew'] / 2**20:.0f} MiB for {res['device'] / 2**20:.0f} MiB of weights")
  assert res["same"], "a tensor's device bytes differ from the file's"
  assert res["device"] >= path.stat().st_size - (1 << 20)
  assert res["grew"] <= res["device"] + 2 * UPLOAD_PIECE, res

DECODE = r"""
import json, pathlib, sys
import numpy as np
from tinygrad import Device
from tg_ds4.runner import Runner
path, ids = sys.argv[1], json.loads(sys.argv[2])
r = Runner.load(path, max_ctx=64)
rows = [r.decode(t, i).numpy()[0, 0] for i, t in enumerate(ids)]
np.save(sys.argv[3], np.stack(rows))
print(json.dumps({"device": Device.DEFAULT, "replayed": type(r._jits["decode"].captured).__name__}))
"""

def test_moe_fixture_decodes_on_the_emulated_gpu(tmp_path):
  """ds3 Q4_0 (MLA, 4 expert groups, sigmoid routing) decoded for 3 tokens through the captured step on DEV=PYTHON
  (~40 s a token), against transformers on the file's dequantized weights: measured 7.2e-7, 1.2e-6, 4.8e-7"""
  fam = ROOT / "deepseek2" / "ds3"
  man = json.loads((fam / "manifest.json").read_text())
  g, ids = man["ggufs"]["Q4_0"], man["token_ids"][:3]
  r = subprocess.run([sys.executable, "-c", DECODE, str(fam / g["file"]), json.dumps(ids), str(tmp_path / "rows.npy")],
                     capture_output=True, text=True, timeout=900, env={**os.environ, "DEV": "PYTHON", "TG_DS4_STEP_CACHE": "0"})
  assert r.returncode == 0, r.stderr[-3000:]
  assert json.loads(r.stdout.strip().splitlines()[-1]) == {"device": "PYTHON", "replayed": "CapturedJit"}  # tinygrad's own replay
  ours, ref = np.load(tmp_path / "rows.npy"), np.load(fam / g["logits_hfdq"])[:len(ids)]
  rel = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(ours, ref)]
  print(f"\nds3 Q4_0 on PYTHON vs transformers (dequantized weights): {', '.join(f'{x:.1e}' for x in rel)}")
  assert max(rel) <= 5e-5, rel
