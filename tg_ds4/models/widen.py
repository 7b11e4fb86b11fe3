"""Weights re-encoded for the CPU's code with identical values: a per-device choice (backend.Capabilities.widen_weights)."""
from math import prod

from tg_ds4.nn.layers import Linear, packed_weights
from tg_ds4.nn.moe import MoE
from tg_ds4.quant import activations
from tg_ds4.quant.formats import K_WIDENED, X8, interleave_q4_0, q5_0_as_q8_0, widen_k_quant

WIDEN_K_MAX_EXTRA = 1 << 30  # K-quant widening is skipped when it would add more bytes than this (a big model)

def widen_for_cpu(model, q5_0: bool = True, k_quants: frozenset[str] = frozenset(K_WIDENED)) -> None:
  """Dense Linear weights in formats whose bit fields cost tinygrad's CPU code more than their bytes, re-encoded with
  identical values: with `q5_0`, Q5_0 as Q8_0 (quant/formats.py's `q5_0_as_q8_0`, 1.55x the bytes, a float GEMV faster
  per weight: no 5th bit to shift and mask in) and, when the extra memory stays under WIDEN_K_MAX_EXTRA, those of
  `k_quants` (Q6_K, Q4_K) as int8 with float32 sub-block scales (quant/formats.py's `widen_k_quant`, 1.5x / 2.2x the
  bytes). Made for dense models on the CPU (models/transformer.py's Transformer.load)."""
  ws = [(o, w) for o, attr, w in packed_weights(model) if isinstance(o, Linear) and attr == "weight"]
  for owner, w in ws:
    if q5_0 and w.qtype.name == "Q5_0": owner.weight = q5_0_as_q8_0(w)
  k = [(o, w) for o, w in ws if w.qtype.name in K_WIDENED and w.qtype.name in k_quants]
  if sum(prod(w.shape) * K_WIDENED[w.qtype.name].nbytes // K_WIDENED[w.qtype.name].block - w.nbytes for _, w in k) <= WIDEN_K_MAX_EXTRA:
    for owner, w in k: owner.weight = widen_k_quant(w)

def prepare(model, settings) -> None:
  """After the weights are loaded: `widen_for_cpu` where the device's capabilities ask for it (`settings`: the model's
  quant/settings.py Settings). Not under "llama.cpp" numerics, which round every matmul's input by the file's weight
  format. Q5_0, Q4_K and Q6_K stay packed where their GEMVs take integer dot products (quant/intdot.py and intdot_k.py
  unpack their bit fields for less than the bytes a widened copy reads)."""
  if settings.caps.widen_weights and settings.numerics != "llama.cpp":
    with settings.active():
      q5_0 = not activations.rounds("Q5_0", settings.caps.device)
      k_quants = frozenset(f for f in K_WIDENED if not activations.rounds(f, settings.caps.device))
    widen_for_cpu(model, q5_0=q5_0, k_quants=k_quants)

def interleave(model, settings, release=lambda t: None) -> None:
  """After the weights are loaded and fused: every Q4_0 weight whose GEMVs take ggml's repacked arithmetic
  (quant/intdot.py's `repacked`: a matrix, or a layer's routed experts, with a row count that is a multiple of 8)
  re-laid by quant/formats.py's `interleave_q4_0`, where the device takes Q4_0's integer dots under the model's
  numerics. The same bytes in another order: memory does not grow, and the file's pages it read are dropped from
  the process's memory once copied (`release(blocks)`: io/gguf.py's GGUFFile.release). Weights that share their bytes with another (the
  rows of a fused q|k or gate|up and the fused weight) keep the file's layout."""
  with settings.active():
    if "Q4_0" not in settings.caps.int_dot_formats or not activations.rounds("Q4_0", settings.caps.device): return
  owners = [(o, a, w) for o, a, w in packed_weights(model) if isinstance(o, Linear) and a == "weight" and w.ndim == 2]
  blocks = model.blocks() if hasattr(model, "blocks") else getattr(model, "blk", [])
  for m in [b.ffn for b in blocks if isinstance(getattr(b, "ffn", None), MoE)]:
    owners += [(p, "weight", p.weight) for p in (m.ffn_gate_up_exps, m.ffn_gate_exps, m.ffn_up_exps, m.ffn_down_exps) if p is not None]
  bases: dict[int, int] = {}
  for _, _, w in owners: bases[id(w._src[0].uop.base)] = bases.get(id(w._src[0].uop.base), 0) + 1
  for o, a, w in owners:
    if w.qtype.name == "Q4_0" and w._src[1] == () and w.x8 is None and w.shape[-2] % X8 == 0 and bases[id(w._src[0].uop.base)] == 1:
      setattr(o, a, interleave_q4_0(w))
      release(w.blocks)
