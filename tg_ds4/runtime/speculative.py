"""Speculative decoding: a draft proposes k tokens, the target checks all of them in one step.

The check is the target's verify step (Runner.verify): the pending token and the k drafts as k+1 rows of one sequence
at consecutive positions, each row in the batched step's form. Every row's cache row is stored before any row attends,
so row i sees the drafts before it, and a row computes what the per-token step computes at its position (bit for bit
under the default numerics on quantized weights, docs/numerics.md): greedy speculation gives plain greedy's tokens.
Rows past the accepted drafts stay in the caches as stale rows, which the next step at that position overwrites before
any query reads them (a query at p reads rows <= p; DeepSeek V4's rings keep PREFILL_CHUNK positions of slack, the
same rule that lets a padded prefill chunk write ahead).

Where a step is bound by launches and weight reads rather than arithmetic (a GPU, and one stream on most machines), the
k+1 rows cost about one step, so accepted drafts are nearly free tokens.

Acceptance: greedy keeps the drafts up to the first one the target's argmax disagrees with, then the target's own
token. Sampled, the standard rule (Leviathan et al. 2023, Chen et al. 2023) keeps the target's distribution p: draft d
drawn from the draft's q is accepted with probability min(1, p(d) / q(d)); the first rejected one is replaced by a draw
from max(0, p - q) normalised; when all k are accepted, one more token is drawn from p at the next position. p and q are
the distributions the per-token sampler draws from (sampling.py's distribution: the filters, then temperature). Every
draw comes from a numpy generator seeded with the request's seed, so a seed gives the same text.

Drafters (`Drafter`): `DraftModel`, a smaller model of the same vocabulary with its own caches; `MTPDraft`, the
target's own multi-token-prediction block (models/nextn.py), which every target step keeps up to date."""
from __future__ import annotations

import os, time
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np

from tg_ds4.backend.buffers import host_array
from tg_ds4.io.gguf import GGUFFile
from tg_ds4.models.families import is_mtp_file, mtp_unavailable
from tg_ds4.runtime.runner import FEED_TOKENS, GREEDY, Runner, reusable_prefix
from tg_ds4.runtime.sampling import SamplingParams, rng

MAX_VOCAB_DIFFERENCE = 128  # a draft's vocabulary may be this many padding entries shorter or longer (llama.cpp's rule)

class Drafter(Protocol):
  def propose(self, seq: list[int], k: int, sampling: tuple, gen: np.random.Generator | None,
              slot: int = 0) -> tuple[list[int], np.ndarray | None]:
    """k tokens to follow `seq` (the prompt and every token generated so far, all but the last in the target's cache
    slot `slot`); greedy (`sampling` empty), or each drawn with `gen` from the drafter's distribution, returned
    `[k, vocab]` as the acceptance rule's q."""

class DraftModel:
  """A draft model run by its own Runner (one sequence: it follows whichever sequence asks next). It brings its cache
  to the sequence first, reusing the longest prefix its rows still hold (the rows of drafts the target rejected are
  stale like the target's), the rest in prefill chunks as Runner.generate would and a short tail through the
  per-token step, whose last step gives the first draft; then it proposes token by token."""
  def __init__(self, runner: Runner):
    self.runner = runner
    self.furthest: int | None = None  # the furthest cache row it wrote since it last started at position 0 (None: not known)

  def _start(self, seq: list[int]) -> int:
    """Where to resume for `seq`: Runner.reusable, except that for ring caches (DeepSeek V4) the rows before the
    common prefix hold while no row it wrote reaches max_rewind positions past it, judged on the rows it knows it
    wrote instead of a padded chunk's worst case, so a rejected draft does not mean a prefill from scratch."""
    r, rewind = self.runner, self.runner.model.max_rewind
    if rewind is None or self.furthest is None: return r.reusable(seq)
    n = reusable_prefix(seq, r.cached)
    return n if self.furthest - n < rewind else 0

  def propose(self, seq: list[int], k: int, sampling: tuple, gen: np.random.Generator | None,
              slot: int = 0) -> tuple[list[int], np.ndarray | None]:
    r = self.runner
    step = (lambda t, p: r.next_distribution(t, p, sampling)) if sampling else (lambda t, p: r.next_token(t, p))
    start = self._start(seq)
    sizes, fed = r.prefill_plan(len(seq) - 1 - start, FEED_TOKENS)
    # what was written before (not known: Runner.reusable's worst case), unless it starts over; then the rows it writes
    # now: the chunks (the last padded), the tail, and every draft but the last
    before = -1 if start == 0 else self.furthest if self.furthest is not None else len(r.cached) - 1 + r.model.PREFILL_CHUNK
    self.furthest = max(before, start + sum(sizes) - 1, len(seq) - 2 + k)
    if sizes: r.prefill_chunks(seq[start:len(seq) - 1 - fed], start, sizes)
    r.cached = list(seq[:len(seq) - 1 - fed])
    for p in range(len(seq) - 1 - fed, len(seq) - 1): step(seq[p], p)  # the tail it has not seen
    tok, pos, drafts, qs = seq[-1], len(seq) - 1, [], []
    for _ in range(k):
      if sampling: qs.append(q := step(tok, pos)); tok = draw(q, gen)
      else: tok = int(host_array(step(tok, pos)).item())
      drafts.append(tok); pos += 1
    return drafts, np.stack(qs) if sampling else None

class MTPDraft:
  """Drafts with the target's multi-token-prediction block (a runner loaded with `mtp`): the first draft from the
  target's hidden state of the last token it computed, each further one from the block's own (Runner.draft_next).
  Nothing to catch up: every target step stored the block's cache rows for its own rows."""
  def __init__(self, runner: Runner): self.runner = runner

  def propose(self, seq: list[int], k: int, sampling: tuple, gen: np.random.Generator | None,
              slot: int = 0) -> tuple[list[int], np.ndarray | None]:
    tok, pos, drafts, qs = seq[-1], len(seq) - 1, [], []
    for i in range(k):
      if sampling: qs.append(q := self.runner.draft_next(tok, pos + i, slot, sampling)); tok = draw(q, gen)
      else: tok = self.runner.draft_next(tok, pos + i, slot)
      drafts.append(tok)
    return drafts, np.stack(qs) if sampling else None

def mtp_source(draft: GGUFFile | None) -> bool | GGUFFile:
  """Runner.load's `mtp` for speculation drafted by the GGUF `draft` (None: the target's own multi-token-prediction
  block): True, the draft itself when it holds only a block (convert_hf_to_gguf.py --mtp's file), else False (a draft
  model, DraftModel)."""
  if draft is None: return True
  return draft if is_mtp_file(draft) else False

def draw(p: np.ndarray, gen: np.random.Generator) -> int:
  """One token from the (possibly unnormalised) distribution `p` `[vocab]`; never one of probability 0."""
  c = np.cumsum(p, dtype=np.float64)
  return int(min(np.searchsorted(c, gen.random() * c[-1], side="right"), len(p) - 1))

def accept_sampled(p: np.ndarray, q: np.ndarray, drafts: list[int], gen: np.random.Generator) -> list[int]:
  """The target's distributions `p` `[k+1, vocab]` at the pending token's position and at each draft's, the draft's
  `q` `[k, vocab]`, the k `drafts` -> the tokens to emit: the accepted drafts and one token more (module docstring)."""
  if q.shape[1] < p.shape[1]: q = np.pad(q, ((0, 0), (0, p.shape[1] - q.shape[1])))  # a draft's shorter (padding) vocabulary
  for i, d in enumerate(drafts):
    if d < p.shape[1] and gen.random() * q[i, d] < p[i, d]: continue  # accepted with probability min(1, p/q)
    rest = np.maximum(p[i].astype(np.float64) - q[i, :p.shape[1]], 0.0)
    return drafts[:i] + [draw(rest if rest.sum() > 0 else p[i], gen)]
  return list(drafts) + [draw(p[len(drafts)], gen)]

def verify_rows(target: Runner, pending: int, drafts: list[int]) -> list[int]:
  """The verify step's tokens: the pending one and the drafts, a draft's padding id past the target's vocabulary
  (rejected where it stands by either rule) replaced by a valid one."""
  V = target.model.cfg.n_vocab
  return [pending] + [d if d < V else 0 for d in drafts]

def verify_greedy(target: Runner, pending: int, drafts: list[int], pos: int, slot: int = 0) -> list[int]:
  """Greedy acceptance in one verify step at `pos` of `slot`: the drafts up to the first the target's argmax disagrees
  with, then the target's own token."""
  g = target.verify(verify_rows(target, pending, drafts), pos, slot)
  j = next((i for i, d in enumerate(drafts) if d != int(g[i])), len(drafts))
  return drafts[:j] + [int(g[j])]

def speculate(target: Runner, drafter: Drafter, prompt: list[int], max_new: int, k: int, params: SamplingParams = GREEDY,
              stop: set[int] = frozenset(), start_pos: int = 0) -> Iterator[int]:
  """Up to `max_new` token ids after `prompt` (its first `start_pos` tokens already in the target's cache), k drafts
  checked per target step. The first token comes from the prompt's prefill as in Runner.generate; near the end of
  the context, where k more rows do not fit, the rest goes through the target's per-token step. The target's stats
  count what was drafted and accepted. A caller that stops resuming the iterator cancels the rest."""
  if k < 1: raise ValueError(f"speculative k must be at least 1, got {k}")
  max_new = target.begin(prompt, max_new, start_pos)
  seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
  sp = () if params.greedy else params.tensors(target.device)
  gen = None if params.greedy else np.random.default_rng(seed)
  st, t0 = target.stats, time.perf_counter()
  first = int(host_array(target.first_token(prompt, start_pos, params, () if params.greedy else (*sp, rng(seed, 0, target.device)), None)).item())
  seq, emitted = list(prompt) + [first], 1
  st.prefill_s = st.first_token_s = (t1 := time.perf_counter()) - t0
  st.generated = 1
  yield first
  if first in stop: return
  while emitted < max_new:
    pos = len(seq) - 1  # the pending token's position: its row and the drafts' are written by this step
    if pos + k + 1 > target.model.max_ctx:  # no room for k more rows: the per-token step
      nxt = target.next_token(seq[-1], pos, params, () if params.greedy else (*sp, rng(seed, emitted, target.device)))
      new = [int(host_array(nxt).item())]
    else:
      drafts, q = drafter.propose(seq, k, sp, gen)
      if params.greedy: new = verify_greedy(target, seq[-1], drafts, pos)
      else: new = accept_sampled(target.verify(verify_rows(target, seq[-1], drafts), pos, sampling=sp), q, drafts, gen)
      target.forget(len(seq) + len(new) - 1)  # rows of the pending token and the accepted drafts
      st.drafted, st.accepted = st.drafted + k, st.accepted + len(new) - 1
    for t in new[:max_new - emitted]:
      seq.append(t); emitted += 1
      st.generated, st.decode_s = emitted, time.perf_counter() - t1
      yield t
      if t in stop: return

def warm_steps(target: Runner, drafter: Drafter, k: int) -> list[tuple[str, Callable[[], object]]]:
  """The steps a greedy speculative round takes that the target's own warm_steps do not, as (name, run it once), for a
  server to capture before its first request: the verify step of k + 1 rows (in the scratch slot, or slot 0 whose
  `cached` the caller resets) and a draft model's prefill chunks and per-token step (its rows forgotten after each)."""
  slot = target.model.slots - 1 if target.model.slots > 1 else 0
  steps: list[tuple[str, Callable[[], object]]] = [(f"verify-{k + 1}", lambda: target.verify([0] * (k + 1), 0, slot))]
  if isinstance(drafter, MTPDraft): steps.append(("mtp", lambda: drafter.runner.draft_next(0, 0, slot)))
  if isinstance(drafter, DraftModel):
    r = drafter.runner
    steps += [(f"draft {name}", lambda run=run: (run(), r.forget(0))) for name, run in r.warm_steps()
              if name.startswith("prefill-") or name == "decode-greedy"]
  return steps

def draft_unusable(target: GGUFFile, draft: GGUFFile) -> str | None:
  """Why `draft` (a draft model, or a file holding only a multi-token-prediction block) cannot draft for `target`, or
  None."""
  if (why := vocab_mismatch(target.metadata, draft.metadata)) is not None: return f"its vocabulary differs ({why})"
  return mtp_unavailable(target, draft) if is_mtp_file(draft) else None

def vocab_mismatch(target_md: dict, draft_md: dict) -> str | None:
  """Why a draft model's vocabulary cannot draft for the target's (the GGUF tokenizer metadata), or None: the same
  tokenizer model and token texts, sizes at most MAX_VOCAB_DIFFERENCE apart (padding entries)."""
  g = lambda md, k: md.get(f"tokenizer.ggml.{k}")
  if g(target_md, "model") != g(draft_md, "model"):
    return f"the draft's tokenizer is {g(draft_md, 'model')!r}, the target's {g(target_md, 'model')!r}"
  a, b = list(g(target_md, "tokens") or []), list(g(draft_md, "tokens") or [])
  if abs(len(a) - len(b)) > MAX_VOCAB_DIFFERENCE: return f"the draft has {len(b)} tokens, the target {len(a)}"
  if (i := next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)) is not None:
    return f"token {i} is {b[i]!r} in the draft, {a[i]!r} in the target"
  return None
