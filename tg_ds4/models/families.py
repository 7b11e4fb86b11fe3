"""What a model is to the rest of tg_ds4 (`Model`), and which config and model class each GGUF architecture gets.

`load_model` is the one place a model file is read: the config from its metadata (and which optional tensors it has),
then the weights. Everything after that (captured steps, generation, prefix reuse) belongs to runtime/runner.py's Runner."""
from __future__ import annotations

import dataclasses, logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tinygrad import Tensor, UOp

from tg_ds4.config import Meta, ModelConfig
from tg_ds4.io.gguf import GGUFError, GGUFFile
from tg_ds4.models import nextn
from tg_ds4.models.deepseek4 import DS4Config, DS4Transformer, nextn_unsupported
from tg_ds4.models.transformer import Transformer
from tg_ds4.quant import settings


class Model(Protocol):
  """A loaded model: a forward over its own caches, the cache layout, and how far a cached prefix can be reused."""
  cfg: Any                          # ModelConfig or DS4Config: n_vocab, ctx_len, ...
  max_ctx: int
  settings: settings.Settings        # the device's capabilities, the numerics and precision its graphs are built with
  PREFILL_CHUNKS: tuple[int, ...]   # token counts of the captured prefill steps, ascending
  PREFILL_CHUNK: int                # the most tokens one prefill step writes (the caches' slack past max_ctx)
  MAX_FORWARD_TOKENS: int | None    # the most tokens one forward takes; None: any
  max_rewind: int | None            # a run may start at most this far before the furthest row written; None: anywhere
  slots: int                        # sequences whose caches sit side by side (nn/cache_rows.py); a batched step needs > 1

  def forward(self, tokens: Tensor | UOp, start_pos: int | UOp, last_only: bool = False, select: Tensor | None = None) -> Tensor:
    """tokens `[1, T]` (or one token as a bound variable) at positions start_pos.. -> logits `[1, T, vocab]`; the
    caches are written in the same graph."""
    ...
  def head(self, x: Tensor) -> Tensor:
    """The residual stream after the last block -> logits (what forward does after its blocks; probe's logit lens)."""
    ...
  def check_resume(self, start_pos: int) -> None:
    """Raise ValueError unless the caches hold what a run starting at `start_pos` needs."""
    ...
  def cache_tensors(self, slot: int = 0) -> list[tuple[str, Tensor, int, Callable[[int], int]]]:
    """(name, tensor, row axis, rows(n)) of every cache tensor of `slot` whose rows [0:rows(n)] are the state after n
    tokens (serve --kv-cache-dir saves and restores them)."""
    ...

@dataclass(frozen=True)
class Arch:
  config: Any  # a frozen config class with from_gguf(gf)
  model: Any   # a Model class with load(cfg, gf, device, max_ctx, numerics)

_DEEPSEEK2_AND_DENSE = Arch(ModelConfig, Transformer)
ARCHS: dict[str, Arch] = {"deepseek2": _DEEPSEEK2_AND_DENSE, "llama": _DEEPSEEK2_AND_DENSE, "qwen2": _DEEPSEEK2_AND_DENSE,
                          "qwen3": _DEEPSEEK2_AND_DENSE, "gemma3": _DEEPSEEK2_AND_DENSE, "gpt2": _DEEPSEEK2_AND_DENSE,
                          "bitnet": _DEEPSEEK2_AND_DENSE, "gemma4": _DEEPSEEK2_AND_DENSE, "deepseek32": _DEEPSEEK2_AND_DENSE,
                          "glm-dsa": _DEEPSEEK2_AND_DENSE,
                          "deepseek4": Arch(DS4Config, DS4Transformer)}

def config_of(gf: GGUFFile) -> Any:
  if (a := ARCHS.get(gf.arch)) is None:
    raise GGUFError(f"{gf.path}: architecture {gf.arch!r} is not supported (supported: {', '.join(ARCHS)})")
  return a.config.from_gguf(gf)

def mtp_unavailable(gf: GGUFFile, draft: GGUFFile | None = None) -> str | None:
  """Why the multi-token-prediction block of `gf` (or of `draft`, a file holding only the block, for the target `gf`)
  cannot draft, or None when it can (models/nextn.py, models/deepseek4.py's DS4NextN)."""
  cfg = config_of(gf)
  if draft is not None:
    if draft.arch != gf.arch: return f"its multi-token-prediction block is {draft.arch}'s, the model is {gf.arch}"
    if isinstance(cfg, DS4Config):
      if (why := DS4Transformer.draft_mismatch(cfg, d := DS4Config.from_gguf(draft))) is not None: return why
      cfg = d
    else:  # the block's tensors are loaded with the model's config: their shapes are checked then
      if (n := Meta(draft, draft.arch).n_layer()) != cfg.n_layer:
        return f"its multi-token-prediction block follows {n} layers, the model has {cfg.n_layer}"
      cfg = dataclasses.replace(cfg, n_nextn=int(draft.get(f"{draft.arch}.nextn_predict_layers", 0) or 0))
  if isinstance(cfg, DS4Config):
    if draft is None and (not cfg.n_nextn or f"blk.{cfg.n_layer}.nextn.eh_proj.weight" not in gf):
      return "it has no multi-token-prediction block; a deepseek4 model's is a file of its own, written by convert_hf_to_gguf.py --mtp"
    return nextn_unsupported(cfg)
  if not getattr(cfg, "n_nextn", 0): return "it has no multi-token-prediction layers"
  if ARCHS[gf.arch].model is not Transformer: return f"drafting with {gf.arch}'s multi-token-prediction layers is not supported"
  return nextn.supported(cfg)

def is_mtp_file(gf: GGUFFile) -> bool:
  """`gf` holds a multi-token-prediction block and none of the layers before it (convert_hf_to_gguf.py --mtp's draft)."""
  return bool(gf.get(f"{gf.arch}.nextn_predict_layers", 0)) and "blk.0.attn_norm.weight" not in gf

DEFAULT_CONTEXT = 4096  # the CLI's and the server's context when none is given, or the model's when that is smaller

def default_context(gf: GGUFFile) -> int: return min(DEFAULT_CONTEXT, config_of(gf).ctx_len)

def load_model(gf: GGUFFile, device: str, max_ctx: int | None = None, numerics: str = settings.DEFAULT_NUMERICS, slots: int = 1,
               mtp: bool | GGUFFile = False) -> Model:
  """The model of `gf`: config, weights (packed, mmapped), caches for `max_ctx` positions (default: the file's context).
  A context past the trained one is allowed, as llama.cpp allows it, with one warning: the math is defined there (RoPE
  of any position), only the model's quality is not. `numerics`: how quantized matmuls treat their inputs
  (quant/activations.py: "auto", "exact" or "llama.cpp"). `mtp`: with the multi-token-prediction block, for drafting:
  the file's own (True) or a file holding only the block (`is_mtp_file`)."""
  cfg = config_of(gf)
  if (max_ctx := max_ctx or cfg.ctx_len) > cfg.ctx_len and getattr(cfg, "pos_embd", False):
    raise GGUFError(f"{gf.path}: learned positions (position_embd) for {cfg.ctx_len} tokens, a context of {max_ctx} was asked for")
  if max_ctx > cfg.ctx_len:
    logging.getLogger("tg_ds4").warning("%s: a context of %d positions exceeds the %d the model was trained for", gf.path.name, max_ctx, cfg.ctx_len)
  if mtp and (why := mtp_unavailable(gf, None if mtp is True else mtp)) is not None: raise GGUFError(f"{gf.path if mtp is True else mtp.path}: {why}")
  return ARCHS[gf.arch].model.load(cfg, gf, device, max_ctx, settings.check(numerics), slots, **({"mtp": mtp} if mtp else {}))
