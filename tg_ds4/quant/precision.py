"""Arithmetic precision per device. The CPU computes float32, the references' math (a quantized matmul's input
rounded where quant/activations.py's numerics say so). On a GPU the default is half:
matmul inputs and dequantized weights in float16 with float32 accumulation and float32 outputs (what tensor cores
take), and float16 KV caches (half the bytes the attention reads per token); the residual stream, norms, RoPE,
attention scores and softmax, the MoE router (its top-k choices) and the head's logits stay float32. deepseek4 keeps
besides in float32 what makes a choice or mixes the residual: the hyper-connection projections and their Sinkhorn,
the indexer (queries, weights, its compressed keys: a top-k), the compressors' pending state (softmax logits); its
raw KV ring and compressed rows are the half cache. `TG_DS4_PRECISION=f32` (or `f16`) overrides the device's default."""
from __future__ import annotations

import os
from dataclasses import dataclass

from tinygrad import dtypes

from tg_ds4.backend.compat import DType

@dataclass(frozen=True)
class Precision:
  matmul: DType  # matmul inputs and dequantized weights; accumulation and outputs are float32
  cache: DType   # KV cache rows

F32, F16 = Precision(dtypes.float32, dtypes.float32), Precision(dtypes.float16, dtypes.float16)
NAMES = {"f32": F32, "f16": F16}

def for_caps(caps) -> Precision:
  """The precision on a device with `caps` (backend.Capabilities): half on a GPU renderer, float32 on the CPU and the
  plain NULL device (the CPU's schedule without running it), unless TG_DS4_PRECISION says otherwise."""
  if (name := os.environ.get("TG_DS4_PRECISION", "")) and name not in NAMES:
    raise ValueError(f"TG_DS4_PRECISION={name!r}: expected one of {', '.join(NAMES)}")
  return NAMES[name] if name else F16 if caps.half else F32
