"""A prefill chunk's float GEMM over a panel copy of its weight (quant/formats.py's panel_gemm) as a C kernel whose
accumulators are vectors: each statement holds `tokens` rows of x by one iteration's outputs (backend/cpu/kernel_opts.py's
VectorUnit.gemm: one or two panels), one weight load serving every row. tinygrad renders the same loop with one scalar
accumulator per (row, output), which clang vectorizes across the outputs but then keeps two copies of every
accumulator alive around the loop and spills them (a 128 x 4864 x 896 product ran at half the speed of the same loop
with vector accumulators).

Vectors are loaded and stored at 4-byte alignment: a panel's offsets are whole vectors, its buffer's base is whatever
the allocator gave. The sums are the ones tinygrad's kernel computes: per output, acc = fma(x[k], w[k], acc) for k in order from 0, then
the bias added once. A row's result does not depend on the rows beside it."""
from __future__ import annotations

from tinygrad import Tensor, dtypes

from tg_ds4.backend.compat import AxisType, Estimates, KernelInfo, UOp
from tg_ds4.quant import ckernel

def applies(rows: int, panels: int, n: int, tokens: int, outputs: int) -> bool:
  """Whether `rows` rows of x against `panels` panels of `n` outputs fit whole statements of `tokens` rows by `outputs`."""
  return rows % tokens == 0 and outputs % n == 0 and panels % (outputs // n) == 0

def _source(rows: int, k: int, panels: int, n: int, tokens: int, per: int) -> str:
  """Statement `@R@`: panel group `@R@ / (rows / tokens)` (`per` panels of `n`), token group `@R@ % (rows / tokens)`."""
  groups, out = rows // tokens, panels * n
  acc = "".join(f"v_ a{t}_{q}_ = zero_;" for t in range(tokens) for q in range(per))
  step = "".join(f"const v_ w{q}_ = *(const v_ *)(p_ + ((long){q} * {k} + k_) * {n});" for q in range(per)) + \
    "".join(f"{{ const float x_ = x_{t}[k_];" + "".join(f" a{t}_{q}_ = a{t}_{q}_ + x_ * w{q}_;" for q in range(per)) + " }"
            for t in range(tokens))
  store = "".join(f"__builtin_memcpy((float *)@OUT@ + (long)(g_ * {tokens} + {t}) * {out} + (pg_ * {per} + {q}) * {n}, &a{t}_{q}_, {4 * n});"
                  for t in range(tokens) for q in range(per))
  xs = "".join(f"const float *x_{t} = (const float *)@X@ + (long)(g_ * {tokens} + {t}) * {k};" for t in range(tokens))
  return f"""({{ typedef float v_ __attribute__((vector_size({4 * n}), aligned(4))); const v_ zero_ = {{0}};
  const int pg_ = @R@ / {groups}, g_ = @R@ % {groups};
  const float *p_ = (const float *)@P@ + (long)pg_ * {per * k * n};
  {xs}
  {acc}
  for (int k_ = 0; k_ < {k}; k_++) {{ {step} }}
  {store}
}});"""

def panel_gemm(x: Tensor, p: Tensor, tokens: int, outputs: int) -> Tensor:
  """x `[rows, in]` float32 against panels p `[out / n, in, n]` float32 -> `[rows, out]` float32, for `applies`."""
  (rows, k), (panels, _, n) = x.shape, p.shape
  per = outputs // n
  srcs = {"OUT": Tensor.empty(rows * panels * n, dtype=dtypes.float32, device=x.device), "X": x.contiguous().flatten(),
          "P": p.flatten()}
  body = ckernel.format_string(_source(rows, k, panels, n, tokens, per), [*srcs, "R"])
  count = (panels // per) * (rows // tokens)
  threads = ckernel.threads(str(x.device), count)
  def kernel(*params: UOp) -> UOp:
    t, i = UOp.range(threads, 0, AxisType.THREAD), UOp.range(count // threads, 1)
    r = t * (count // threads) + i
    est = Estimates(ops=2 * rows * k * panels * n, lds=4 * (rows * k * panels // per + panels * n * k + rows * panels * n),
                    mem=4 * (rows * k + panels * n * k + rows * panels * n))
    info = KernelInfo(name=f"panel_gemm_{rows}_{panels * n}_{k}", estimates=est)
    written = {0: (r % (rows // tokens)) * tokens * (panels * n) + (r // (rows // tokens)) * per * n}
    return ckernel.statement_kernel(body, params, written, r, (i, t), info)
  return Tensor.custom_kernel(*srcs.values(), fxn=kernel)[0].reshape(rows, panels * n)
