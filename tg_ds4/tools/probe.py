"""`tg_ds4 probe`: what a model computes at each layer, as files (artifacts, not claims).

For a prompt, the model runs forward in plain (not captured) chunks with taps on its blocks: the residual stream after
each block (deepseek4: its hyper-connection streams `[T, hc, dim]`), each attention sublayer's output, and each MoE
layer's routing (expert ids and weights per token). A logit lens puts every recorded residual through the model's own
head (`Model.head`: final norm, output matrix; deepseek4's stream collapse first) and keeps each position's top 5. The taps realize
what they record, so the kernels differ from generation's; the arithmetic is the same (tests/test_probe.py holds the
hidden states to transformers' `output_hidden_states`)."""
from __future__ import annotations

import json, pathlib
from dataclasses import dataclass, field

import numpy as np
from tinygrad import Tensor, UOp, dtypes

from tg_ds4.quant import settings

TOP = 5

@dataclass
class Probe:
  tokens: list[int]
  hidden: list[np.ndarray] = field(default_factory=list)           # embeddings, then the residual after each block
  attn: list[np.ndarray] = field(default_factory=list)             # each block's attention sublayer output
  routes: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # MoE layer -> (ids, weights) [T, k]
  lens: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # per hidden entry: top ids, logits [T, TOP]

class _Tap:
  """Stands in for a model part during a probe: calls it, records (a host copy of) what it returned."""
  def __init__(self, inner, record, inputs=None):
    self.inner, self.record, self.inputs = inner, record, inputs
  def __getattr__(self, name): return getattr(self.inner, name)
  def __call__(self, *args, **kw):
    if self.inputs is not None: self.inputs(args[0].realize().numpy())
    out = self.inner(*args, **kw)
    self.record(out.realize().numpy())
    return out

def run(runner, tokens: list[int], chunk: int | None = None) -> Probe:
  """Every block's residual and attention output, the MoE routing and the logit lens over `tokens` from position 0,
  in forwards of `chunk` tokens (default: as many as the model takes in one)."""
  m, p = runner.model, Probe(tokens)
  n = len(m.blk)
  chunks: dict[str, list] = {"embed": [], **{f"h{i}": [] for i in range(n)}, **{f"a{i}": [] for i in range(n)}}
  routed: dict[int, list] = {}
  saved = list(m.blk)
  def route_tap(ffn, i):
    inner = ffn.route
    def route(*args):
      ids, w = inner(*args)
      routed.setdefault(i, []).append((ids.realize().numpy(), w.realize().numpy()))
      return ids, w
    return route
  attn_saved = [b.attn for b in saved]
  try:
    for i, b in enumerate(saved):
      b.attn = _Tap(b.attn, chunks[f"a{i}"].append)
      if hasattr(b.ffn, "route"): b.ffn.route = route_tap(b.ffn, i)
      m.blk[i] = _Tap(b, chunks[f"h{i}"].append, chunks["embed"].append if i == 0 else None)
    step = min(chunk or len(tokens), getattr(m, "MAX_FORWARD_TOKENS", None) or len(tokens))
    for s in range(0, len(tokens), step):  # a symbolic position: chunks of one size share their kernels
      m.forward(Tensor([tokens[s:s + step]], dtype=dtypes.int32), UOp.variable("start_pos", 0, m.max_ctx - 1).bind(s)).realize()
  finally:
    m.blk[:] = saved
    for b, a in zip(saved, attn_saved):
      b.attn = a
      b.ffn.__dict__.pop("route", None)
  cat = lambda parts: np.concatenate(parts, axis=1)[0]  # chunks of [1, T, ...] -> [T_all, ...]
  p.hidden = [cat(chunks["embed"])] + [cat(chunks[f"h{i}"]) for i in range(n)]
  p.attn = [cat(chunks[f"a{i}"]) for i in range(n)]
  for i, parts in routed.items():
    ids, w = np.concatenate([a for a, _ in parts], axis=1)[0], np.concatenate([b for _, b in parts], axis=1)[0]
    p.routes[i] = (ids.reshape(len(tokens), -1), w.reshape(len(tokens), -1))
  with settings.override(runner.device, numerics="exact", matmul=m.settings.matmul):  # the logit lens: exact float math
    for h in p.hidden:
      top = m.head(Tensor(h[None], device=runner.device)).topk(TOP)
      p.lens.append((top[1].numpy()[0].astype(np.int64), top[0].numpy()[0]))
  return p

def rms(a: np.ndarray) -> np.ndarray: return np.sqrt((a.astype(np.float64) ** 2).mean(-1)).reshape(a.shape[0], -1).mean(-1)

def write(p: Probe, out: pathlib.Path, model: str, piece, layers: list[int] | None = None) -> dict:
  """The probe's files in `out`: .npy per recorded array, summary.json, probe.png. `piece(id)` -> the token's text."""
  out.mkdir(parents=True, exist_ok=True)
  n = len(p.attn)
  keep = sorted(set(range(n)) if layers is None else set(layers))
  np.save(out / "embed.npy", p.hidden[0])
  for i in keep:
    np.save(out / f"blk.{i}.hidden.npy", p.hidden[i + 1])
    np.save(out / f"blk.{i}.attn.npy", p.attn[i])
    if i in p.routes:
      np.save(out / f"blk.{i}.experts.npy", p.routes[i][0]); np.save(out / f"blk.{i}.expert_weights.npy", p.routes[i][1])
  lens_rows = lambda j: [[[int(t), piece(int(t)), round(float(v), 4)] for t, v in zip(ids, vals)] for ids, vals in zip(*p.lens[j])]
  summary = {"model": model, "tokens": p.tokens, "pieces": [piece(t) for t in p.tokens], "layers": [], "hidden_shape": list(p.hidden[0].shape),
             "logit_lens": {"embed": lens_rows(0), **{str(i): lens_rows(i + 1) for i in keep}}}
  for i in keep:
    row = {"layer": i, "hidden_rms": rms(p.hidden[i + 1]).round(5).tolist(), "attn_rms": rms(p.attn[i]).round(5).tolist()}
    if i in p.routes:
      ids, counts = np.unique(p.routes[i][0], return_counts=True)
      row["experts"] = {str(int(e)): int(c) for e, c in zip(ids, counts)}
    summary["layers"].append(row)
  (out / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
  _plot(p, out / "probe.png", model, keep)
  return summary

def _plot(p: Probe, path: pathlib.Path, model: str, keep: list[int]) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  moe = [i for i in keep if i in p.routes]
  fig, axes = plt.subplots(1, 1 + min(len(moe), 4), figsize=(4 + 3.5 * min(len(moe), 4), 3.4), squeeze=False)
  a = axes[0][0]
  a.plot(range(len(p.hidden)), [rms(h).mean() for h in p.hidden], "o-", label="residual after block")
  a.plot(range(1, len(p.attn) + 1), [rms(x).mean() for x in p.attn], "s--", label="attention output")
  a.set_xlabel("block (0 = embeddings)"); a.set_title("mean RMS per token", fontsize=10); a.legend(fontsize=7)
  for ax, i in zip(axes[0][1:], moe):
    ids, counts = np.unique(p.routes[i][0], return_counts=True)
    ax.bar(ids, counts, width=0.8); ax.set_title(f"blk.{i}: tokens per expert", fontsize=10); ax.set_xlabel("expert")
  fig.suptitle(f"{model}: {len(p.tokens)} tokens"); fig.tight_layout(); fig.savefig(path, dpi=90); plt.close(fig)

def lens_table(summary: dict, position: int = -1) -> str:
  """The logit lens at one position as text: a row per recorded layer, its top tokens best first."""
  rows = [f"logit lens at position {len(summary['tokens']) + position if position < 0 else position} "
          f"(after token {summary['pieces'][position]!r}): top {TOP}"]
  for name, table in summary["logit_lens"].items():
    rows.append(f"  {'embed' if name == 'embed' else 'blk.' + name:<8} " + "  ".join(f"{t[1]!r} {t[2]:.2f}" for t in table[position]))
  return "\n".join(rows)
