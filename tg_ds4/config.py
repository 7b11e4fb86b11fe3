"""ModelConfig: every hyperparameter a model needs, read from GGUF metadata only (no per-model constants)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import IntEnum

from tg_ds4.io.gguf import GGUFError, GGUFFile


class Gating(IntEnum):
  """llama.cpp's llama_expert_gating_func_type."""
  SOFTMAX = 1
  SIGMOID = 2
  SOFTMAX_WEIGHT = 3
  SQRT_SOFTPLUS = 4

class RopeType(IntEnum):
  NORM = 0  # rotate adjacent pairs (x[2i], x[2i+1]): llama.cpp's deepseek2 and llama GGUFs
  NEOX = 2  # rotate halves (x[i], x[i+d/2]): qwen2, qwen3, gemma3

ROPE_TYPE = {"deepseek2": RopeType.NORM, "deepseek32": RopeType.NORM, "glm-dsa": RopeType.NORM,
             "llama": RopeType.NORM, "qwen2": RopeType.NEOX, "qwen3": RopeType.NEOX, "gemma3": RopeType.NEOX,
             "gemma4": RopeType.NEOX, "gpt2": RopeType.NORM, "bitnet": RopeType.NEOX}  # gpt2: learned absolute positions, no rotation (rope dim 0)
SUPPORTED_ARCHS = tuple(ROPE_TYPE)
SCALED_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")  # bitnet's optional `.scale`s

@dataclass(frozen=True)
class RopeConfig:
  dim: int                    # rotated dims per head
  base: float
  type: RopeType
  freq_scale: float = 1.0     # 1/factor for linear and YaRN scaling
  ext_factor: float = 0.0     # 1 with YaRN: blend interpolated and extrapolated frequencies
  attn_factor: float = 1.0    # magnitude applied to cos/sin (llama.cpp's yarn_attn_factor, before its in-kernel YaRN boost)
  orig_ctx: int = 0
  beta_fast: float = 32.0
  beta_slow: float = 1.0

  @property
  def yarn(self) -> bool: return self.ext_factor != 0.0

class Meta:
  """One architecture's GGUF metadata (`{arch}.{name}` keys) as every family's config reads it: `get` with a default,
  `need` or one clear error naming the file and the key."""
  def __init__(self, gf: GGUFFile, arch: str): self.gf, self.arch = gf, arch
  def get(self, name: str, default=None): return self.gf.get(f"{self.arch}.{name}", default)
  def need(self, name: str):
    if (v := self.get(name)) is None: raise GGUFError(f"{self.gf.path}: missing metadata key {self.arch}.{name}")
    return v
  def n_layer(self) -> int:
    """Blocks the forward runs: the multi-token-prediction blocks (`nextn_predict_layers`) at the end are not run."""
    return int(self.need("block_count")) - int(self.get("nextn_predict_layers", 0))
  def n_vocab(self) -> int:
    gf, tokens = self.gf, self.gf.get("tokenizer.ggml.tokens")
    n = self.get("vocab_size") or (len(tokens) if tokens else None) or (gf.infos["token_embd.weight"].shape[0] if "token_embd.weight" in gf else None)
    if not n: raise GGUFError(f"{gf.path}: cannot tell the vocabulary size (no {self.arch}.vocab_size, tokenizer.ggml.tokens or token_embd.weight)")
    return int(n)

@dataclass(frozen=True)
class MoEConfig:
  """The routed-expert FFN (nn/moe.py) as llama.cpp's build_moe_ffn takes it, the same for every family with experts."""
  n_expert: int
  n_expert_used: int
  expert_ff_dim: int
  n_expert_shared: int = 0
  gating: Gating = Gating.SOFTMAX
  weights_norm: bool = False     # the selected experts' weights divided by their sum
  weights_scale: float = 1.0
  n_group: int = 1               # group-limited selection: the best n_group_used groups by their top-2 sum
  n_group_used: int = 1

  @staticmethod
  def from_meta(m: Meta, gating: Gating) -> MoEConfig | None:
    """The file's expert keys, or None for a model without experts."""
    if not (n := int(m.get("expert_count", 0))): return None
    return MoEConfig(n_expert=n, n_expert_used=int(m.need("expert_used_count")), expert_ff_dim=int(m.need("expert_feed_forward_length")),
                     n_expert_shared=int(m.get("expert_shared_count", 0)), gating=gating, weights_norm=bool(m.get("expert_weights_norm", False)),
                     weights_scale=float(m.get("expert_weights_scale", 0.0) or 1.0), n_group=int(m.get("expert_group_count", 1) or 1),
                     n_group_used=int(m.get("expert_group_used_count", 1) or 1))

@dataclass(frozen=True, kw_only=True)
class BaseConfig:
  """What every family's config holds under the same names, so the shared blocks (nn/) take either."""
  n_layer: int
  dim: int
  n_vocab: int
  n_head: int
  head_dim: int               # q/k head size (MLA: nope + rope; deepseek4: the shared K=V row)
  norm_eps: float
  ctx_len: int
  rope: RopeConfig
  q_lora_rank: int = 0        # low-rank queries (attn_q_a -> norm -> attn_q_b) when > 0
  moe: MoEConfig | None = None
  # a lightning indexer (DSA, deepseek4's ratio-4 layers) picks the cached rows each query attends
  idx_n_head: int = 0
  idx_head_dim: int = 0
  idx_top_k: int = 0          # 0: no indexer

@dataclass(frozen=True, kw_only=True)
class ModelConfig(BaseConfig):
  arch: str
  n_kv_head: int
  v_head_dim: int
  kq_scale: float
  # dense FFN
  ff_dim: int = 0
  ffn_act: str = "silu"       # silu (SwiGLU) or gelu (tanh approximation: GeGLU for gemma, the plain MLP for gpt2)
  # gemma-style extras
  embed_scale: float = 1.0    # token embeddings are multiplied by this (gemma: sqrt(dim))
  swa_window: int = 0         # sliding-window attention span for the layers in swa_layers (0 = none)
  swa_layers: tuple[bool, ...] = ()
  rope_base_swa: float = 0.0  # RoPE base of the sliding-window layers
  logit_softcap: float = 0.0
  # MLA (kv_lora_rank > 0)
  kv_lora_rank: int = 0
  n_dense_lead: int = 0       # with experts: the first layers have a dense FFN
  n_nextn: int = 0            # multi-token-prediction blocks after the n_layer the forward runs (models/nextn.py)
  # optional parts, told by which tensors the file has (so the modules never read the file)
  attn_bias: bool = False          # q/k/v biases (qwen2)
  qk_norm: bool = False            # per-head q/k RMS norms (qwen3, gemma3)
  sandwich_norm: bool = False      # gemma's norms of the sublayer outputs before the residual add
  fused_gate_up_exps: bool = False  # routed experts' gate|up as one tensor
  expert_bias: bool = False        # the router's selection bias (V3-style `exp_probs_b`)
  # GPT-2 style (gpt2): learned positions, LayerNorm with bias, one q|k|v tensor, biases everywhere, ungated MLP
  pos_embd: bool = False           # `position_embd` rows added to the token embeddings (then rope.dim is 0)
  layer_norm: bool = False         # LayerNorm (mean and variance, weight and bias) instead of RMSNorm
  fused_qkv: bool = False          # `attn_qkv`: q, k and v rows in one tensor
  out_bias: bool = False           # `attn_output.bias`
  ffn_gated: bool = True           # gate|up (SwiGLU/GeGLU); False: up -> act -> down, with `ffn_up.bias`/`ffn_down.bias`
  # BitNet b1.58 (bitnet): ternary projections, normed inputs to the two output projections
  sub_norm: bool = False           # `attn_sub_norm` before attn_output, `ffn_sub_norm` of act(gate) * up before ffn_down
  weight_scales: bool = False      # per-tensor output scales (`attn_q.scale`, ...), each optional as llama.cpp loads them
  # Gemma 4 (gemma4): two layer kinds of their own widths, layers reading earlier layers' KV, per-layer embeddings
  head_dim_swa: int = 0            # q/k/v head size of the sliding-window layers (0: head_dim)
  rope_dim_swa: int = 0            # rotated dims of the sliding-window layers (0: rope.dim)
  n_kv_heads: tuple[int, ...] = ()  # per-layer KV heads (empty: n_kv_head everywhere)
  ff_dims: tuple[int, ...] = ()    # per-layer FFN widths (empty: ff_dim everywhere)
  v_from_k: tuple[bool, ...] = ()  # per layer: no `attn_v`, V is the raw K projection (attention_k_eq_v)
  v_norm: bool = False             # V RMS-normed without a weight
  n_kv_shared: int = 0             # the last n layers own no KV and attend over an earlier layer's (kv_source)
  per_layer_dim: int = 0           # per-layer embedding width (`per_layer_token_embd`, each block's `inp_gate`/`proj`)
  layer_output_scale: bool = False  # each block's output times its `layer_output_scale`
  # DeepSeek sparse attention (deepseek32, glm-dsa): the indexer's rotation, key norm and layers
  idx_rope: RopeType = RopeType.NEOX  # the indexer's rotation of its first rope.dim dims: NEOX deepseek32, NORM glm-dsa
  idx_norm_eps: float = 0.0        # its key LayerNorm's eps, fixed in llama.cpp's code: 1e-6 deepseek32, never set (0) glm-dsa
  idx_full: tuple[bool, ...] = ()  # per layer: its own indexer (True) or the previous full layer's selection (glm-dsa "shared")

  @property
  def mla(self) -> bool: return self.kv_lora_rank > 0
  @property
  def qk_nope(self) -> int: return self.head_dim - self.rope.dim
  def is_moe_layer(self, i: int) -> bool: return self.moe is not None and i >= self.n_dense_lead
  def is_swa_layer(self, i: int) -> bool: return bool(self.swa_window) and bool(self.swa_layers) and self.swa_layers[i]
  def kv_source(self, i: int) -> int | None:
    """The layer whose KV cache layer i attends over when it owns none: llama.cpp's rule for gemma4, the last cache-owning
    layer for a full-attention layer and the one before it for a sliding-window layer (transformers picks the last
    cache-owning layer of the same kind: the same layers for the released models' patterns)."""
    if i < (own := self.n_layer - self.n_kv_shared): return None
    return own - (2 if self.is_swa_layer(i) else 1)
  def layer(self, i: int) -> ModelConfig:
    """This config as layer i sees it: its head size, KV heads, FFN width and rotated dims where they vary by layer."""
    if not (self.head_dim_swa or self.n_kv_heads or self.ff_dims): return self
    swa = self.is_swa_layer(i)
    d = self.head_dim_swa if swa and self.head_dim_swa else self.head_dim
    return replace(self, head_dim=d, v_head_dim=d, n_kv_head=self.n_kv_heads[i] if self.n_kv_heads else self.n_kv_head,
                   ff_dim=self.ff_dims[i] if self.ff_dims else self.ff_dim,
                   rope=replace(self.rope, dim=self.rope_dim_swa) if swa and self.rope_dim_swa else self.rope)

  @staticmethod
  def from_gguf(gf: GGUFFile) -> ModelConfig:
    arch = gf.arch
    if arch not in SUPPORTED_ARCHS:
      raise GGUFError(f"{gf.path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    m = Meta(gf, arch)
    key = m.get
    n_layer = m.n_layer()
    dim, n_head = int(m.need("embedding_length")), int(m.need("attention.head_count"))
    n_kv_head, n_kv_heads = key("attention.head_count_kv", n_head), ()
    if isinstance(n_kv_head, list):
      if arch != "gemma4": raise GGUFError(f"{gf.path}: per-layer {arch}.attention.head_count_kv is not supported")
      n_kv_heads, n_kv_head = tuple(int(v) for v in n_kv_head[:n_layer]), max(n_kv_head)
    ff, ff_dims = key("feed_forward_length", 0), ()
    if isinstance(ff, list): ff_dims, ff = tuple(int(v) for v in ff[:n_layer]), max(ff)  # gemma4's double-wide FFNs
    n_vocab = m.n_vocab()
    kv_lora = int(key("attention.kv_lora_rank", 0))
    head_dim = int(key("attention.key_length_mla", 0) or key("attention.key_length", 0) or dim // n_head)
    v_head_dim = int(key("attention.value_length_mla", 0) or key("attention.value_length", 0) or head_dim)
    has = lambda name: any(f"blk.{i}.{name}" in gf for i in range(n_layer))
    pos_embd = "position_embd.weight" in gf
    rope_dim = 0 if pos_embd else int(key("rope.dimension_count", head_dim))
    ctx_len = int(key("context_length", 4096))

    # RoPE scaling, with llama.cpp's constants: linear = interpolate only; YaRN = blend + attention-scale fix
    scaling, factor = key("rope.scaling.type", "none"), float(key("rope.scaling.factor", 0.0) or 0.0)
    freq_scale = 1.0 / factor if factor > 0 and scaling in ("linear", "yarn") else 1.0
    yarn = scaling == "yarn" and freq_scale != 1.0
    log_mul = float(key("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1  # the converter stored 0.1 * mscale_all_dim
    mscale = lambda s, m: 1.0 if s <= 1 else 1.0 + 0.1 * m * math.log(s)  # DeepSeek's yarn_get_mscale
    attn_factor = 1.0
    if yarn:  # llama.cpp's yarn_attn_factor: it cancels the (1 + 0.1 ln factor) boost its rope kernel applies under YaRN
      attn_factor = (1.0 if log_mul else mscale(factor, 1.0)) / (1.0 + 0.1 * math.log(factor))
    attn_factor *= float(key("rope.scaling.attn_factor", 1.0) or 1.0)
    # deepseek2 folds YaRN's mscale_all_dim into the softmax scale: kq_scale = mscale^2 / sqrt(qk head dim)
    kq_mscale = attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale)) * (1.0 + 0.1 * log_mul * math.log(1.0 / freq_scale)) \
      if arch in ("deepseek2", "deepseek32") else 1.0
    if arch == "glm-dsa" and yarn:  # llama.cpp's glm-dsa reads no YaRN log multiplier; GLM-5 ships without YaRN
      raise GGUFError(f"{gf.path}: glm-dsa with YaRN RoPE scaling is not supported")
    rope = RopeConfig(rope_dim, float(key("rope.freq_base", 10000.0)), ROPE_TYPE[arch], freq_scale, 1.0 if yarn else 0.0, attn_factor,
                      int(key("rope.scaling.original_context_length", ctx_len)), float(key("rope.scaling.yarn_beta_fast", 32.0)),
                      float(key("rope.scaling.yarn_beta_slow", 1.0)))

    # sliding-window layers as llama.cpp's load_swa_pattern: an explicit per-layer array, or every n-th layer global
    swa_window, swa_layers = int(key("attention.sliding_window", 0) or 0), ()
    if swa_window and arch in ("gemma3", "gemma4"):
      pat = key("attention.sliding_window_pattern", 6)
      swa_layers = tuple(bool(v) for v in pat) if isinstance(pat, list) else tuple(pat == 0 or i % pat < pat - 1 for i in range(n_layer))
    gemma = arch in ("gemma3", "gemma4")
    if arch == "gemma4" and has("ffn_gate_inp.weight"):
      raise GGUFError(f"{gf.path}: gemma4 with experts (blk.*.ffn_gate_inp.weight, the 26B-A4B) is not supported, only the dense models")
    norm_eps = key("attention.layer_norm_rms_epsilon") or key("attention.layer_norm_epsilon", 1e-5)  # RMSNorm / LayerNorm
    # gemma3 scales q by 1/sqrt(head_dim), except the 27B (62 layers): 1/sqrt(dim / n_head); gemma4 not at all (its q/k norms)
    attn_scale = 1.0 if arch == "gemma4" else 1.0 / math.sqrt(dim / n_head if gemma and n_layer == 62 else head_dim)

    n_kv_shared = int(key("attention.shared_kv_layers", 0) or 0)
    gating = key("expert_gating_func", 0)
    if not gating and arch == "deepseek32": raise GGUFError(f"{gf.path}: missing metadata key deepseek32.expert_gating_func")
    if not gating and arch == "glm-dsa": gating = Gating.SIGMOID  # llama.cpp's default for glm-dsa
    if not gating:  # llama.cpp's default for GGUFs without the key: softmax, except GLM-4.7-Flash (sigmoid)
      gating = Gating.SIGMOID if arch == "deepseek2" and n_layer in (47, 48) and n_vocab == 154880 else Gating.SOFTMAX
    moe = MoEConfig.from_meta(m, Gating(int(gating)))
    cfg = ModelConfig(
      arch=arch, n_layer=n_layer, dim=dim, n_vocab=n_vocab, n_head=n_head, n_kv_head=int(n_kv_head), head_dim=head_dim,
      v_head_dim=v_head_dim, norm_eps=float(norm_eps), ctx_len=ctx_len, rope=rope,
      kq_scale=kq_mscale * kq_mscale * attn_scale, ff_dim=int(ff), ffn_act="gelu" if gemma or arch == "gpt2" else "silu",
      embed_scale=math.sqrt(dim) if gemma else 1.0, swa_window=swa_window if swa_layers else 0, swa_layers=swa_layers,
      rope_base_swa=float(key("rope.freq_base_swa", 10000.0)), logit_softcap=float(key("final_logit_softcapping", 0.0) or 0.0),
      q_lora_rank=int(key("attention.q_lora_rank", 0) or 0), kv_lora_rank=kv_lora,
      moe=moe, n_dense_lead=int(key("leading_dense_block_count", 0)) if moe else 0, n_nextn=int(key("nextn_predict_layers", 0) or 0),
      attn_bias=has("attn_q.bias") or has("attn_qkv.bias"), qk_norm=has("attn_q_norm.weight"), sandwich_norm=has("post_attention_norm.weight"),
      fused_gate_up_exps=has("ffn_gate_up_exps.weight"), expert_bias=has("exp_probs_b.bias"),
      pos_embd=pos_embd, layer_norm=has("attn_norm.bias"), fused_qkv=has("attn_qkv.weight"), out_bias=has("attn_output.bias"),
      ffn_gated=moe is not None or has("ffn_gate.weight") or not has("ffn_up.weight"), sub_norm=has("attn_sub_norm.weight"),
      weight_scales=any(has(f"{t}.scale") for t in SCALED_TENSORS),
      head_dim_swa=int(key("attention.key_length_swa", 0) or 0), rope_dim_swa=int(key("rope.dimension_count_swa", 0) or 0),
      n_kv_heads=n_kv_heads, ff_dims=ff_dims, n_kv_shared=n_kv_shared, v_norm=arch == "gemma4",
      v_from_k=tuple(i < n_layer - n_kv_shared and f"blk.{i}.attn_v.weight" not in gf for i in range(n_layer)) if arch == "gemma4" else (),
      per_layer_dim=int(key("embedding_length_per_layer_input", 0) or 0), layer_output_scale=has("layer_output_scale.weight"),
      **_indexer(m, n_layer, ctx_len, rope_dim))
    for i in range(n_layer):
      if (src := cfg.kv_source(i)) is None: continue
      mine, theirs = cfg.layer(i), cfg.layer(src)
      if src < 0 or cfg.is_swa_layer(src) != cfg.is_swa_layer(i) or (mine.head_dim, mine.n_kv_head) != (theirs.head_dim, theirs.n_kv_head):
        raise GGUFError(f"{gf.path}: layer {i} shares the KV of layer {src} ({arch}.attention.shared_kv_layers = {n_kv_shared}), "
                        "which is not a cache-owning layer of its kind and width")
    return cfg

def _indexer(m: Meta, n_layer: int, ctx_len: int, rope_dim: int) -> dict:
  """The DSA indexer's fields (deepseek32 / glm-dsa), as llama.cpp's loaders read them."""
  gf, arch = m.gf, m.arch
  if arch not in ("deepseek32", "glm-dsa"): return {}
  n_head, head_dim, top_k = (int(m.need(f"attention.indexer.{k}")) for k in ("head_count", "key_length", "top_k"))
  types = m.get("attention.indexer.types")
  if arch == "deepseek32": full = (True,) * n_layer
  elif types is not None: full = tuple(bool(v) for v in types[:n_layer])
  else: full = tuple(ctx_len < 1048576 or i < 2 or (i - 2) % 4 == 0 for i in range(n_layer))  # llama.cpp's GLM-5.2 pattern past 1M
  if not full[0]: raise GGUFError(f"{gf.path}: {arch}.attention.indexer.types: layer 0 must have its own indexer")
  if rope_dim > head_dim: raise GGUFError(f"{gf.path}: {arch}.rope.dimension_count {rope_dim} exceeds the indexer's key_length {head_dim}")
  return dict(idx_n_head=n_head, idx_head_dim=head_dim, idx_top_k=top_k, idx_rope=RopeType.NEOX if arch == "deepseek32" else RopeType.NORM,
              idx_norm_eps=1e-6 if arch == "deepseek32" else 0.0, idx_full=full)
