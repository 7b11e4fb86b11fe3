"""Rotary position embeddings with llama.cpp's semantics: NORM/NEOX pairing, linear scaling and YaRN."""
from __future__ import annotations

import math

import numpy as np
from tinygrad import Tensor, UOp

from tg_ds4.config import RopeConfig, RopeType
from tg_ds4.nn.cache_rows import Rows


def rope_table(rc: RopeConfig, max_ctx: int, device: str | None = None, freq_factors: np.ndarray | None = None) -> Tensor:
  """cos/sin for every position: float32 `[max_ctx, dim/2, 2]`, computed once on the host like ggml's rope cache.
  `freq_factors` (`dim/2`, a GGUF's `rope_freqs.weight`: llama 3.1+'s frequency-dependent scaling) divide each pair's
  angle, as ggml's rope does before any linear or YaRN scaling."""
  n_dims, half = rc.dim, rc.dim // 2
  i0 = np.arange(0, n_dims, 2, dtype=np.float64)
  theta_extrap = np.arange(max_ctx, dtype=np.float64)[:, None] * rc.base ** (-i0 / n_dims)
  if freq_factors is not None: theta_extrap = theta_extrap / np.asarray(freq_factors, np.float64)[None, :]
  theta, mag = rc.freq_scale * theta_extrap, rc.attn_factor
  if rc.yarn:
    # dims below `low` keep extrapolated (original) frequencies, above `high` interpolated ones, linear ramp between
    corr = lambda beta: n_dims * math.log(rc.orig_ctx / (beta * 2 * math.pi)) / (2 * math.log(rc.base))
    low, high = max(0.0, math.floor(corr(rc.beta_fast))), min(n_dims - 1.0, math.ceil(corr(rc.beta_slow)))
    ramp = 1 - np.clip((i0 / 2 - low) / max(0.001, high - low), 0, 1)
    mix = ramp * rc.ext_factor
    theta = theta * (1 - mix) + theta_extrap * mix
    mag *= 1.0 + 0.1 * math.log(1.0 / rc.freq_scale)
  assert theta.shape == (max_ctx, half)
  return Tensor(np.stack([np.cos(theta) * mag, np.sin(theta) * mag], -1).astype(np.float32), device=device).realize()

def apply_rope(x: Tensor, table: Tensor, start_pos: int | UOp | Rows, rtype: RopeType) -> Tensor:
  """Rotate `x` `[B, T, ..., dim]` (T on axis 1) at positions start_pos..start_pos+T (per row: nn/cache_rows.py's Rows)."""
  T, d = x.shape[1], x.shape[-1]
  cs = Rows.of(start_pos).table(table, T).reshape(-1, T, *[1] * (x.ndim - 3), d // 2, 2)
  cos, sin = cs[..., 0], cs[..., 1]
  if rtype == RopeType.NORM:
    xp = x.reshape(*x.shape[:-1], d // 2, 2)
    x0, x1 = xp[..., 0], xp[..., 1]
    return Tensor.stack(x0 * cos - x1 * sin, x0 * sin + x1 * cos, dim=-1).reshape(x.shape)
  x0, x1 = x[..., :d // 2], x[..., d // 2:]
  return (x0 * cos - x1 * sin).cat(x0 * sin + x1 * cos, dim=-1)
