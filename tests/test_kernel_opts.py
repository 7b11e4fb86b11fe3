"""tg_ds4.backend.cpu.kernel_opts: what the CPU heuristic changes, checked on the kernels tinygrad builds for our matmuls (why
each choice is made is the module's docstring; its speed is a benchmark's, never a test's)."""
import functools

import gguf
import numpy as np
import pytest
from tinygrad import Device, Tensor, dtypes
from tinygrad.codegen.opt import Opt, OptOps
from tinygrad.codegen.opt.postrange import Scheduler
import tinygrad.codegen as cg
from tinygrad.uop.ops import AxisType, Ops, UOp, graph_rewrite

from tg_ds4.backend.cpu import kernel_opts
from tg_ds4.quant.formats import QTYPE_BY_NAME, QTensor, linear, panel_gemm

@pytest.fixture(autouse=True, scope="module")
def installed():  # as when a CPU model is loaded (backend.prepare_device); the rendering tests read the installed rewrites
  kernel_opts.install()

def kernel_sinks(t: Tensor) -> list[UOp]:
  """The kernel ASTs of `t`'s schedule (one call per tensor: scheduling assigns its buffers)."""
  return [c.src[0] for c in t.linear_with_vars()[0].src if c.op is Ops.CALL and c.src[0].op is Ops.SINK]

def schedulers(t: Tensor | list[UOp], renderer=None) -> list[Scheduler]:
  """The kernels of `t` as tinygrad's codegen hands them to the heuristic (the rewrites of `full_rewrite_to_sink` before
  `apply_opts`), for `renderer` (default: the CPU's)."""
  out = []
  for ast in kernel_sinks(t) if isinstance(t, Tensor) else t:
    sink = graph_rewrite(graph_rewrite(ast, cg.multi_pm), cg.pm_mops, bottom_up=True)
    sink = graph_rewrite(sink, cg.pm_load_collapse)
    sink = graph_rewrite(sink, cg.pm_split_ranges + cg.pm_flatten_range, ctx={})
    sink = graph_rewrite(sink, cg.sym + cg.pm_flatten_range)
    sink = graph_rewrite(sink, cg.pm_flatten_range + cg.pm_simplify_ranges, ctx={})
    k = Scheduler(sink, renderer or Device[Device.DEFAULT].renderer)
    k.convert_loop_to_global()
    out.append(k)
  return out

def weight_kernel(ks: list[Scheduler]) -> Scheduler:
  """The GEMV kernel among a linear's kernels (an affine format's x-only block sums are another, quant.linear)."""
  (k,) = [k for k in ks if any(b.src[0].dtype == dtypes.uint8 for b in k.bufs)]
  return k

def packed(name: str, rows: int, cols: int) -> QTensor:
  qt = QTYPE_BY_NAME[name]
  return QTensor(Tensor(np.zeros((rows, cols // qt.block, qt.nbytes), np.uint8)).realize(), qt, (rows, cols))

@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q4_K", "IQ2_XXS"])  # IQ2_XXS: 8 lanes (PACKED_MIN_LANES)
def test_gemv_keeps_lanes_and_core_split_without_row_upcast(name):
  k = weight_kernel(schedulers(linear(Tensor.ones(1, 1, 1024).contiguous().realize(), packed(name, 4096, 1024))))
  theirs, ours = kernel_opts._hand_coded(k.copy()), kernel_opts.cpu_heuristic(k.copy())
  assert any(o.op is OptOps.UPCAST for o in theirs.applied_opts)  # tinygrad's row upcast: what ours leaves out
  assert not any(o.op is OptOps.UPCAST for o in ours.applied_opts), ours.applied_opts
  kept = [o for o in theirs.applied_opts if o.op is not OptOps.UPCAST]
  assert ours.applied_opts[:len(kept)] == kept and all(o.op is OptOps.UNROLL for o in ours.applied_opts[len(kept):])
  lanes = kernel_opts.PACKED_MIN_LANES if name == "IQ2_XXS" else kernel_opts.LANES
  assert np.prod([ours.full_shape[a] for a in ours.axes_of(AxisType.UNROLL)]) >= lanes  # the lane accumulators

@pytest.mark.parametrize("name,rows", [("Q4_1", 2), ("Q4_0", 3), ("Q8_0", 4)])
def test_batched_gemv_upcasts_its_rows_and_splits_weight_rows_over_cores(name, rows):
  """A packed GEMV over a few rows of x (a batched decode step): every row in registers (each unpacked weight value feeds
  all of them) and the split over cores along the weight's rows, never the x rows (each core would unpack the whole
  weight); the lane accumulators stay. 8 rows (above GEMV_ROWS) are the heuristic's again."""
  w = packed(name, 4096, 1024)
  k = weight_kernel(schedulers(linear(Tensor.ones(rows, 1, 1024).contiguous().realize(), w)))
  ours = kernel_opts.cpu_heuristic(k.copy())
  idx = kernel_opts.weight_operand(ours).src[1].get_idx().backward_slice
  up = [a for a in ours.axes_of(AxisType.UPCAST) if ours.rngs[a] not in idx]
  assert np.prod([ours.full_shape[a] for a in up]) == rows, ours.applied_opts
  threads = [a for a in ours.axes_of(AxisType.THREAD)]
  assert threads and all(ours.rngs[a] in idx for a in threads), ours.applied_opts
  assert np.prod([ours.full_shape[a] for a in ours.axes_of(AxisType.UNROLL)]) >= kernel_opts.LANES
  k8 = weight_kernel(schedulers(linear(Tensor.ones(8, 1, 1024).contiguous().realize(), w)))
  assert kernel_opts._rows_first(k8) is k8

_GEMV_4_ROWS = """
import sys, numpy as np
from tinygrad import Device, Tensor
from tg_ds4.backend import prepare_device
from tg_ds4.quant.formats import QTYPE_BY_NAME, QTensor, linear
prepare_device("CPU")
rng, qt = np.random.default_rng(0), QTYPE_BY_NAME["Q4_1"]
blocks = rng.integers(0, 256, (256, 512 // qt.block, qt.nbytes), dtype=np.uint8)
blocks[..., :4] = np.frombuffer(np.full((256, 512 // qt.block, 2), 0.01, np.float16).tobytes(), np.uint8).reshape(256, -1, 4)
x = Tensor(rng.standard_normal((4, 1, 512), dtype=np.float32))
np.save(sys.argv[1], linear(x, QTensor(Tensor(blocks), qt, (256, 512))).numpy())
print(" ".join(Device["CPU"].renderer.compiler.args))
"""

def test_batched_gemv_compiles_with_the_vectorizer_cap_and_the_same_sums(tmp_path):
  """The CPU compiler gets `-mllvm -slp-max-vf` where clang takes it (once, under a cache key of its own); a 4-row packed
  GEMV compiled with and without it gives bitwise the same outputs (the cap picks instructions, it reorders nothing)."""
  import os, subprocess, sys
  from tg_ds4.backend.cpu import compiler
  from tinygrad.runtime.support.compiler_cpu import ClangCompiler
  if not compiler._accepted(os.environ.get("CC", "clang"), compiler.FLAGS): pytest.skip("this C compiler does not take -mllvm -slp-max-vf")
  c = ClangCompiler.__new__(ClangCompiler)
  compiler._clang_init(c, ["x86_64", "native"])  # as tinygrad makes one
  key = c.cachekey
  compiler.add_flags(c); compiler.add_flags(c)
  assert c.args.count(compiler.FLAGS[1]) == 1 and c.cachekey != key
  assert ClangCompiler(["x86_64", "native"]).args == c.args  # made after install(): as a compile worker makes its own
  outs = []
  for cap in ("0", "16"):
    r = subprocess.run([sys.executable, "-c", _GEMV_4_ROWS, str(tmp_path / f"{cap}.npy")], env=os.environ | {"TG_DS4_SLP_MAX_VF": cap},
                       capture_output=True, text=True, check=True)
    assert ("-slp-max-vf=16" in r.stdout) == (cap == "16"), r.stdout
    outs.append(np.load(tmp_path / f"{cap}.npy"))
  assert np.isfinite(outs[0]).all() and np.abs(outs[0]).max() > 0
  np.testing.assert_array_equal(outs[0], outs[1])

def test_addresses_put_the_reduce_loop_last():
  # a + r*34 + b + 1 with r a reduce loop -> a + b + r*34 + 1 (the rewrite the CPU renderer runs, `_ADDRESSES`)
  g, r = UOp.range(8, 1, AxisType.LOOP).cast(dtypes.int), UOp.range(128, 0, AxisType.REDUCE).cast(dtypes.int)
  a, b = g * 4456448, UOp.range(1024, 2, AxisType.LOOP).cast(dtypes.int) * 4352
  x = ((a + r * 34) + b) + 1
  terms = list(graph_rewrite(x, kernel_opts._ADDRESSES).split_uop(Ops.ADD))
  assert [kernel_opts._reduce_key(t)[0] for t in terms] == [0, 0, 1, 2], terms
  ordered = ((a + b) + r * 34) + 1
  assert graph_rewrite(ordered, kernel_opts._ADDRESSES) is ordered  # an ordered address is left as it is

def _q4_blocks(qt, rows: int, rng) -> np.ndarray:
  blocks = rng.integers(0, 256, (rows, 1024 // 32, qt.nbytes), dtype=np.uint8)
  if qt.name == "MXFP4": blocks[..., 0] = rng.integers(118, 128, (rows, 32))  # e8m0 scales 2^-10 .. 2^-1
  else: blocks[..., :4] = (rng.standard_normal((rows, 32, 2)) * 0.01).astype(np.float16).view(np.uint8)  # finite d and m
  return blocks

def test_gemv_unrolls_the_nibble_axis_with_the_same_sums(monkeypatch):
  # MXFP4: a nibble format GEMV'd value by value (no per-block affine form, quant.linear)
  rng, qt = np.random.default_rng(0), QTYPE_BY_NAME["MXFP4"]
  blocks = _q4_blocks(qt, 512, rng)
  x = Tensor(rng.standard_normal((1, 1, 1024)).astype(np.float32)).realize()
  w = lambda rows: QTensor(Tensor(blocks[:rows].copy()).realize(), qt, (rows, 1024))
  k = weight_kernel(schedulers(linear(x, w(512))))
  ours = kernel_opts.cpu_heuristic(k.copy())
  assert np.prod([ours.full_shape[a] for a in ours.axes_of(AxisType.UNROLL)]) == 32  # 16 lanes x both nibbles
  unrolled = linear(x, w(512)).numpy()
  monkeypatch.setattr(kernel_opts, "_unroll_lanes", lambda k: k)
  looped = linear(x, w(256)).numpy()  # another shape, so a kernel compiled without the unroll
  np.testing.assert_array_equal(unrolled[..., :256], looped)  # the same sums in the same order, bit for bit
  np.testing.assert_allclose(unrolled[0, 0], w(512).dequant().numpy() @ x.numpy()[0, 0], rtol=1e-4, atol=1e-4)

@pytest.mark.parametrize("name", ["Q4_0", "Q8_0"])
def test_affine_gemv_unrolls_the_block_sums(name):
  """quant.linear's per-block form (d * (sum x q + c sum x)): the values sharing a lane are a reduce nested in the
  blocks' loop, unrolled inside the 16 lanes; the result is the float64 dot product of the dequantized weight."""
  rng, qt = np.random.default_rng(1), QTYPE_BY_NAME[name]
  blocks = _q4_blocks(qt, 512, rng) if name != "Q8_0" else rng.integers(0, 256, (512, 32, qt.nbytes), dtype=np.uint8)
  if name == "Q8_0": blocks[..., :2] = (rng.standard_normal((512, 32, 1)) * 0.01).astype(np.float16).view(np.uint8)
  x = Tensor(rng.standard_normal((1, 1, 1024)).astype(np.float32)).realize()
  w = QTensor(Tensor(blocks).realize(), qt, (512, 1024))
  k = weight_kernel(schedulers(linear(x, w)))
  ours = kernel_opts.cpu_heuristic(k.copy())
  assert any(kernel_opts._nested_reduce(k, a) for a in k.unrollable_dims)  # the affine form's nested block sum
  assert np.prod([ours.full_shape[a] for a in ours.axes_of(AxisType.UNROLL)]) == 32  # 16 lanes x the 2 values per lane
  ref = w.dequant().numpy().astype(np.float64) @ x.numpy()[0, 0].astype(np.float64)
  got = linear(x, w).numpy()[0, 0]
  assert np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max(), np.abs(got - ref).max() / np.abs(ref).max()

def test_prefill_gemm_on_transposed_weight():
  wt = Tensor.ones(1024, 4096).contiguous().realize()   # [in, out], as layers.Linear stores an unpacked weight
  (k,) = schedulers(Tensor.ones(1, 32, 1024).contiguous().realize() @ wt)
  ours = kernel_opts.cpu_heuristic(k.copy())
  assert ours.applied_opts[:2] == [Opt(OptOps.UPCAST, 0, kernel_opts.CPU.gemm[0]), Opt(OptOps.UPCAST, 1, kernel_opts.CPU.gemm[1])], ours.applied_opts
  assert any(o.op is OptOps.THREAD for o in ours.applied_opts) == (Device[Device.DEFAULT].renderer.global_max[0] > 1)

def test_transposing_unpack_reads_each_block_once():
  (k,) = schedulers(packed("Q5_0", 4096, 896).dequant(dtypes.float32).T.contiguous())  # qwen2.5 widths
  ours = kernel_opts.cpu_heuristic(k.copy())
  assert ours.applied_opts[0].op is OptOps.UPCAST and ours.applied_opts[0].arg == kernel_opts.UNPACK_ROWS, ours.applied_opts
  assert ours.applied_opts[1].op is OptOps.UPCAST and ours.applied_opts[1].arg == 0  # the whole byte run of a block

UNITS = {"avx2": kernel_opts.AVX2, "avx512": kernel_opts.AVX512, "neon": kernel_opts.NEON, "sse": kernel_opts.SSE}

@pytest.mark.parametrize("unit", sorted(UNITS))
def test_panel_gemm_reads_each_panel_contiguously_and_splits_panels_over_cores(unit, monkeypatch):
  """layers.matmul's CPU prefill form: the weight unpacked once as panels `[out/n, in, n]`, each a contiguous run; the GEMM
  holds a few tokens x the outputs of one or two panels per iteration, the panels outermost (each stays in cache while
  every token passes it; also where the output is stored token-major, as when a residual is added to it) and split over
  the cores. For every vector unit the rules know."""
  monkeypatch.setenv("TG_DS4_C_GEMM", "0")  # tinygrad's kernel of the product (quant/cgemm.py's is tests/test_cgemm.py's)
  monkeypatch.setattr(kernel_opts, "CPU", UNITS[unit])
  (tokens, vec), n = kernel_opts.CPU.gemm, kernel_opts.CPU.panel
  x, w = Tensor.ones(1, 32, 1024).contiguous().realize(), packed("Q4_0", 4096, 1024).dequant(dtypes.float32)
  unpack, gemm = schedulers(panel_gemm(x, w, n))
  u = kernel_opts.cpu_heuristic(unpack.copy())
  # a panel row x the whole byte run of a block per iteration
  assert u.applied_opts[:2] == [Opt(OptOps.UPCAST, 4, n), Opt(OptOps.UPCAST, 3, 0)], (unpack.full_shape, u.applied_opts)
  assert gemm.full_shape == [4096 // n, 32, n, 1024]
  g = kernel_opts.cpu_heuristic(gemm.copy())
  assert [(o.axis, o.arg) for o in g.applied_opts if o.op is OptOps.UPCAST] == [(1, tokens)] + ([(0, vec // n)] if vec > n else []) + [(2, n)]
  threads = 2 if Device[Device.DEFAULT].renderer.global_max[0] > 1 else 1
  assert [o.axis for o in g.applied_opts if o.op is OptOps.THREAD] == ([0] if threads > 1 else [])
  residual = schedulers(panel_gemm(x, w, n) + Tensor.ones(1, 32, 4096).contiguous().realize())[-1]
  assert residual.full_shape == [32, 4096 // n, n, 1024]  # stored token-major: the tokens come first
  r = kernel_opts.cpu_heuristic(residual.copy())
  assert r.full_shape == g.full_shape and r.axis_types == g.axis_types and g.full_shape[0] * threads * vec == 4096, (r.full_shape, g.full_shape)

@pytest.mark.parametrize("unit", sorted(UNITS))
def test_per_head_gemm_keeps_the_heads_a_loop(unit, monkeypatch):
  """MLA's attn_v_b over a chunk (mla._absorb): one `[in, out]` weight per head, the heads a batch axis of the weight and
  the latent input alike (both 16 x 512 x 128 floats). It gets the GEMM opts, tokens x outputs per iteration, whichever
  of the two equal inputs comes first, and the right values; a residual added to a panel GEMM's output is no batch. For
  every vector unit the rules know."""
  monkeypatch.setenv("TG_DS4_C_GEMM", "0")  # tinygrad's kernel of the product (quant/cgemm.py's is tests/test_cgemm.py's)
  monkeypatch.setattr(kernel_opts, "CPU", UNITS[unit])
  rng = np.random.default_rng(4)
  x, w = rng.standard_normal((1, 16, 128, 512)).astype(np.float32), rng.standard_normal((16, 512, 128)).astype(np.float32)
  wt = Tensor(w.transpose(0, 2, 1).copy()).realize()                         # [H, out, in], as a dequantized absorb weight
  xt, wc = Tensor(x).realize(), wt.transpose(-1, -2).contiguous().transpose(-1, -2).realize()   # [H, in, out] in memory
  (k,) = schedulers(xt @ wc.transpose(-1, -2))
  t = xt @ wc.transpose(-1, -2)
  ours = kernel_opts.cpu_heuristic(k.copy())
  tokens, vec = kernel_opts.CPU.gemm
  assert [o.arg for o in ours.applied_opts[:2] if o.op is OptOps.UPCAST] == [tokens, vec], ours.applied_opts
  ref = np.einsum("hti,hio->hto", x[0].astype(np.float64), w.astype(np.float64))
  np.testing.assert_allclose(t.numpy()[0], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
  res, n = Tensor.ones(1, 32, 4096).contiguous().realize(), kernel_opts.CPU.panel
  gemm = schedulers(panel_gemm(Tensor.ones(1, 32, 1024).contiguous().realize(), packed("Q4_0", 4096, 1024).dequant(dtypes.float32), n) + res)[-1]
  g = kernel_opts.cpu_heuristic(gemm.copy())
  assert [o.arg for o in g.applied_opts if o.op is OptOps.UPCAST] == [tokens] + ([vec // n] if vec > n else []) + [n], g.applied_opts
  threads = 2 if Device[Device.DEFAULT].renderer.global_max[0] > 1 else 1  # split over the cores: the panels, not the outputs
  assert g.full_shape[0] * threads * vec == 4096 and any(o.op is OptOps.THREAD for o in g.applied_opts) == (threads > 1), g.full_shape

@pytest.mark.parametrize("unit,rows", [("avx2", 16), ("avx512", 24), ("neon", 32), ("sse", 8)])  # (rows: a kernel per unit)
def test_panel_gemm_values(unit, rows, monkeypatch):
  monkeypatch.setenv("TG_DS4_C_GEMM", "0")  # tinygrad's kernel of the product (quant/cgemm.py's is tests/test_cgemm.py's)
  monkeypatch.setattr(kernel_opts, "CPU", UNITS[unit])
  rng, qt, n = np.random.default_rng(1), QTYPE_BY_NAME["Q4_0"], kernel_opts.CPU.panel
  blocks = rng.integers(0, 256, (256, 512 // 32, qt.nbytes), dtype=np.uint8)
  blocks[..., :2] = (rng.standard_normal((256, 16, 1)) * 0.01).astype(np.float16).view(np.uint8)
  w = QTensor(Tensor(blocks).realize(), qt, (256, 512)).dequant(dtypes.float32)
  x, res = rng.standard_normal((1, rows, 512)).astype(np.float32), rng.standard_normal((1, rows, 256)).astype(np.float32)
  ref = x.astype(np.float64) @ w.numpy().astype(np.float64).T
  np.testing.assert_allclose(panel_gemm(Tensor(x), w, n).numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
  # stored token-major (a residual added): the loops swapped to put the panels outermost
  np.testing.assert_allclose((panel_gemm(Tensor(x), w, n) + Tensor(res)).numpy(), ref + res, rtol=1e-5, atol=1e-5 * np.abs(ref).max())

def test_chunk_attention_scores_share_each_key_load_and_values_take_the_gemm():
  """MLA over a chunk (nn/mla.py): the scores are lane dot products of 32 queries per head against cached keys of a
  symbolic count; the rule upcasts QUERY_ROWS query rows and keeps the lanes. The probabilities times the cached
  values reduce over that symbolic count and get the GEMM opts. Both with the right values."""
  from tinygrad import UOp
  from tg_ds4.quant.formats import dot_lanes
  rng = np.random.default_rng(6)
  q, c = rng.standard_normal((1, 4, 32, 64)).astype(np.float32), rng.standard_normal((1, 256, 64)).astype(np.float32)
  qt, ct, n = Tensor(q).realize(), Tensor(c).realize(), UOp.variable("start_pos", 0, 200).bind(40) + 32
  keys = ct[:, :n].unsqueeze(1)                                                   # [1, 1, n, 64]
  (k,) = schedulers(dot_lanes(qt, keys, 8))
  ours = kernel_opts.cpu_heuristic(k.copy())
  assert [o.arg for o in ours.applied_opts if o.op is OptOps.UPCAST] == [kernel_opts.QUERY_ROWS], ours.applied_opts
  assert any(o.op is OptOps.UNROLL for o in ours.applied_opts), ours.applied_opts
  ref = np.einsum("htd,nd->htn", q[0].astype(np.float64), c[0, :72].astype(np.float64))
  fixed = lambda t: t.pad(((0, 0),) * (t.ndim - 1) + ((0, 256 - n),)).numpy()[..., :72]  # the symbolic length padded to 256
  np.testing.assert_allclose(fixed(dot_lanes(qt, keys, 8))[0], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
  p = Tensor(rng.random((32, 256)).astype(np.float32)).realize()[:, :n]           # [rows, n], smaller than the cache
  (k,) = schedulers(p @ ct[0, :n])
  tokens, vec = kernel_opts.CPU.gemm
  assert [o.arg for o in kernel_opts.cpu_heuristic(k.copy()).applied_opts if o.op is OptOps.UPCAST] == [tokens, vec]
  ref = p.pad(((0, 0), (0, 256 - n))).numpy()[:, :72].astype(np.float64) @ c[0, :72].astype(np.float64)
  np.testing.assert_allclose((p @ ct[0, :n]).numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())

def test_other_kernels_unchanged():
  w = Tensor.ones(256, 64).contiguous().realize()  # [out, in]: contiguous along the reduce axis, neither GEMM_OPTS nor lanes
  (k,) = schedulers(Tensor.ones(32, 64).contiguous().realize() @ w.T)
  assert kernel_opts.cpu_heuristic(k.copy()).applied_opts == kernel_opts._hand_coded(k.copy()).applied_opts

def _sources(t: Tensor) -> str:
  """The C source of `t`'s kernels, rendered now (with the currently installed heuristic and rewrites)."""
  progs = [cg.do_to_program(c.src[0], Device[Device.DEFAULT].renderer) for c in t.linear_with_vars()[0].src
           if c.op is Ops.CALL and c.src[0].op is Ops.SINK]
  return "\n".join(s.arg for p in progs for s in p.src if s.op is Ops.SOURCE)

@pytest.mark.skipif(kernel_opts.CPU.floats != 8, reason="CPUs with 256-bit vectors")
def test_gemm_weight_rows_and_outputs_in_8_float_accesses(monkeypatch):
  rng = np.random.default_rng(0)
  x, wt = rng.standard_normal((1, 32, 256)).astype(np.float32), rng.standard_normal((256, 512)).astype(np.float32)
  gemm = lambda: Tensor(x).realize() @ Tensor(wt).realize()
  src = _sources(gemm())
  loads, stores = src.count("= (*((float8*)"), src.count("*((float8*)((data0")
  tokens, vec = kernel_opts.CPU.gemm
  assert loads >= vec // 8 and stores >= tokens * vec // 8, src
  np.testing.assert_allclose(gemm().numpy(), x @ wt, rtol=1e-4, atol=1e-4)
  monkeypatch.setattr(kernel_opts, "CPU", kernel_opts.SSE)  # tinygrad's own coalescing: at most 4 floats
  assert "float8" not in _sources(gemm())

# *** every kernel shape, on both CPU kinds the rules distinguish ***

def _decode_step_kernels() -> list[Tensor]:
  """A real decode step (symbolic position, MLA + MoE) of the ds3 fixture, with greedy, sampling and logprob heads."""
  from tg_ds4.runtime.runner import Runner, _with_logprobs
  from tg_ds4.runtime.sampling import SamplingParams, greedy, sample
  m = Runner.load(str(FIXTURES / "deepseek2/ds3/ds3-Q4_0.gguf"), max_ctx=64).model
  tok, pos = UOp.variable("token", 0, m.cfg.n_vocab - 1).bind(3), UOp.variable("start_pos", 0, 63).bind(5)
  logits = m.forward(tok, pos, last_only=True)[:, -1]
  sp, rng = SamplingParams(0.8, 40, 0.95, 0.05, 1).tensors(), Tensor([1, 2], dtype=dtypes.uint32)
  return [greedy(logits), sample(logits, *sp, rng), _with_logprobs(logits, sample(logits, *sp, rng), 5)]

def _sampling_kernels(vocab: int) -> list[Tensor]:
  """The sampling and logprob heads over a real vocabulary, and a threshold search by halving (counts over it compared
  to a bound): its reductions split into scalar and bool kernels."""
  from tg_ds4.runtime.runner import _with_logprobs
  from tg_ds4.runtime.sampling import SamplingParams, greedy, sample
  logits = Tensor(np.random.default_rng(vocab).standard_normal((1, vocab)).astype(np.float32)).realize()
  sp, rng = SamplingParams(0.8, 40, 0.95, 0.05, 1).tensors(), Tensor([1, 2], dtype=dtypes.uint32)
  tok = sample(logits, *sp, rng)
  lo, hi = logits.min(-1, keepdim=True), logits.max(-1, keepdim=True)
  for _ in range(24):  # threshold halvings to float precision, each one count over the vocabulary
    ok = (logits >= (mid := (lo + hi) / 2)).sum(-1, keepdim=True) >= 40
    lo, hi = ok.where(mid, lo), ok.where(hi, mid)
  return [tok, greedy(logits), _with_logprobs(logits, tok, 20), lo]

def _odd_kernels() -> list[Tensor]:
  n = UOp.variable("n", 1, 32).bind(5)
  x = Tensor.arange(32).float().contiguous().realize()
  gemm = Tensor.ones(1, 32, 256).contiguous().realize() @ Tensor.ones(256, 512).contiguous().realize()  # tiles differ by kind
  return [gemm, Tensor([1.0]).sum() + 1, (Tensor([True, False]).any() & Tensor([1]).eq(1).all()), x[:n].sum(), x[:n].max(), x.cumsum(),
          Tensor.ones(3, dtype=dtypes.uint8).contiguous().sum()]

FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures"
@functools.cache
def _kernels(case: str) -> tuple[list[UOp], bool]:
  """The kernel ASTs of a case, and whether one of them has no axes but a 1-byte buffer (the sampling crash's shape, #20)."""
  sinks = [s for t in CASES[case]() for s in kernel_sinks(t)]
  return sinks, any(not k.full_shape and any(b.src[0].dtype.itemsize == 1 for b in k.bufs) for k in schedulers(sinks))

CASES = {"decode-step": _decode_step_kernels, "vocab-49152": lambda: _sampling_kernels(49152), "gemm-scalar-bool-symbolic": _odd_kernels}

# (the kinds differ only in the GEMM tile, so the decode step, which has no GEMM, is lowered for one)
@pytest.mark.parametrize("case,kind", [(c, k) for c in sorted(CASES) for k in ("avx2", "avx512") if (c, k) != ("decode-step", "avx512")])
def test_rules_handle_every_kernel_shape(case, kind, monkeypatch):
  """The sampling crash (#20): `_transposing_unpack` must not index the first axis of a kernel that has none, as the
  split reductions over a real vocabulary make (scalar kernels with a bool buffer). Every kernel of these graphs is lowered
  and rendered with the rules themselves as tinygrad's heuristic (no fallback), on each CPU kind."""
  from tinygrad.codegen.opt import heuristic
  monkeypatch.setattr(kernel_opts, "CPU", {"avx2": kernel_opts.AVX2, "avx512": kernel_opts.AVX512}[kind])
  monkeypatch.setattr(heuristic, "hand_coded_optimizations", kernel_opts.rules)
  ren, (sinks, scalar_bytes) = Device[Device.DEFAULT].renderer, _kernels(case)
  assert len(sinks) >= 4 and (scalar_bytes or not case.startswith("vocab"))  # the shape of the sampling crash (#20) is there
  for sink in sinks: assert any(u.op is Ops.SOURCE for u in cg.do_to_program(sink, ren).src)

def test_a_failing_rule_falls_back_to_tinygrads_choice(monkeypatch, caplog):
  (k,) = schedulers(Tensor.ones(64, 64).contiguous().realize().sum(1))
  monkeypatch.setattr(kernel_opts, "_gemm", lambda k: 1 / 0)
  caplog.set_level("WARNING", "tg_ds4")
  assert kernel_opts.cpu_heuristic(k.copy()).applied_opts == kernel_opts._hand_coded(k.copy()).applied_opts
  assert "ZeroDivisionError" in caplog.text

# *** GPU renderers: backend/gpu/kernel_opts.py, on tinygrad's PYTHON device (it emulates workgroups and shared memory)

def _quantized(name: str, w: np.ndarray, device: str) -> tuple[QTensor, np.ndarray]:
  """`w` quantized by gguf-py, as a QTensor on `device`, and gguf-py's dequantization of the same bytes."""
  qt, t = QTYPE_BY_NAME[name], gguf.GGMLQuantizationType[name]
  raw = gguf.quants.quantize(w, t)
  blocks = Tensor(np.ascontiguousarray(raw).reshape(*w.shape[:-1], w.shape[-1] // qt.block, qt.nbytes), device=device).realize()
  return QTensor(blocks, qt, w.shape), gguf.quants.dequantize(raw, t)

@pytest.mark.parametrize("name", ["Q4_0", "Q8_0"])
def test_gpu_gemv_groups_each_row_over_threads_and_stays_exact(name):
  """A packed GEMV and a gathered-experts GEMV on a GPU renderer: threads split each row's blocks (GROUP), each thread
  unpacking its blocks' 32 values at once (UNROLL: quant/formats.py's GPU form sums blocks last), and workgroups hold
  several rows (LOCAL), where tinygrad's heuristic walks whole rows per thread (far from the GPU's memory bandwidth,
  above all for the gathered experts); the result equals gguf-py's dequantization times x to float32 rounding."""
  from tg_ds4.backend.gpu import kernel_opts as gpu
  rng, dev = np.random.default_rng(0), "PYTHON"
  w = rng.standard_normal((4, 64, 256)).astype(np.float32)
  x = rng.standard_normal((1, 1, 256)).astype(np.float32)
  q, deq = _quantized(name, w, dev)
  ids, xt = Tensor(np.array([2, 0, 3]), device=dev).realize(), Tensor(x, device=dev).realize()
  make = lambda: (linear(xt, q[1]), linear(xt.reshape(1, 1, 1, 1, 256), q[ids.reshape(1, 1, 3)]))  # as moe.experts gathers
  for t in make():
    chosen = [gpu.packed_gemv(k) for k in schedulers(t.contiguous(), Device[dev].renderer)]
    (k,) = [c for c in chosen if c is not None]  # the GEMV (the gather's index arithmetic is another kernel)
    ops = [o.op for o in k.applied_opts]
    assert OptOps.GROUP in ops and OptOps.UNROLL in ops and OptOps.LOCAL in ops, ops
    assert k.full_shape[k.axes_of(AxisType.GROUP_REDUCE)[0]] == 256 // 32  # a thread a block: 8 of them a row
  one, experts = make()
  want_one, want_experts = deq[1] @ x[0, 0], np.einsum("eoi,i->eo", deq[[2, 0, 3]], x[0, 0])
  got_one, got_experts = one.numpy().reshape(64), experts.numpy().reshape(3, 64)
  for got, want in ((got_one, want_one), (got_experts, want_experts)):
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), np.abs(got - want).max()

@pytest.mark.parametrize("name", ["Q4_0", "Q8_0"])
def test_gpu_batched_gemv_upcasts_its_rows_and_stays_exact(name):
  """A batched step's GEMV (4 rows of x, as runner.batch_step runs them) on a GPU renderer: the rows upcast, so each
  thread unpacks a weight byte once for all of them, then the one-row GEMV's GROUP and LOCAL (tinygrad's own choices
  leave the 4-row dense GEMVs far from the GPU's memory bandwidth); each row equals gguf-py's dequantization times that row."""
  from tg_ds4.backend.gpu import kernel_opts as gpu
  rng, dev = np.random.default_rng(1), "PYTHON"
  w, x = rng.standard_normal((64, 256)).astype(np.float32), rng.standard_normal((4, 1, 256)).astype(np.float32)
  q, deq = _quantized(name, w, dev)
  t = linear(Tensor(x, device=dev).realize(), q)
  (k,) = [c for c in (gpu.packed_gemv(k) for k in schedulers(t.contiguous(), Device[dev].renderer)) if c is not None]
  ops = [o.op for o in k.applied_opts]
  assert ops[0] is OptOps.UPCAST and OptOps.GROUP in ops and OptOps.LOCAL in ops, ops
  want = x[:, 0] @ deq.T
  assert np.abs(t.numpy().reshape(4, 64) - want).max() <= 1e-5 * np.abs(want).max()

def test_gpu_rule_leaves_chunks_and_cpu_kernels_alone():
  """A prefill chunk (tokens along an output axis, more than a batched step's 8 rows: 32, the smallest chunk) and any
  kernel on a CPU renderer keep the other heuristics' choices."""
  from tg_ds4.backend.gpu import kernel_opts as gpu
  q, _ = _quantized("Q8_0", np.ones((64, 256), np.float32), "PYTHON")
  (chunk,) = schedulers(linear(Tensor.ones(1, 32, 256, device="PYTHON").contiguous().realize(), q).contiguous(), Device["PYTHON"].renderer)
  assert gpu.packed_gemv(chunk) is None
  (cpu,) = schedulers(linear(Tensor.ones(1, 1, 1024).contiguous().realize(), packed("Q8_0", 64, 1024)))
  assert gpu.packed_gemv(cpu) is None

def test_gpu_broadcast_streams_compute_their_gemv_once():
  """deepseek4's hyper-connection update on a GPU renderer (models/deepseek4.py hc_post: 4 new streams, each the same
  float GEMV's output times its own weight plus a mix of the old streams): the stream axis, which the GEMV does not read,
  is upcast before anything else, so each thread computes the GEMV once for the 4 streams (left a launch axis, every
  stream's threads ran the whole GEMV again); a kernel whose reduction reads every output axis is left alone. The
  values equal numpy's to float32 rounding."""
  from tg_ds4.backend.gpu import kernel_opts as gpu
  from tg_ds4.models.deepseek4 import hc_post
  rng, dev = np.random.default_rng(2), "PYTHON"
  w, a = rng.standard_normal((256, 64)).astype(np.float32), rng.standard_normal((1, 1, 64)).astype(np.float32)
  x, mix = rng.standard_normal((1, 1, 4, 256)).astype(np.float32), rng.standard_normal((4 + 16,)).astype(np.float32)
  m = lambda i: Tensor(mix[i:i + 1], device=dev)
  make = lambda: hc_post(Tensor(a, device=dev) @ Tensor(w, device=dev).T, Tensor(x, device=dev), [m(k) for k in range(4)],
                         [[m(4 + 4 * j + k) for k in range(4)] for j in range(4)])
  (k,) = [k for k in schedulers(make().contiguous(), Device[dev].renderer) if k.reduceop is not None]
  assert 4 in k.full_shape and k.axis_types[k.full_shape.index(4)] is AxisType.GLOBAL
  chosen = gpu.broadcast_rows(k)
  ups = [o for o in chosen.applied_opts if o.op is OptOps.UPCAST]
  assert ups and 4 not in [s for s, at in zip(chosen.full_shape, chosen.axis_types) if at is AxisType.GLOBAL], chosen.applied_opts
  (plain,) = [k for k in schedulers((Tensor(a, device=dev) @ Tensor(w, device=dev).T).contiguous(), Device[dev].renderer)]
  assert gpu.broadcast_rows(plain) is plain
  want = np.stack([mix[k] * (a[0, 0] @ w.T) + sum(mix[4 + 4 * j + k] * x[0, 0, j] for j in range(4)) for k in range(4)])
  assert np.abs(make().numpy()[0, 0] - want).max() <= 1e-5 * np.abs(want).max()

@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gpu_wide_reductions_spread_over_a_workgroup_and_stay_exact(dtype):
  """A norm's sum of squares over 4096 values (one output) and a float GEMV with few outputs (24 x 8192, the shape of
  deepseek4's hyper-connection mixes) on a GPU renderer: up to 256 threads share each output's reduce (GROUPTOP), where
  tinygrad's heuristic gives it 16 that each wait on 256-512 loads one after another; in float32 and with half inputs
  (the GPU's matmul precision) the values equal numpy's sums of the same values."""
  from tg_ds4.backend.gpu import kernel_opts as gpu
  rng, dev, dt = np.random.default_rng(3), "PYTHON", getattr(dtypes, dtype)
  x = rng.standard_normal((1, 1, 4096)).astype(np.float32)
  w, v = rng.standard_normal((24, 8192)).astype(np.float32), rng.standard_normal((1, 1, 8192)).astype(np.float32)
  make = lambda: ((Tensor(x, device=dev).cast(dt).float() ** 2).sum(-1),
                  Tensor(v, device=dev).cast(dt).dot(Tensor(w, device=dev).cast(dt).T, dtype=dtypes.float32))  # as quant.linear accumulates
  for t in make():
    (k,) = [k for k in schedulers(t.contiguous(), Device[dev].renderer) if k.reduceop is not None]
    chosen = gpu.wide_reduce(k)
    assert chosen is not None and [(o.op, o.arg >= 128) for o in chosen.applied_opts] == [(OptOps.GROUPTOP, True)], chosen
  xr, vr, wr = (a.astype(dtype).astype(np.float64) for a in (x, v, w))
  (ss, gemv), want_ss, want_gemv = make(), (xr ** 2).sum(), vr[0, 0] @ wr.T
  assert abs(float(ss.numpy().reshape(())) - want_ss) <= 1e-5 * want_ss
  # the emulator's half products round (5e-4 of the largest output here, with or without these opts); a partial sum of
  # the 256 lost or added twice moves an output by ~3%
  tol = 1e-5 if dtype == "float32" else 2e-3
  assert np.abs(gemv.numpy().reshape(24) - want_gemv).max() <= tol * np.abs(want_gemv).max()
  def chosen(n: int):
    (k,) = [k for k in schedulers((Tensor(x[..., :n], device=dev) ** 2).sum(-1).contiguous(), Device[dev].renderer) if k.reduceop is not None]
    return gpu.wide_reduce(k)
  # 512 values (MLA's latent norm): 64 threads of 8 loads each, their 64 partials summed by one; 256: tinygrad's 16 of 16
  assert [(o.op, o.arg) for o in chosen(512).applied_opts] == [(OptOps.GROUPTOP, 64)] and chosen(256) is None

def _random_blocks(name: str, rows: int, cols: int, rng) -> QTensor:
  """Random packed blocks with small finite fp16 scales (and minima) in the first bytes: any other bytes are valid."""
  qt = QTYPE_BY_NAME[name]
  raw = rng.integers(0, 256, (rows, cols // qt.block, qt.nbytes), dtype=np.uint8)
  head = 4 if name in ("Q4_1", "Q5_1") else 2
  raw[..., :head] = (rng.random((rows, cols // qt.block, head // 2)) * 0.02 - 0.01).astype(np.float16).view(np.uint8)
  return QTensor(Tensor(raw).realize(), qt, (rows, cols))

@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q5_0", "Q4_1"])  # the per-block (affine) form, and the per-value form
def test_a_gemv_row_sums_as_alone_in_a_batch(name):
  """Exact float math: a row of x gives bitwise the same outputs in a GEMV of 1, 2, 3 or 4 rows (a batched decode
  step's), so a request's answer does not depend on what runs beside it. Two ways it did not: Q4_0 and Q8_0 took the
  per-block form for one row only; and a batch's rows share each unpacked weight value `d * q`, which one row's kernel
  inlined into `x * (d * q)`, rendered `x * d * q` by tinygrad (`(x * d) * q` in C), an ulp off."""
  from tg_ds4.quant import settings
  rng = np.random.default_rng(7)
  w, x = _random_blocks(name, 256, 1024, rng), rng.standard_normal((4, 1, 1024)).astype(np.float32)
  with settings.override(numerics="exact"):
    one = linear(Tensor(x[:1]), w).numpy()
    for rows in (2, 3, 4):
      np.testing.assert_array_equal(linear(Tensor(x[:rows]), w).numpy()[:1], one, err_msg=f"{rows} rows")

def test_float_ops_render_in_the_graphs_order():
  """`a * (b * c)` and `a + (b + c)` on floats keep their parentheses in the C source (tinygrad's renderer dropped them,
  and C then computed `(a * b) * c`); integer index arithmetic is still flattened (an unrolled reduce's accumulator
  sum too: test_gemv_unrolls_the_nibble_axis_with_the_same_sums)."""
  from tinygrad import Device
  ren = Device["CPU"].renderer
  a, b, c = (UOp.variable(n, 0, 10, dtypes.float32) for n in "abc")
  i, j, k = (UOp.variable(n, 0, 10) for n in "ijk")
  names = {u: u.arg.name for u in (a, b, c, i, j, k)}
  class Ctx:
    code_for_op = ren.code_for_op
    def __getitem__(self, u): return names[u] if u in names else ren.string_rewrite.rewrite(u, ctx=self)
  ctx = Ctx()
  assert ctx[a * (b * c)] == "(a*(b*c))" and ctx[(a * b) * c] == "(a*b*c)" and ctx[a + (b + c)] == "(a+(b+c))"
  assert ctx[i * (j * k)] == "(i*j*k)"

@pytest.mark.parametrize("name", ["Q4_0"])
def test_a_batched_steps_embeddings_norm_as_alone(name):
  """A batched step's rows: the token embeddings (nn/layers.py's Embedding over a list of token variables) and the norm
  after them give a row bitwise what it gets in a batch of one (read through the rows' concatenation, a 2048-wide
  norm summed a row's squares in another order for 4 rows than for 1)."""
  from tg_ds4.nn.layers import Embedding, RMSNorm
  rng, qt = np.random.default_rng(3), QTYPE_BY_NAME[name]
  raw = rng.integers(0, 256, (64, 2048 // qt.block, qt.nbytes), dtype=np.uint8)
  raw[..., :2] = (rng.random((64, 2048 // qt.block, 1)) * 0.02).astype(np.float16).view(np.uint8)
  emb, norm = Embedding(64, 2048), RMSNorm(2048, 1e-6)
  emb.weight, norm.weight = QTensor(Tensor(raw).realize(), qt, (64, 2048)), Tensor(rng.random(2048).astype(np.float32))
  rows = lambda B: norm(emb([UOp.variable(f"t{i}", 0, 63).bind(11 + i) for i in range(B)])).numpy()
  one = rows(1)
  for B in (2, 4): np.testing.assert_array_equal(rows(B)[:1], one, err_msg=f"{B} rows")
