"""quant/cgemm.py: a prefill chunk's float GEMM over a panel copy as a C kernel with vector accumulators. It must give
exactly the sums of tinygrad's kernel of the same product (the fallback, `TG_DS4_C_GEMM=0`), for each CPU kind's
statement shape, with and without a bias or residual added, and the product itself within float32 rounding of numpy's
float64 one."""
import numpy as np
import pytest
from tinygrad import Tensor, dtypes

from tg_ds4 import backend
from tg_ds4.backend.compat import Ops
from tg_ds4.quant.formats import QTYPE_BY_NAME, QTensor, panel_gemm

pytestmark = pytest.mark.skipif(backend.capabilities("CPU").c_gemm is None,
                                reason="needs an x86 CPU with AVX2 and clang, tinygrad 0.14's internals")

def _uses(t: Tensor, name: str) -> bool:
  return any(name in u.arg.name for u in t.uop.toposort() if u.op is Ops.SINK and hasattr(u.arg, "name"))

@pytest.mark.parametrize("unit,rows", [("avx2", 16), ("avx512", 24), ("avx512", 128)])
def test_same_sums_as_tinygrads_kernel(unit, rows, monkeypatch):
  from tg_ds4.backend.cpu import kernel_opts
  monkeypatch.setattr(kernel_opts, "CPU", {"avx2": kernel_opts.AVX2, "avx512": kernel_opts.AVX512}[unit])
  assert backend.capabilities("CPU").c_gemm == kernel_opts.CPU.gemm
  rng, qt, n = np.random.default_rng(1), QTYPE_BY_NAME["Q4_0"], kernel_opts.CPU.panel
  blocks = rng.integers(0, 256, (256, 1024 // 32, qt.nbytes), dtype=np.uint8)
  blocks[..., :2] = (rng.standard_normal((256, 32, 1)) * 0.01).astype(np.float16).view(np.uint8)
  w = QTensor(Tensor(blocks).realize(), qt, (256, 1024)).dequant(dtypes.float32).realize()
  x, res = rng.standard_normal((1, rows, 1024)).astype(np.float32), rng.standard_normal((1, rows, 256)).astype(np.float32)
  ours = panel_gemm(Tensor(x), w, n)
  assert _uses(ours, "panel_gemm")
  ours, with_res = ours.numpy(), (panel_gemm(Tensor(x), w, n) + Tensor(res)).numpy()
  monkeypatch.setenv("TG_DS4_C_GEMM", "0")
  theirs = panel_gemm(Tensor(x), w, n)
  assert not _uses(theirs, "panel_gemm")
  assert np.array_equal(ours, theirs.numpy()) and np.array_equal(with_res, (panel_gemm(Tensor(x), w, n) + Tensor(res)).numpy())
  ref = x.astype(np.float64) @ w.numpy().astype(np.float64).T
  np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())

def test_rows_that_fill_no_statement_take_tinygrads_kernel():
  """A chunk whose row count is not a multiple of a statement's rows (a prompt's last chunk) keeps tinygrad's kernel."""
  rng = np.random.default_rng(2)
  tokens, _ = backend.capabilities("CPU").c_gemm
  w = Tensor(rng.standard_normal((64, 256)).astype(np.float32)).realize()
  x = rng.standard_normal((tokens + 1, 256)).astype(np.float32)
  y = panel_gemm(Tensor(x), w, backend.capabilities("CPU").gemm_panel)
  assert not _uses(y, "panel_gemm")
  np.testing.assert_allclose(y.numpy(), x.astype(np.float64) @ w.numpy().astype(np.float64).T, rtol=1e-5, atol=1e-4)
