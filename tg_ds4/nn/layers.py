"""Parameter declarations and the few layers every block uses, plus loading GGUF tensors into them by name.

Modules declare each weight as `Param(shape)` under the attribute path that equals its GGUF name
(`blk[3].attn_q_a.weight` <- `blk.3.attn_q_a.weight`), so loading needs no renaming table and a missing or
misshapen tensor is reported by name. Components whose class sets `gguf_flat = True` (attention, FFN, MoE) keep their
parameters in their parent's namespace, as GGUF does (`blk.3.attn_q_a`, not `blk.3.attn.attn_q_a`)."""
from __future__ import annotations

import dataclasses

import numpy as np

from tinygrad import Tensor, UOp, dtypes

from tg_ds4.backend.buffers import host_copy, host_tensor
from tg_ds4.backend.compat import prod
from tg_ds4.io.gguf import GGUFError, GGUFFile
from tg_ds4.quant import intdot, settings
from tg_ds4.quant.activations import round_activations
from tg_ds4.quant.formats import LANES_MAX_ROWS, QTensor, Weight, as_tensor, linear, panel_gemm


class Param:
  """A weight to be loaded: expected tinygrad-order shape; `optional` ones may be absent from the file."""
  def __init__(self, *shape: int, optional: bool = False): self.shape, self.optional = tuple(shape), optional
  def __repr__(self): return f"Param{self.shape}"

class Params:
  """A named group of weights with no behaviour of its own (e.g. `attn_k_b.weight`, `exp_probs_b.bias`)."""
  def __init__(self, **params): self.__dict__.update(params)

class Linear:
  HOIST_MAX_BYTES = 1 << 28  # largest float32 copy a multi-token call may make of a weight (a big vocab head stays fused)

  def __init__(self, n_in: int, n_out: int, bias: bool = False, scale: bool = False):
    self.weight: Weight | Param = Param(n_out, n_in)
    self.bias: Weight | Param | None = Param(n_out) if bias else None
    if scale: self.scale: Weight | Param | None = Param(1, optional=True)  # bitnet: the output times one number, if the file has it

  def __call__(self, x: Tensor) -> Tensor:
    """One token: the fused dequant GEMV (reads only packed bytes). Several tokens (a prefill chunk): the fused kernel
    would unpack every weight once per token, so the weight is dequantized once into a float32 buffer and the chunk
    is a plain GEMM, which unpacks each weight once for all the chunk's tokens."""
    y = matmul(x, self.weight, self.bias)
    return y * as_tensor(s) if (s := getattr(self, "scale", None)) is not None else y

def matmul(x: Tensor, w: Weight, bias: Weight | None = None) -> Tensor:
  """What `Linear` computes, for a weight held elsewhere (a group of rows of a bigger one)."""
  # a batched decode step (nn/cache_rows.py: `[B, 1, in]`, a few rows) stays a GEMV on the packed bytes, as one token does
  step = x.ndim == 3 and x.shape[1] == 1 and prod(x.shape[:-1]) <= LANES_MAX_ROWS
  if isinstance(w, QTensor) and w.qtype.quantized and prod(x.shape[:-1]) > 1 and not step and prod(w.shape) * 4 <= Linear.HOIST_MAX_BYTES:
    # under llama.cpp's rounding on a CPU with integer dots: its integer GEMM, each weight block unpacked per tile of rows
    if (y := intdot.try_linear(x, w)) is not None: return y if bias is None else y + as_tensor(bias, dtypes.float32)
    x = round_activations(x, w.qtype.name)
    if w.ndim == 2 and (n := settings.current(w.device).caps.gemm_panel) and w.shape[0] % n == 0:
      return panel_gemm(x, w.dequant(settings.current(w.device).matmul), n, bias)
    # stored [in, out]: the GEMM holds a vector of outputs per weight load (see kernel_opts)
    return linear(x, w.dequant(settings.current(w.device).matmul).T.contiguous().T, bias)
  return linear(x, w, bias)

def fusable(*parts: Linear) -> bool:
  """The weights of `parts` are one kind (one packed format or one dtype, one input width, 2-D, all with or all
  without bias, none with an output scale), so their rows can be stacked into one weight."""
  return len({(type(w := p.weight), w.qtype if isinstance(w, QTensor) else w.dtype, tuple(w.shape[1:]), p.bias is None)
              for p in parts}) == 1 and len(parts[0].weight.shape) == 2 and all(getattr(p, "scale", None) is None for p in parts)

def _stack_rows(ws: list[Weight]) -> tuple[Weight, list[Weight]]:
  """`ws` (one kind, same trailing shape) stacked along the first axis into one realized weight, and views of it for
  each part."""
  data = [w.blocks if isinstance(w, QTensor) else w for w in ws]
  host = [host_copy(t) for t in data]
  if all(h is not None for h in host): whole = host_tensor(np.concatenate(host), data[0].device)  # a copy, no kernel
  else: whole = data[0].cat(*data[1:]).contiguous().realize()
  wrap = (lambda t: QTensor(t, ws[0].qtype, (t.shape[0], *ws[0].shape[1:]))) if isinstance(ws[0], QTensor) else (lambda t: t)
  offs = [0] + [sum(w.shape[0] for w in ws[:i + 1]) for i in range(len(ws))]
  return wrap(whole), [wrap(whole[offs[i]:offs[i + 1]]) for i in range(len(ws))]

def fuse_rows(*parts: Linear) -> Linear:
  """One Linear computing `parts` side by side (their output rows stacked in order; see `fusable`). The bytes move into
  the fused weight and each part keeps a view of its rows, so memory does not grow."""
  assert fusable(*parts), parts
  fused = Linear(parts[0].weight.shape[1], sum(p.weight.shape[0] for p in parts), bias=parts[0].bias is not None)
  fused.weight, views = _stack_rows([p.weight for p in parts])
  for p, v in zip(parts, views): p.weight = v
  if fused.bias is not None:
    fused.bias, views = _stack_rows([p.bias for p in parts])
    for p, v in zip(parts, views): p.bias = v
  return fused

class RMSNorm:
  def __init__(self, dim: int, eps: float): self.weight, self.eps = Param(dim), eps
  def __call__(self, x: Tensor, per_element: bool = False) -> Tensor:
    """`per_element` recomputes the mean square for every output element (dim x the work) instead of broadcasting one
    reduce: a broadcast reduce is always its own kernel, so for a small norm feeding an elementwise consumer (a cache
    write) recomputing is cheaper than the extra launch. Never use it in front of a matmul (dim^2 work per row)."""
    x = x.float()
    sq = x.square().unsqueeze(-2).expand(*x.shape, x.shape[-1]) if per_element else x.square()
    return x * (sq.mean(-1, keepdim=not per_element) + self.eps).rsqrt() * as_tensor(self.weight)

def matmul_input(x: Tensor) -> Tensor:
  """A norm's output `x` as the matmuls after it read it: materialised where the device's capabilities say so
  (backend.Capabilities.norm_stored)."""
  return x.contiguous() if settings.current(x.device).caps.norm_stored else x

class LayerNorm:
  """GPT-2's norm: (x - mean) / sqrt(var + eps) * weight + bias, over the last axis."""
  def __init__(self, dim: int, eps: float): self.weight, self.bias, self.eps = Param(dim), Param(dim), eps
  def __call__(self, x: Tensor) -> Tensor: return x.float().layernorm(eps=self.eps) * as_tensor(self.weight) + as_tensor(self.bias)

class Embedding:
  def __init__(self, n_vocab: int, dim: int): self.weight: Weight | Param = Param(n_vocab, dim)
  def __call__(self, tokens: Tensor | UOp | list[UOp]) -> Tensor:
    """tokens `[B, T]` -> `[B, T, dim]`. A single token given as a bound symbolic variable becomes a slice of one row,
    so a decode step reads one row; a token tensor is a one-hot gather that scans the table (fine for prefill chunks).
    A batched step's tokens (a list of variables, one per row) -> `[B, 1, dim]`, stored: read through the
    concatenation of the rows' slices, the first norm's kernel took other shapes for 4 rows than for 1 and summed a
    row's squares in another order, so a row's answer depended on the rows beside it."""
    if isinstance(tokens, list): return Tensor.cat(*[self(t) for t in tokens]).contiguous()
    rows = self.weight[tokens:tokens + 1] if isinstance(tokens, UOp) else self.weight[tokens]
    x = rows.dequant(dtypes.float32) if isinstance(rows, QTensor) else rows.float()
    return x.reshape(1, 1, -1) if isinstance(tokens, UOp) else x

def _is_module(v) -> bool:  # our layer objects: not configs, tensors or anything from other packages
  return type(v).__module__.startswith("tg_ds4.") and hasattr(v, "__dict__") and not dataclasses.is_dataclass(v)

def _walk(obj, prefix: str = ""):
  """Yield (gguf_name, owner, attr, Param) for every declared parameter below `obj`."""
  items = enumerate(obj) if isinstance(obj, list) else vars(obj).items() if hasattr(obj, "__dict__") else ()
  for k, v in items:
    name = f"{prefix}{k}"
    if isinstance(v, Param): yield name, obj, k, v
    elif isinstance(v, list) or _is_module(v):
      yield from _walk(v, prefix if getattr(v, "gguf_flat", False) else name + ".")

def named_tensors(obj, prefix: str = "", seen: set[int] | None = None, flat: bool = True):
  """Yield (name, Tensor) for every tensor below `obj` (weights, caches, tables; a packed weight as its blocks), named as
  `load_weights` names them (honouring `gguf_flat`), or with `flat=False` by attribute path (unique: two flattened
  components may hold state of the same name). Each object is visited once: the model reaches itself through its step
  cache. Objects whose class sets `holds_model_state = False` (captured steps, the step cache) are not entered."""
  seen = set() if seen is None else seen
  if id(obj) in seen: return
  seen.add(id(obj))
  items = enumerate(obj) if isinstance(obj, (list, tuple)) else obj.items() if isinstance(obj, dict) else \
    vars(obj).items() if hasattr(obj, "__dict__") else ()
  for k, v in items:
    name = f"{prefix}{k}"
    if isinstance(v, QTensor): v = v.blocks if v.x8 is None else v.x8  # an interleaved weight's bytes (blocks: a view of them)
    if isinstance(v, Tensor): yield name, v
    elif isinstance(v, (list, tuple, dict)) or \
        (type(v).__module__.startswith("tg_ds4.") and hasattr(v, "__dict__") and getattr(v, "holds_model_state", True)):
      yield from named_tensors(v, prefix if flat and getattr(v, "gguf_flat", False) else name + ".", seen, flat)

def packed_weights(obj):
  """Yield (owner, attr, QTensor) for every loaded packed weight below `obj` (owner[attr] or owner.attr holds it)."""
  for k, v in list(enumerate(obj) if isinstance(obj, list) else vars(obj).items()):
    if isinstance(v, QTensor): yield obj, k, v
    elif isinstance(v, list) or _is_module(v): yield from packed_weights(v)

def load_weights(model, gf: GGUFFile, device: str | None = None, rename: dict[str, str] | None = None, prefix: str = "") -> None:
  """Replace every Param below `model` by the GGUF tensor of the same name (`prefix` + its attribute path), checking shapes."""
  for name, owner, attr, p in _walk(model, prefix):
    src = (rename or {}).get(name, name)
    if src not in gf:
      if p.optional: value = None
      else: raise GGUFError(f"{gf.path}: missing tensor {src!r} (expected shape {list(p.shape)} for {gf.arch})")
    else:
      if (got := gf.infos[src].shape) != p.shape:
        raise GGUFError(f"{gf.path}: tensor {src!r} has shape {list(got)}, expected {list(p.shape)}")
      value = gf.tensor(src, device)
    if isinstance(owner, list): owner[attr] = value
    else: setattr(owner, attr, value)
