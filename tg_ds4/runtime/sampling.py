"""Token sampling on the device: greedy, temperature, top-k, top-p, min-p, seeded — no vocabulary copy to the host.

Filters follow llama.cpp's default chain order (top-k, top-p, min-p on the raw distribution, then temperature, then a
draw). Thresholds come from a search over the value range instead of a sort: a fixed number of reductions, each testing
many candidate thresholds at once (`_search`), so the whole sampler is a constant graph of a few kernels that TinyJit
captures with the parameters as input tensors."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tinygrad import Device, Tensor, dtypes

from tg_ds4.backend.buffers import host_tensor

# thresholds to 2^-24 of the value range (ties closer than that are kept together): SEARCH_PASSES passes that each test
# the 2^SEARCH_BITS - 1 points splitting the current range evenly, all in one reduction
SEARCH_BITS, SEARCH_PASSES = 4, 6

@dataclass(frozen=True)
class SamplingParams:
  temperature: float = 0.0   # 0 = greedy
  top_k: int = 0             # 0 = off
  top_p: float = 1.0         # 1 = off
  min_p: float = 0.0         # 0 = off
  seed: int | None = None

  def __post_init__(self):
    for name, ok, want in (("temperature", self.temperature >= 0, ">= 0"), ("top_k", self.top_k >= 0, ">= 0"),
                           ("top_p", 0 < self.top_p <= 1, "in (0, 1]"), ("min_p", 0 <= self.min_p <= 1, "in [0, 1]")):
      if not ok: raise ValueError(f"{name} must be {want}, got {getattr(self, name)}")

  @property
  def greedy(self) -> bool: return self.temperature == 0

  def tensors(self, device: str | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The parameters as (1,)-shaped device tensors: JIT inputs, so changing them never recompiles."""
    return (inputs([max(self.temperature, 1e-6)], np.float32, device), inputs([self.top_k], np.int32, device),
            inputs([self.top_p], np.float32, device), inputs([self.min_p], np.float32, device))

def inputs(values, dtype, device: str | None = None) -> Tensor:
  """Host values as a realized device tensor, by one buffer copy: a sampled step's per-token inputs. `Tensor(values)`
  is realized by the JIT call that takes it, which schedules and lowers a copy each time: work paid again for every
  sampled token, on top of the step itself."""
  return host_tensor(np.asarray(values, dtype), device or Device.DEFAULT)

def _search(lo: Tensor, hi: Tensor, keep_upper) -> Tensor:
  """The largest t of the grid lo + (hi - lo) * i / 2^(SEARCH_BITS * SEARCH_PASSES) with keep_upper(t) true, `lo`, `hi`
  `[B, 1]` (keep_upper monotone: true below a threshold, false above; true at lo). keep_upper takes candidates `[B, M]`
  and answers `[B, M]`: each pass is one reduction over the vocabulary for M candidates at once, where halving the
  range would take SEARCH_BITS reductions one after another: a fixed sampler of a few kernels (a GPU pays a launch
  each), for M compares per logit per pass."""
  M = (1 << SEARCH_BITS) - 1
  j = Tensor.arange(1, M + 1, dtype=dtypes.float32).reshape(1, M)
  for _ in range(SEARCH_PASSES):
    step = (hi - lo) * (1.0 / (M + 1))
    n = keep_upper(lo + step * j).cast(dtypes.float32).sum(-1, keepdim=True)  # the candidates kept: a prefix, monotone
    lo, hi = lo + step * n, lo + step * (n + 1)
  return lo

def uniform(shape: tuple[int, ...], rng: Tensor) -> Tensor:
  """Counter-based uniforms in (0, 1): a murmur3-style hash of (seed, step, index). `rng` is a `(2,)` uint32 input
  (seed, step), so draws depend only on those numbers: the same seed gives the same text whether or not the step was
  JIT-captured (tinygrad's own Tensor.rand keeps state that a captured graph does not reset). With `rng` `[B, 2]` (a
  batched step's rows, `shape` `[B, V]`) row b hashes its own (seed, step) and its index in the row: the draws of a
  one-row `shape` under that row's `(2,)` rng, whichever batch row it runs in."""
  if rng.ndim == 2:
    x = Tensor.arange(shape[-1], dtype=dtypes.uint32).reshape(1, -1) * 0x9E3779B1 + rng[:, 0:1] * 0x85EBCA77 + rng[:, 1:2] * 0xC2B2AE3D
  else:
    n = 1
    for s in shape: n *= s
    x = Tensor.arange(n, dtype=dtypes.uint32).reshape(shape) * 0x9E3779B1 + rng[0] * 0x85EBCA77 + rng[1] * 0xC2B2AE3D
  for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)): x = (x ^ (x >> shift)) * mul
  x = x ^ (x >> 16)
  return ((x >> 8).cast(dtypes.float32) + 0.5) * (1.0 / (1 << 24))

def rng(seed: int, step: int, device: str | None = None) -> Tensor:
  """The `(2,)` uint32 (seed, step) input of `sample`: draw `step` of the stream `seed`."""
  return inputs([seed & 0xFFFFFFFF, step], np.uint32, device)

def greedy(logits: Tensor) -> Tensor:
  """logits `[B, V]` -> `[B, 1]` int32."""
  return logits.argmax(-1, keepdim=True).cast(dtypes.int32)

def _kept(logits: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
  """The `[B, V]` mask of the tokens the filters keep: top-k, top-p, min-p on the raw distribution, in that order."""
  lmax, lmin = logits.max(-1, keepdim=True), logits.min(-1, keepdim=True)
  # top-k: the k-th largest logit is the largest t with count(logits >= t) >= k (k = 0 keeps everything)
  k = top_k.reshape(-1, 1)
  t_k = _search(lmin, lmax, lambda t: (logits.unsqueeze(1) >= t.unsqueeze(-1)).sum(-1) >= k)
  keep = (k == 0) | (logits >= t_k)
  p = keep.where(logits - lmax, float("-inf")).exp()
  p = p / p.sum(-1, keepdim=True)
  # top-p: keep the most probable tokens until their mass reaches top_p (the token that crosses it included)
  pmax = p.max(-1, keepdim=True)
  pu = p.unsqueeze(1)
  t_p = _search(Tensor.zeros_like(pmax), pmax, lambda t: (pu >= t.unsqueeze(-1)).where(pu, 0.0).sum(-1) >= top_p.reshape(-1, 1))
  keep = keep & ((top_p.reshape(-1, 1) >= 1.0) | (p >= t_p))
  # min-p: drop tokens below min_p times the most probable one
  return keep & (p >= min_p.reshape(-1, 1) * pmax)

def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, rng: Tensor) -> Tensor:
  """logits `[B, V]` -> `[B, 1]` int32 sampled token ids. Parameters are `(1,)` tensors (see SamplingParams.tensors)
  or `(B,)` ones (a row each), `rng` the `(2,)` uint32 (seed, step) or `[B, 2]`."""
  logits = logits.float()
  keep = _kept(logits, top_k, top_p, min_p)
  # temperature, then a Gumbel-max draw: argmax(l/T - log(-log u)) samples softmax(l/T)
  g = -(-uniform(logits.shape, rng).log()).log()
  return keep.where(logits / temperature.reshape(-1, 1) + g, float("-inf")).argmax(-1, keepdim=True).cast(dtypes.int32)

def distribution(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
  """logits `[B, V]` -> `[B, V]` float32: the distribution `sample` draws from (the kept tokens' softmax(l / T), zero
  elsewhere), for speculative decoding's acceptance rule (runtime/speculative.py)."""
  logits = logits.float()
  return _kept(logits, top_k, top_p, min_p).where(logits / temperature.reshape(-1, 1), float("-inf")).softmax(-1)
