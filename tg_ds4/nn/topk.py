"""Top-k selection without a sort, for DSA's and DeepSeek V4's indexers: the k-th largest value searched a byte at a time
on the float's order-preserving uint32 code, linear in the number of candidates with a fixed number of kernels."""
from __future__ import annotations

from tinygrad import Tensor, UOp, dtypes

NEG = -3.4028234663852886e38  # float32 min: masked logits stay finite, so fully masked rows softmax to numbers

def arange(n: int | UOp) -> Tensor:
  """0..n-1; a symbolic n slices a constant-length arange (a symbolic-length one would be a quadratic cumsum)."""
  return Tensor.arange(n) if isinstance(n, int) else Tensor.arange(n.vmax)[:n]

def _kth_largest(key: Tensor, ok: Tensor, k: Tensor | int, bits: int) -> Tensor:
  """Per row of uint32 `key` `[T, n]`: the largest t with at least k entries (where `ok`) >= t, found a byte at a time
  from the top of a `bits`-wide key: one 256-way count per round, linear in n. 0 when fewer than k entries are ok."""
  t = Tensor.zeros(key.shape[0], 1, dtype=dtypes.uint32)
  for shift in range(-(-bits // 8) * 8 - 8, -1, -8):
    cand = t + (Tensor.arange(256).cast(dtypes.uint32) << shift).reshape(1, 256)                 # [T, 256]
    cnt = (ok.unsqueeze(1) & (key.unsqueeze(1) >= cand.unsqueeze(-1))).sum(-1)                     # [T, 256]
    t = t + (((cnt >= k).sum(-1, keepdim=True) - 1).maximum(0).cast(dtypes.uint32) << shift)
  return t

def topk_mask(s: Tensor, ok: Tensor, k: int, cap: int) -> Tensor:
  """Per row of `s` `[T, n]` (n <= cap): the k largest entries among those where `ok` (all of them when fewer), ties to
  the lower index. Linear in n with a fixed number of kernels, no sort: the k-th largest value is searched on the
  float's order-preserving uint32 code, then among entries equal to it the lowest indices are searched the same way."""
  if cap <= k: return ok                                                         # never more rows than k (short contexts)
  b = (s == 0).where(0.0, s).bitcast(dtypes.uint32)                             # -0.0 counts as 0.0
  key = (b >> 31).cast(dtypes.bool).where(b ^ 0xFFFFFFFF, b | 0x80000000)
  t = _kth_largest(key, ok, k, 32)
  gt, eq = ok & (key > t), ok & (key == t)
  rev = (arange(s.shape[1]) * -1 + (cap - 1)).cast(dtypes.uint32).reshape(1, -1)  # lower index, larger key
  return gt | (eq & (rev >= _kth_largest(rev, eq, k - gt.sum(-1, keepdim=True), max(1, (cap - 1).bit_length()))))
