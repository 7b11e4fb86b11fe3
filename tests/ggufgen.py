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

def write_tiny_deepseek2(path: str | pathlib.Path, drop: str | None = None, reshape: tuple[str, tuple[int, ...]] | None = None,
                         arch: str = "deepseek2", seed: int = 0, legacy_kv_b: bool = False,
                         fused_gate_up: bool = False, mtp: bool = False) -> None:
  """A 3-block DeepSeek-V3-shaped GGUF (1 dense + 2 MoE blocks, q_lora, sigmoid gating with bias) with random weights,
  for structural tests (shapes, errors, JIT, kernel counts). `drop` leaves a tensor out; `reshape` writes one with a
  wrong shape; `legacy_kv_b` stores the old combined `attn_kv_b` (and old key lengths) instead of k_b/v_b, same
  weights; `fused_gate_up` stores experts as one `ffn_gate_up_exps` (gate rows first), same weights; `mtp` appends a
  multi-token-prediction block (`blk.3`, MoE, with `nextn.{eh_proj,enorm,hnorm,shared_head_norm}`).
  Numerical correctness is checked against transformers/llama.cpp fixtures instead."""
  rng = np.random.default_rng(seed)
  W = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)
  V, D, L, H, QL, KL, NOPE, R, VH, E, F, FF = 128, 64, 3, 4, 32, 32, 16, 8, 16, 8, 32, 96
  w = gguf.GGUFWriter(str(path), arch)
  if mtp: w.add_uint32(f"{arch}.nextn_predict_layers", 1)
  for k, v in dict(block_count=L + mtp, context_length=64, embedding_length=D, feed_forward_length=FF, expert_feed_forward_length=F, expert_count=E,
                   expert_used_count=2, expert_shared_count=1, leading_dense_block_count=1, expert_gating_func=2).items():
    w.add_uint32(f"{arch}.{k}", v)
  w.add_float32(f"{arch}.expert_weights_scale", 1.5); w.add_bool(f"{arch}.expert_weights_norm", True)
  lengths = dict(key_length=NOPE + R, value_length=VH) if legacy_kv_b else dict(key_length=KL + R, value_length=KL, key_length_mla=NOPE + R,
                                                                                 value_length_mla=VH)
  for k, v in dict(head_count=H, head_count_kv=1, q_lora_rank=QL, kv_lora_rank=KL, **lengths).items():
    w.add_uint32(f"{arch}.attention.{k}", v)
  w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6); w.add_uint32(f"{arch}.rope.dimension_count", R)
  w.add_float32(f"{arch}.rope.freq_base", 1e4)
  w.add_string("tokenizer.ggml.model", "none")
  def T(name, x, qt=G.F32):
    if name == drop: return
    if reshape and name == reshape[0]: x = np.resize(x, reshape[1])
    w.add_tensor(name, x if qt == G.F32 else gguf.quants.quantize(x, qt), raw_dtype=qt)
  T("token_embd.weight", W(V, D)); T("output.weight", W(V, D), G.Q8_0); T("output_norm.weight", 1 + 0.1 * W(D))
  for i in range(L + mtp):
    p = f"blk.{i}."
    if i == L:
      T(p + "nextn.eh_proj.weight", W(D, 2 * D), G.Q8_0); T(p + "nextn.enorm.weight", 1 + 0.1 * W(D))
      T(p + "nextn.hnorm.weight", 1 + 0.1 * W(D)); T(p + "nextn.shared_head_norm.weight", 1 + 0.1 * W(D))
    T(p + "attn_norm.weight", 1 + 0.1 * W(D)); T(p + "ffn_norm.weight", 1 + 0.1 * W(D))
    T(p + "attn_q_a.weight", W(QL, D), G.Q8_0); T(p + "attn_q_a_norm.weight", 1 + 0.1 * W(QL))
    T(p + "attn_q_b.weight", W(H * (NOPE + R), QL), G.Q8_0)
    T(p + "attn_kv_a_mqa.weight", W(KL + R, D), G.Q8_0); T(p + "attn_kv_a_norm.weight", 1 + 0.1 * W(KL))
    k_b, v_b = W(H, KL, NOPE), W(H, VH, KL)
    if legacy_kv_b: T(p + "attn_kv_b.weight", np.concatenate([k_b.transpose(0, 2, 1), v_b], 1).reshape(H * (NOPE + VH), KL))
    else: T(p + "attn_k_b.weight", k_b); T(p + "attn_v_b.weight", v_b)
    T(p + "attn_output.weight", W(D, H * VH), G.Q4_0)
    if i == 0:
      T(p + "ffn_gate.weight", W(FF, D), G.Q8_0); T(p + "ffn_up.weight", W(FF, D), G.Q8_0); T(p + "ffn_down.weight", W(D, FF), G.Q8_0)
    else:
      T(p + "ffn_gate_inp.weight", W(E, D)); T(p + "exp_probs_b.bias", 0.1 * W(E))
      gate, up = W(E, F, D), W(E, F, D)
      if fused_gate_up: T(p + "ffn_gate_up_exps.weight", np.concatenate([gate, up], 1), G.Q4_0)
      else: T(p + "ffn_gate_exps.weight", gate, G.Q4_0); T(p + "ffn_up_exps.weight", up, G.Q4_0)
      T(p + "ffn_down_exps.weight", W(E, D, F), G.Q4_0)
      T(p + "ffn_gate_shexp.weight", W(F, D), G.Q8_0); T(p + "ffn_up_shexp.weight", W(F, D), G.Q8_0); T(p + "ffn_down_shexp.weight", W(D, F), G.Q8_0)
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
