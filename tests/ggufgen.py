"""Small GGUF files for tests, written with gguf-py's GGUFWriter (an independent writer, not our reader)."""
from __future__ import annotations

import pathlib

import gguf
import numpy as np
from gguf import GGMLQuantizationType as G

def tiny_tensors(seed: int = 0) -> dict[str, tuple[np.ndarray, G]]:
  """name -> (float values in numpy order, storage type). Shapes are numpy/tinygrad order."""
  rng = np.random.default_rng(seed)
  return {
    "token_embd.weight": (rng.standard_normal((16, 64)).astype(np.float32), G.Q8_0),
    "blk.0.attn_q.weight": (rng.standard_normal((32, 64)).astype(np.float32), G.Q4_0),
    "blk.0.ffn_up_exps.weight": (rng.standard_normal((4, 8, 32)).astype(np.float32), G.Q4_1),
    "blk.0.attn_norm.weight": (rng.standard_normal((64,)).astype(np.float32), G.F32),
    "output.weight": (rng.standard_normal((16, 64)).astype(np.float32), G.F16),
    "blk.0.bf.weight": (rng.standard_normal((3, 32)).astype(np.float32), G.BF16),
  }

def write_tiny(path: str | pathlib.Path, seed: int = 0, split_max_tensors: int = 0) -> dict[str, tuple[np.ndarray, G]]:
  """Write a small GGUF with mixed metadata types and tensor types; returns what was written."""
  tensors = tiny_tensors(seed)
  w = gguf.GGUFWriter(str(path), "deepseek2", split_max_tensors=split_max_tensors)
  w.add_name("tiny test model")
  w.add_block_count(1)
  w.add_uint32("deepseek2.attention.head_count", 4)
  w.add_float32("deepseek2.rope.freq_base", 10000.0)
  w.add_bool("deepseek2.expert_weights_norm", True)
  w.add_string("tokenizer.ggml.model", "gpt2")
  w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(16)])
  w.add_array("deepseek2.attention.compress_ratios", [0, 4, 128])
  for name, (x, qt) in tensors.items():
    data = x if qt == G.F32 else x.astype(np.float16) if qt == G.F16 else gguf.quants.quantize(x, qt)
    w.add_tensor(name, data, raw_dtype=qt)
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  return tensors

def stored_values(x: np.ndarray, qt: G) -> np.ndarray:
  """What a reader should get back: the values after a round trip through the storage type."""
  if qt == G.F32: return x
  if qt == G.F16: return x.astype(np.float16).astype(np.float32)
  return gguf.quants.dequantize(gguf.quants.quantize(x, qt), qt).astype(np.float32).reshape(x.shape)
