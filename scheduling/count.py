"""Kernels per decode step, per block, on DEV=NULL (scheduled, not run): `DEV=NULL python scheduling/count.py FILE.gguf ...`"""
import sys

from tinygrad import Device, GlobalCounters, Tensor, UOp

from tg_ds4.model import Transformer

def decode_kernels(model: Transformer) -> dict[str, int]:
  """Kernels for one decode token through each block kind and through the head (embedding + final norm + output)."""
  cfg, out, pos = model.cfg, {}, UOp.variable("start_pos", 0, model.max_ctx - 1).bind(7)
  for i, b in enumerate(model.blk):
    kind = f"{'MLA' if cfg.mla else 'GQA'} {'MoE' if cfg.is_moe_layer(i) else 'dense'}"
    if kind in out: continue
    x = Tensor.empty(1, 1, cfg.dim).realize()
    GlobalCounters.reset(); b(x, pos, model.rope).realize()
    out[kind] = GlobalCounters.kernel_count
  x = Tensor.empty(1, 1, cfg.dim).realize()
  GlobalCounters.reset(); model.output(model.output_norm(x)).realize()
  out["head"] = GlobalCounters.kernel_count
  return out

if __name__ == "__main__":
  assert Device.DEFAULT == "NULL", "run with DEV=NULL"
  for path in sys.argv[1:]: print(path, decode_kernels(Transformer.from_gguf(path, max_ctx=64)))
