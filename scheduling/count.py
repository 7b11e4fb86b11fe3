"""Kernels and bytes per decode step, per block kind, on DEV=NULL (scheduled, not run).

  DEV=NULL python scheduling/count.py FILE.gguf ... [--json]"""
import json, sys

from tinygrad import Device, GlobalCounters, Tensor, UOp

from tg_ds4.arch import Model
from tg_ds4.ds4 import DS4Transformer
from tg_ds4.layers import packed_weights
from tg_ds4.quant import QTensor
from tg_ds4.runner import Runner
from tg_ds4.sampling import greedy

def _packed_bytes(obj) -> int:
  """Packed bytes of every weight below a block (what one decode step must read at least once)."""
  return obj.nbytes if isinstance(obj, QTensor) else sum(w.nbytes for _, _, w in packed_weights(obj))

def decode_counts(model: Model) -> dict[str, dict[str, float]]:
  """{block kind: {kernels, bytes, packed}} for one decode token at position 7, plus the head with greedy sampling."""
  cfg, out, pos = model.cfg, {}, UOp.variable("start_pos", 0, model.max_ctx - 1).bind(7)
  ds4 = isinstance(model, DS4Transformer)  # hyper-connection streams in, token id for hash routing
  for i, b in enumerate(model.blk):
    if ds4:  # attention by compression ratio (window only / ratio 4 + indexer / ratio 128), routing by token hash or top-k
      kind = f"DS4 {dict([(0, 'SWA'), (4, 'CSA'), (128, 'HCA')])[cfg.compress_ratios[i]]} {'hash-MoE' if i < cfg.n_hash_layer else 'MoE'}"
    else: kind = f"{'MLA' if cfg.mla else 'GQA'} {'MoE' if cfg.is_moe_layer(i) else 'dense'}" + \
      (" sandwich" if cfg.sandwich_norm else "") + (" SWA" if b.swa else "")  # gemma: extra norms, windowed mask
    if kind in out: continue
    x = Tensor.empty(1, 1, *((cfg.hc,) if ds4 else ()), cfg.dim).realize()
    GlobalCounters.reset()
    if ds4: b(x, UOp.variable("token", 0, cfg.n_vocab - 1).bind(1), pos, model.tabs).realize()
    else: b(x, pos, model.rope_swa if b.swa else model.rope).realize()
    out[kind] = {"kernels": GlobalCounters.kernel_count, "bytes": GlobalCounters.global_mem, "packed": _packed_bytes(b)}
  x = Tensor.empty(1, 1, *((cfg.hc,) if ds4 else ()), cfg.dim).realize()
  GlobalCounters.reset(); greedy(model.output(model.output_norm(model.output_hc.head(x) if ds4 else x))[:, -1]).realize()
  out["head+sampling"] = {"kernels": GlobalCounters.kernel_count, "bytes": GlobalCounters.global_mem, "packed": _packed_bytes(model.output)}
  return out

if __name__ == "__main__":
  assert Device.DEFAULT == "NULL", "run with DEV=NULL"
  res = {p: decode_counts(Runner.load(p, max_ctx=64).model) for p in sys.argv[1:] if p != "--json"}
  if "--json" in sys.argv: print(json.dumps(res))
  else:
    for p, kinds in res.items():
      print(p); [print(f"  {k:<16} {v['kernels']:>3} kernels  {v['bytes'] / max(v['packed'], 1):.3f}x packed bytes") for k, v in kinds.items()]
