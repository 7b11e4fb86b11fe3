"""backend/cpu/batch_compile.py: one schedule's CPU kernels compiled by one clang process and cut into one object per
kernel give the same results, bit for bit, as each kernel compiled by a clang process of its own (tinygrad's way): an
IQ2_XXS GEMV on llama.cpp's rounding of x (our C with a function-scope table of grid rows), float kernels with constant
pools and vector types, a reduction. Each run in a process of its own with an empty compile cache, so that every kernel
is compiled there (and counted: the program counts the clang processes this process starts)."""
import json, os, subprocess, sys

import numpy as np
import pytest
from tinygrad import Device

from tg_ds4.backend import compat
from tg_ds4.backend.cpu import batch_compile

pytestmark = pytest.mark.skipif(not compat.internals_match() or not isinstance(Device["CPU"].renderer.compiler, compat.ClangCompiler),
                                reason="clang compiles the CPU's kernels on tinygrad 0.14 only")

PROGRAM = r"""
import json
import numpy as np
from tinygrad import Tensor
from tg_ds4 import backend
from tg_ds4.backend import compat
from tg_ds4.quant import settings
from tg_ds4.quant.formats import QTYPES, QTensor, linear
backend.prepare_device("CPU")
rng = np.random.default_rng(3)
raw = rng.integers(0, 256, size=(24, 2, 66), dtype=np.uint8)  # IQ2_XXS: any bytes are valid codes; small fp16 scales
raw[..., 0:2] = (rng.random((24, 2)) * 0.02).astype(np.float16)[..., None].view(np.uint8)
w = QTensor(Tensor(raw).realize(), next(q for q in QTYPES.values() if q.name == "IQ2_XXS"), (24, 512))
x, v = Tensor(rng.standard_normal((3, 512)).astype(np.float32)).realize(), Tensor(np.linspace(-4, 4, 999, dtype=np.float32)).realize()
compiled, compile = [], compat.ClangCompiler.compile
compat.ClangCompiler.compile = lambda self, src: compiled.append(src) or compile(self, src)
with settings.override(numerics="llama.cpp"): gemv = linear(x, w)
outs = [gemv, ((v.exp() + 3.7).sin() * 0.5).tanh(), v.reshape(27, 37).softmax(-1), (v.reshape(27, 37) ** 2).sum(1).sqrt()]
Tensor.realize(*outs)
print(json.dumps({"clang": len(compiled), "outs": [o.numpy().tobytes().hex() for o in outs]}))
"""

def _run(tmp_path, batch: str, parallel: str = "0") -> dict:
  env = {**os.environ, "TG_DS4_BATCH_COMPILE": batch, "PARALLEL": parallel, "XDG_CACHE_HOME": str(tmp_path / f"xdg{batch}{parallel}"),
         "TG_DS4_CACHE": str(tmp_path / f"cache{batch}{parallel}"), "TG_DS4_PROGRAM_CACHE": "0", "DEV": "CPU"}
  r = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=600, env=env)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])

def test_one_clang_process_same_bits(tmp_path):
  """Lowered in the process (PARALLEL=0): one clang process. In tinygrad's compile pool the workers compile each kernel
  as tinygrad does (none in this process), with the same results."""
  alone, batched, pooled = _run(tmp_path, "0"), _run(tmp_path, "1"), _run(tmp_path, "1", parallel="2")
  print(f"\n{alone['clang']} kernels: {alone['clang']} clang processes alone, {batched['clang']} batched")
  assert alone["clang"] >= 6 and batched["clang"] == 1 and pooled["clang"] == 0
  assert batched["outs"] == alone["outs"] and pooled["outs"] == alone["outs"]
  gemv = np.frombuffer(bytes.fromhex(alone["outs"][0]), np.float32)
  assert np.isfinite(gemv).all() and np.abs(gemv).max() > 0  # a GEMV that computed something

def test_what_is_compiled_alone():
  """Sources of another shape than tinygrad's C renderer writes are compiled alone, and so is a batch clang rejects:
  the kernel at fault then fails as it would have."""
  cc = Device["CPU"].renderer.compiler
  good = "typedef float float4 __attribute__((aligned(16),ext_vector_type(4)));\nvoid E_4(float* restrict data0) {\n  data0[0] = 1.0f;\n}"
  assert batch_compile._function(good) == "E_4"
  assert batch_compile._function("static int helper(int x) { return x; }\n" + good) is None
  assert batch_compile._function(good + "\nvoid E_5(float* restrict data0) {\n}") is None
  bad = "void E_6(float* restrict data0) {\n  data0[0] = undefined_name;\n}"
  assert batch_compile.compile_batch(cc, [good, bad]) is None
  with pytest.raises(Exception): batch_compile.compile_all({good: cc, bad: cc})  # noqa: B017  (clang's own error, as alone)
