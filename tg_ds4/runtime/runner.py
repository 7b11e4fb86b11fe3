"""The runner: one owner of a loaded model's captured steps, its step cache and the bookkeeping of what its caches hold.

Loading (`Runner.load`): the model file is read once (models/families.py's load_model), and the captured steps bind to
the step cache of that file and these settings. The steps, each a runtime/jit.py Jit captured on first use (or loaded
from the step cache):
  * `prefill-{C}`: a chunk of C tokens -> the logits of one selected position; `chunk-{C}`: all C positions (models
    whose forward takes at most C tokens);
  * `greedy`, `batch-{B}`, `verify-{B}`, `mtp`: the forwards of one token, of B sequences' next tokens, of B positions
    of one sequence, and of the multi-token-prediction block -> the greedy next ids and the logits they were chosen
    from (the head writes the logits to a buffer either way); a greedy request's only per-token host traffic is the
    4-byte id being streamed out and back in;
  * `head-{rows}-{choice}-{k}`: sampling, log-probabilities and the distributions speculative decoding compares, on
    the device, from a forward's logits or a prefill chunk's. A step of its own: a model captures one forward per row
    count (a server's warm-up, a cold start), not one per combination of sampling and logprobs, for the price of one
    more small launch per token when a request samples or asks for logprobs.

Generation prefills the prompt in chunks, then runs one step per token. A short prompt tail (at most FEED_TOKENS) goes
through the per-token step instead of a prefill chunk: a padded 32-token chunk unpacks every weight to float32 and
computes all 32 rows however few are real, which costs more than feeding up to FEED_TOKENS tokens one step each
(measured on smollm2, qwen2.5 and the ds3 fixture), and a cold start then lowers one step, not two.

The runner remembers which token ids the caches hold (`cached`), so a caller can prefill only past the longest common
prefix with the previous request (`reusable`), and can save/restore the cache rows of a prefix (`kv_rows`/`load_kv_rows`)."""
from __future__ import annotations

import functools, os, pathlib, time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from math import prod

import numpy as np
from tinygrad import Context, Device, Tensor, UOp, dtypes

from tg_ds4.backend import compat, on_cpu, prepare_device
from tg_ds4.backend.buffers import host_array, zeros
from tg_ds4.backend.compat import Buffer, _to_np_dtype, copy_in, copy_out
from tg_ds4.io.gguf import GGUFFile
from tg_ds4.io.hf_folder import open_model
from tg_ds4.models.families import Model, load_model
from tg_ds4.nn.cache_rows import Rows
from tg_ds4.quant import activations, formats, settings
from tg_ds4.runtime import stepcache
from tg_ds4.runtime.jit import Jit
from tg_ds4.runtime.sampling import SamplingParams, distribution, greedy, inputs, rng, sample

MAX_TOP_LOGPROBS = 20
TOP_LOGPROBS_BUCKETS = (0, 5, MAX_TOP_LOGPROBS)  # k is rounded up to one of these and the extra entries dropped on the host

@dataclass
class Stats:
  prompt_tokens: int = 0
  generated: int = 0
  prefill_s: float = 0.0
  decode_s: float = 0.0
  first_token_s: float = 0.0
  drafted: int = 0   # speculative decoding (runtime/speculative.py): tokens a draft proposed
  accepted: int = 0  # and how many of them the target kept
  @property
  def acceptance(self) -> float: return self.accepted / self.drafted if self.drafted else 0.0
  @property
  def prefill_tps(self) -> float: return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0
  @property
  def decode_tps(self) -> float: return max(self.generated - 1, 0) / self.decode_s if self.decode_s else 0.0

@dataclass(frozen=True)
class Step:
  """One generated token; with logprobs asked for, its log-probability under the model (before sampling filters and
  temperature) and the `k` most likely tokens as (id, logprob), best first."""
  token: int
  logprob: float | None = None
  top: tuple[tuple[int, float], ...] = ()

  @staticmethod
  def from_row(row: np.ndarray, k: int, want: int) -> Step:
    """A step from a `[2 + 2k]` row of _with_logprobs, keeping the `want` best of its k alternatives."""
    return Step(int(row[0]), float(row[1]), tuple((int(row[2 + j]), float(row[2 + k + j])) for j in range(want)))

def _with_logprobs(logits: Tensor, tok: Tensor, k: int) -> Tensor:
  """`[1, V]` logits and the chosen `[1, 1]` id -> one `[1, 2 + 2k]` float row (id, logprob, k top ids, k top logprobs):
  a single small copy to the host per token. Top-k by k masked argmaxes (k <= 20), not a vocabulary sort."""
  lp = logits.float().log_softmax(-1)
  cols, ids, vals, ar = [tok.float(), lp.gather(-1, tok)], [], [], Tensor.arange(lp.shape[-1]).reshape(1, -1)
  x = lp
  for _ in range(k):
    i = x.argmax(-1, keepdim=True)
    ids.append(i.float()); vals.append(x.max(-1, keepdim=True))
    x = (ar == i).where(float("-inf"), x)
  return Tensor.cat(*cols, *ids, *vals, dim=-1)  # float32 holds ids exactly below 2^24

def _buffer(t: Tensor) -> Buffer:
  buf = t.uop.base.buffer
  if not isinstance(buf, Buffer) or not buf.is_allocated(): raise ValueError("cache tensors must be realized single-device buffers")
  return buf

def _prefix_view(t: Tensor, axis: int, n: int, slot: int = 0) -> Buffer | None:
  """Rows [0:n] as a view of the buffer when they are its first bytes, or the first bytes of slot `slot` (`t` one slot
  `[1, ...]` of a cache `[slots, ...]`: every axis before the row axis has size 1)."""
  if any(d != 1 for d in t.shape[:axis]): return None
  (view := _buffer(t).view(n * prod(t.shape[axis + 1:]), t.dtype, slot * prod(t.shape) * t.dtype.itemsize)).ensure_allocated()
  return view

def reusable_prefix(prompt, cached: list[int]) -> int:
  """Leading tokens of `prompt` that `cached` holds, at most len(prompt) - 1: the last prompt token always runs again,
  since its logits give the first new token."""
  n = 0
  for a, b in zip(prompt, cached):
    if a != b: break
    n += 1
  return min(n, max(len(prompt) - 1, 0))

GREEDY = SamplingParams()
FEED_TOKENS = 12  # a prompt tail this short goes through the per-token step, not a padded prefill chunk (module docstring)

BATCHES = (1, 2, 4, 8)  # rows of the captured batched steps: a batch of n sequences runs in the smallest that holds n
RUN_AHEAD = 4  # greedy steps launched at a time on a device that runs them asynchronously (`steps`)

class Runner:
  def __init__(self, model: Model, step_cache: stepcache.StepCache | None = None, device: str | None = None):
    self.model, self.step_cache, self.device = model, step_cache, device or Device.DEFAULT
    self.stats = Stats()
    self.cached: list[int] = []  # token ids whose cache rows [0:len] of slot 0 are valid
    self._jits: dict[str, Jit] = {}
    # with several slots (nn/cache_rows.py) the last one is scratch: the rows a batched step pads with write there
    self.parallel = model.slots - 1 if model.slots > 1 else 1
    # each variable made once: a step binds a dozen (a 4-row batched step), and making a UOp costs ~20 us of Python
    var = functools.cache(lambda name, hi: UOp.variable(name, 0, hi))
    self._pos = lambda p, name="start_pos": var(name, model.max_ctx - 1).bind(p)
    self._slot = lambda s, name="slot": var(name, model.slots - 1).bind(s)
    # a variable: the embedding reads one row
    self._tok = lambda t, name="token": var(name, model.cfg.n_vocab - 1).bind(t)
    # greedy generation on a device that runs launched steps asynchronously (a GPU; NULL, to time the host's share)
    # launches RUN_AHEAD steps before it reads their tokens (`steps`): each step reads its token from `_ids` and writes
    # the next one there, so the host never waits for a step before it launches the next
    self.run_ahead = RUN_AHEAD if model.slots == 1 and not on_cpu(self.device) and compat.internals_match() else 1
    self._ids: Tensor | None = None  # [1, max_ctx + 1] int32: the token at each position of a run-ahead generation

  def _where(self, pos: int, slot: int = 0) -> tuple[UOp, ...]:
    """Where a single-sequence forward starts, as step inputs: a symbolic position, and a symbolic slot when the model
    has several (one captured step serves every slot). Passed to a step one by one (TinyJit binds variables given as
    its arguments), turned into a forward's start by `_start`."""
    return (self._pos(pos),) if self.model.slots == 1 else (self._pos(pos), self._slot(slot))

  @staticmethod
  def _start(*where: UOp) -> UOp | Rows: return where[0] if len(where) == 1 else Rows((where[1],), (where[0],))

  @staticmethod
  def load(path: str | pathlib.Path | GGUFFile, max_ctx: int | None = None, device: str | None = None,
           numerics: str = settings.DEFAULT_NUMERICS, parallel: int = 1, mtp: bool | GGUFFile = False) -> Runner:
    """Load a model for `max_ctx` positions (default: the file's context). `numerics` (quant/activations.py): "auto"
    takes llama.cpp's rounding and integer dot products where the device runs them natively and exact float math
    elsewhere, "exact" float math everywhere, "llama.cpp" its rounding of every quantized matmul's input (for
    token-exact comparisons with llama.cpp). `parallel` > 1 keeps that many sequences' caches side by side (plus a
    scratch slot) for the batched steps (runtime/batcher.py's Batcher). `mtp`: load a multi-token-prediction block for
    drafting (`draft_next`; every step then also fills its cache, models/nextn.py): the file's own (True) or that of a
    file holding only the block (families.is_mtp_file)."""
    if not 1 <= parallel <= BATCHES[-1]: raise ValueError(f"parallel must be in [1, {BATCHES[-1]}], got {parallel}")
    gf = path if hasattr(path, "infos") else open_model(path)  # a GGUFFile or io/hf_folder.py's Checkpoint, or a path to either
    device = device or Device.DEFAULT
    prepare_device(device)
    # the few small kernels of a load (zeroed caches, rope tables, stacked rows) are lowered in this process: starting
    # tinygrad's pool of compile workers for them would start processes that a warm start otherwise never needs
    with Context(PARALLEL=0):
      formats.realize_tables(device)
      model = load_model(gf, device, max_ctx, numerics, parallel + 1 if parallel > 1 else 1, mtp)
    compat.release_freed_buffers(device)
    settings = dict(max_ctx=model.max_ctx, numerics=activations.effective(numerics, device)) | ({"slots": model.slots} if model.slots > 1 else {}) | \
      ({"mtp": True if mtp is True else stepcache.file_identity(mtp)} if mtp else {})
    return Runner(model, stepcache.for_model(model, gf, device, **settings), device)

  # *** the captured steps

  def _step(self, name: str, fn: Callable) -> Jit:
    if (j := self._jits.get(name)) is None: j = self._jits[name] = Jit(fn, self.step_cache, name, self.device)
    return j

  def _forward(self, name: str, logits_of: Callable[..., Tensor]) -> Jit:
    """A captured forward of B rows: `logits_of(*args)` `[B, vocab]` -> (the greedy next ids `[B, 1]`, those logits).
    Every other choice of the next token is a head step on the logits (`head`), so a model captures one forward per
    row count, whatever its requests ask for."""
    def step(*args):
      logits = logits_of(*args)
      nxt = greedy(logits)
      Tensor.realize(nxt, logits)
      return nxt, logits
    return self._step(name, step)

  def _chained_step(self) -> Jit:
    """The per-token greedy forward of a run-ahead generation: the token at the step's position read from `_ids` on the
    device, its greedy successor written to the next position there."""
    if (j := self._jits.get("chained")) is not None: return j
    ids = self._ids
    def step(*where):
      pos = where[0]
      nxt = greedy(self.model.forward(ids[:, pos:pos + 1], self._start(*where), last_only=True)[:, -1])
      return ids[:, pos + 1:pos + 2].assign(nxt).realize()
    return self._step("chained", step)

  def _greedy_step(self) -> Jit:
    """The per-token forward: one token at a symbolic position (and slot) -> (its greedy next id `[1, 1]`, the logits
    `[1, vocab]`)."""
    if (j := self._jits.get("greedy")) is not None: return j  # per token: no new closure
    return self._forward("greedy", lambda tok, *where: self.model.forward(tok, self._start(*where), last_only=True)[:, -1])

  def head(self, logits: Tensor, choice: str, k: int | None = None) -> Jit:
    """The captured choice from a step's logits `[B, vocab]` (a prefill chunk's `[1, 1, vocab]`: its last row), a step
    of its own so that one captured forward per row count serves every choice: `choice` "greedy" or "sample" (the
    sampling inputs of SamplingParams.tensors and `rng` as arguments) -> the ids `[B, 1]`, or with k logprobs the rows
    `[B, 2 + 2k]` of _with_logprobs; "rows" (batch_step's per-row sampling inputs, a greedy flag first) likewise;
    "dist" -> the distributions `[B, vocab]` `sample` draws from."""
    name = f"head-{'x'.join(map(str, logits.shape[:-1]))}-{choice}-{'ids' if k is None else k}"
    if (j := self._jits.get(name)) is not None: return j
    def step(logits, *sargs):
      logits = logits.reshape(-1, logits.shape[-1])
      if choice == "dist": return distribution(logits, *sargs).realize()
      if choice == "greedy": nxt = greedy(logits)
      elif choice == "sample": nxt = sample(logits, *sargs)
      else: nxt = sargs[0].reshape(-1, 1).where(greedy(logits), sample(logits, *sargs[1:]))
      return (nxt if k is None else _with_logprobs(logits, nxt, k)).realize()
    return self._step(name, step)

  def choose(self, ids: Tensor, logits: Tensor, is_greedy: bool, sampling: tuple, k: int | None) -> Tensor:
    """A forward step's greedy ids, or what the head step of this choice makes of its logits."""
    if is_greedy and k is None: return ids
    return self.head(logits, "greedy" if is_greedy else "sample", k)(logits, *sampling)

  def batch_step(self, tokens: list[int], slots: list[int], positions: list[int], sampling: tuple | None = None,
                 logprobs: int | None = None) -> np.ndarray:
    """One token for each of several sequences (nn/cache_rows.py), each in its own slot at its own position, through the
    captured step of the smallest batch in BATCHES that holds them (the rest padded with rows in the scratch slot):
    the next token id per row `[n]` (greedy), or with `sampling` = (is_greedy, temperature, top_k, top_p, min_p) `[n]`
    arrays and the rng `[n, 2]` sampled per row (a greedy row takes the argmax), or with `logprobs` = k the rows
    `[n, 2 + 2k]` of _with_logprobs. The per-slot token bookkeeping is the caller's (runtime/batcher.py's Batcher)."""
    n = len(tokens)
    if self.model.slots == 1 or not 0 < n <= self.parallel:
      raise ValueError(f"a batched step takes 1..{self.parallel} rows of a model loaded with parallel > 1, got {n}")
    B = next(b for b in BATCHES if b >= n)
    pad = B - n
    toks, slots, positions = list(tokens) + [0] * pad, list(slots) + [self.model.slots - 1] * pad, list(positions) + [0] * pad
    args = [self._tok(t, f"token{i}") for i, t in enumerate(toks)] + [self._slot(s, f"slot{i}") for i, s in enumerate(slots)] + \
      [self._pos(p, f"pos{i}") for i, p in enumerate(positions)]
    if sampling is not None:
      flags, temp, top_k, top_p, min_p, rng = (np.concatenate([np.asarray(a), np.repeat(np.asarray(a)[:1], pad, 0)]) for a in sampling)
      args += [inputs(flags, bool, self.device), inputs(np.maximum(temp, 1e-6), np.float32, self.device), inputs(top_k, np.int32, self.device),
               inputs(top_p, np.float32, self.device), inputs(min_p, np.float32, self.device), inputs(rng, np.uint32, self.device)]
    ids, logits = self._batch(B)(*args[:3 * B])
    out = host_array(ids if sampling is None and logprobs is None else
                     self.head(logits, "greedy" if sampling is None else "rows", logprobs)(logits, *args[3 * B:]))
    return out[:n, 0] if logprobs is None else out[:n]

  def _batch(self, B: int) -> Jit:
    """The captured batched forward of B rows: B token, slot and position variables -> (greedy ids, logits `[B, vocab]`)."""
    if (j := self._jits.get(name := f"batch-{B}")) is not None: return j
    m = self.model
    return self._forward(name, lambda *a: m.forward(list(a[:B]), Rows(tuple(a[B:2 * B]), tuple(a[2 * B:3 * B])), last_only=True)[:, -1])

  def verify(self, tokens: list[int], pos: int, slot: int = 0, sampling: tuple = ()) -> np.ndarray:
    """Tokens at consecutive positions pos.. of one sequence in one step, each row in the batched step's form
    (speculative decoding's check, runtime/speculative.py): per row the greedy next token `[B]`, or with `sampling`
    (params.tensors()) the distribution `sample` draws from, `[B, vocab]`. Every row's cache row is stored before any
    row attends, so row i sees rows pos..pos+i of this step, and computes what the per-token step computes at its
    position (bit for bit under the default numerics on quantized weights; docs/numerics.md). The rows past the ones
    the caller keeps (`forget`) are stale: the next step at that position overwrites them before any query reads them."""
    B = len(tokens)
    if not 0 < B <= self.model.PREFILL_CHUNK: raise ValueError(f"a verify step takes 1..{self.model.PREFILL_CHUNK} tokens, got {B}")
    if pos + B > self.model.max_ctx: raise ValueError(f"{pos + B} tokens exceed the context of {self.model.max_ctx}")
    args = [self._tok(t, f"token{i}") for i, t in enumerate(tokens)] + [self._pos(pos + i, f"pos{i}") for i in range(B)]
    if self.model.slots > 1: args.append(self._slot(slot))
    ids, logits = self._verify(B)(*args)
    out = host_array(self.head(logits, "dist")(logits, *sampling) if sampling else ids)
    if slot == 0: del self.cached[pos:]; self.cached.extend(tokens)  # in place: a speculative round calls it
    return out[:, 0] if not sampling else out

  def _verify(self, B: int) -> Jit:
    """The captured verify forward of B rows: B token and position variables (and the slot variable with slots, shared
    by every row) -> (greedy ids, logits `[B, vocab]`)."""
    if (j := self._jits.get(name := f"verify-{B}")) is not None: return j
    m = self.model
    slots = lambda a: (0,) * B if m.slots == 1 else (a[2 * B],) * B
    return self._forward(name, lambda *a: m.forward(list(a[:B]), Rows(slots(a), tuple(a[B:2 * B])), last_only=True)[:, -1])

  def next_distribution(self, token: int, pos: int, sampling: tuple) -> np.ndarray:
    """One token at `pos` through the per-token step -> the distribution `[vocab]` `sample` would draw the next token
    from under `sampling` (params.tensors()): a draft model's proposal (runtime/speculative.py)."""
    _, logits = self._greedy_step()(self._tok(token), *self._where(pos))
    out = host_array(self.head(logits, "dist")(logits, *sampling))
    self._wrote(token, pos)
    return out[0]

  def draft_next(self, token: int, pos: int, slot: int = 0, sampling: tuple = ()) -> int | np.ndarray:
    """The multi-token-prediction block's draft step (a runner loaded with `mtp`): `token` at `pos`, whose position - 1
    the target (or the draft step before) has computed -> the draft of the token at pos + 2: its greedy id, or with
    `sampling` (params.tensors()) the distribution `[vocab]` to draw it from. The target's own rows are untouched."""
    ids, logits = self._draft(token, pos, slot)
    if not sampling: return int(host_array(ids).item())
    return host_array(self.head(logits, "dist")(logits, *sampling))[0]

  def draft_logits(self, token: int, pos: int, slot: int = 0) -> np.ndarray:
    """The logits `[vocab]` the greedy draft step (`draft_next`) chose from."""
    return host_array(self._draft(token, pos, slot)[1])[0]

  def _draft(self, token: int, pos: int, slot: int) -> tuple[Tensor, Tensor]:
    """The captured draft step -> (its greedy id `[1, 1]`, the logits `[1, vocab]`)."""
    if getattr(self.model, "nextn", None) is None: raise ValueError("the runner was loaded without the multi-token-prediction block")
    if (j := self._jits.get("mtp")) is None:
      j = self._forward("mtp", lambda tok, *where: self.model.draft(tok, self._start(*where))[:, -1])
    return j(self._tok(token), *self._where(pos, slot))

  def forget(self, n: int) -> None:
    """Slot 0's cache rows past the first n are stale (drafted tokens the target did not accept)."""
    del self.cached[n:]

  def _wrote(self, token: int, pos: int) -> None:
    """The cache row of `pos` now holds `token` (rows past it are stale). In place: generation calls it per token."""
    del self.cached[pos:]
    self.cached.append(token)

  def _check(self, n: int, start_pos: int) -> None:
    if n == 0: raise ValueError("no tokens to prefill")
    if start_pos + n > self.model.max_ctx: raise ValueError(f"{start_pos + n} tokens exceed the context of {self.model.max_ctx}")
    self.model.check_resume(start_pos)

  def prefill_plan(self, n: int, feed: int) -> tuple[list[int], int]:
    """Prefill chunk sizes for n tokens and how many tokens are left to feed per token (at most `feed`): chunks of the
    largest size, and for the rest the smallest chunk that holds it (padded), unless a whole smaller chunk leaves a
    tail short enough to feed."""
    C, sizes = self.model.PREFILL_CHUNKS, []
    while n > feed:
      c = next((c for c in C if c >= n), C[-1])
      if c > n and (whole := [x for x in C if x < n and n - x <= feed]): c = max(whole)
      sizes.append(c); n -= min(c, n)
    return sizes, n

  def chunked(self, n: int) -> int:
    """How many tokens of an n-token prompt `generate` prefills through chunks (the rest go through the per-token step)."""
    return n - self.prefill_plan(n, FEED_TOKENS)[1]

  def prefill_chunks(self, tokens: list[int], start_pos: int, sizes: list[int], slot: int = 0) -> Tensor:
    """tokens through the captured prefill steps of `sizes`; the logits `[1, 1, vocab]` of the last token. The last
    chunk may be padded: the padding writes cache rows past the prompt, which later steps overwrite before any query
    can see them (a query at position p reads rows <= p only)."""
    s, m = 0, self.model
    for C in sizes:
      part = tokens[s:s + C]
      sel = [[[1.0] if i == len(part) - 1 else [0.0] for i in range(C)]]
      step = self._step(f"prefill-{C}", lambda t, sel, *w: m.forward(t, self._start(*w), select=sel).realize())
      out = step(Tensor([part + [0] * (C - len(part))], dtype=dtypes.int32), Tensor(sel), *self._where(start_pos + s, slot))
      s += C
    return out

  # *** logits, for the CLI and tests

  def decode(self, token: int, pos: int) -> Tensor:
    """Logits `[1, 1, vocab]` of one token at `pos` through the per-token step generation runs (its symbolic position
    lets every position replay the same kernels); a view of the step's output buffer, which its next call overwrites."""
    _, logits = self._greedy_step()(self._tok(token), *self._where(pos))
    self._wrote(token, pos)
    return logits.reshape(1, 1, -1)

  def prefill(self, tokens: list[int], start_pos: int = 0, chunk: int = 64) -> Tensor:
    """Logits `[1, T, vocab]` of every position of `tokens` from `start_pos`, filling the caches: forwards of `chunk`
    tokens, or for a model whose forward takes at most C tokens, its captured steps of C (the last padded)."""
    self._check(len(tokens), start_pos)
    m, outs = self.model, []
    if (C := m.MAX_FORWARD_TOKENS) is None:
      for s in range(0, len(tokens), chunk):
        outs.append(m.forward(Tensor([tokens[s:s + chunk]], dtype=dtypes.int32), self._start(*self._where(start_pos + s))).realize())
    else:
      step = self._step(f"chunk-{C}", lambda t, *w: m.forward(t, self._start(*w)).realize())
      for s in range(0, len(tokens), C):
        part = tokens[s:s + C]
        out = step(Tensor([part + [0] * (C - len(part))], dtype=dtypes.int32), *self._where(start_pos + s))
        outs.append(out[:, :len(part)].clone().realize())  # a copy: the step reuses its output buffer
    self.cached = self.cached[:start_pos] + list(tokens)
    return outs[0].cat(*outs[1:], dim=1).realize() if len(outs) > 1 else outs[0]

  def prefill_last(self, tokens: list[int], start_pos: int = 0) -> Tensor:
    """Fill the caches with `tokens` through the captured prefill steps; logits `[1, 1, vocab]` of the last token."""
    self._check(len(tokens), start_pos)
    out = self.prefill_chunks(tokens, start_pos, self.prefill_plan(len(tokens), 0)[0])
    self.cached = self.cached[:start_pos] + list(tokens)
    return out

  def next_token(self, token: int, pos: int, params: SamplingParams = GREEDY, sampling: tuple = (), logprobs: int | None = None) -> Tensor:
    """One token at `pos` through the per-token step: the next token id `[1, 1]` (greedy, or sampled with `sampling` =
    params.tensors() + the rng state), or with `logprobs` = k the row of _with_logprobs."""
    return self._per_token(token, pos, params.greedy, sampling, logprobs)[0]

  def _per_token(self, token: int, pos: int, is_greedy: bool, sampling: tuple, k: int | None) -> tuple[Tensor, Tensor]:
    ids, logits = self._greedy_step()(self._tok(token), *self._where(pos))
    self._wrote(token, pos)
    return self.choose(ids, logits, is_greedy, sampling, k), logits

  def engine_logits(self, tokens: list[int], prefill_tokens: int | None = None) -> np.ndarray:
    """Logits `[n - K + 1, vocab]` of positions K-1..n-1 (all n rows when K = 0) the way generation computes them: the
    first K tokens through the captured prefill chunks generation uses (its chunk sizes, the last padded; the logits of
    position K-1 are the chunk's selected row), the rest one at a time through the greedy per-token step. K defaults
    to what `generate` would prefill in chunks for this prompt."""
    n = len(tokens)
    K = self.chunked(n) if prefill_tokens is None else prefill_tokens
    if not 0 <= K <= n: raise ValueError(f"prefill tokens {K} must be in [0, {n}]")
    self._check(n, 0)
    rows = []
    if K: rows.append(self.prefill_chunks(tokens[:K], 0, self.prefill_plan(K, 0)[0]).numpy()[0, -1])
    self.cached = list(tokens[:K])
    rows += [self._per_token(tokens[p], p, True, (), None)[1].numpy()[0] for p in range(K, n)]
    return np.stack(rows).astype(np.float32)

  # *** generation

  def reusable(self, prompt: list[int], cached: list[int] | None = None) -> int:
    """How many leading tokens of `prompt` the cache already holds (`cached`: the tokens whose rows a slot holds; default
    slot 0's), at most len(prompt) - 1: the last prompt token is always run again, since its logits give the first
    new token."""
    cached = self.cached if cached is None else cached
    n = reusable_prefix(prompt, cached)
    # ring caches (DeepSeek V4) keep only the last rows: restarting further back than `max_rewind` from the furthest row
    # written (a padded prefill chunk may write PREFILL_CHUNK rows past the cached tokens) means prefilling from scratch
    if (rewind := self.model.max_rewind) is not None and len(cached) + self.model.PREFILL_CHUNK - n > rewind: return 0
    return n

  def generate(self, prompt: list[int], max_new: int, params: SamplingParams = GREEDY, stop: set[int] = frozenset(),
               start_pos: int = 0) -> Iterator[int]:
    """Yield up to `max_new` token ids after `prompt` (whose first `start_pos` tokens are already in the cache)."""
    for s in self.steps(prompt, max_new, params, stop, start_pos): yield s.token

  def begin(self, prompt: list[int], max_new: int, start_pos: int = 0) -> int:
    """Check a generation of up to `max_new` tokens after `prompt` (its first `start_pos` tokens in the cache) and reset
    the stats; the number of tokens it may generate within the context."""
    m, n = self.model, len(prompt)
    if n == 0: raise ValueError("empty prompt")
    if n + max_new > m.max_ctx: max_new = m.max_ctx - n
    if max_new <= 0: raise ValueError(f"prompt of {n} tokens leaves no room in the context of {m.max_ctx}")
    self._check(n - start_pos, start_pos)
    self.stats = Stats(prompt_tokens=n - start_pos)
    self.cached = list(prompt[:start_pos])  # rows past start_pos are about to be overwritten
    return max_new

  def first_token(self, prompt: list[int], start_pos: int, params: SamplingParams, sampling: tuple, k: int | None) -> Tensor:
    """Prefill prompt[start_pos:] (chunks, and a short tail through the per-token step) -> the first new token's step
    output on the device: its id `[1, 1]`, or with k logprobs the row of _with_logprobs."""
    n = len(prompt)
    sizes, fed = self.prefill_plan(n - start_pos, FEED_TOKENS)
    if sizes: out = self.prefill_chunks(prompt[start_pos:n - fed], start_pos, sizes)
    if fed:  # the tail token by token; the last one's step gives the first new token
      for p in range(n - fed, n): tok = self.next_token(prompt[p], p, params, sampling, k)
    else: tok = self.head(out, "greedy" if params.greedy else "sample", k)(out, *sampling)
    self.cached = list(prompt)
    return tok

  def steps(self, prompt: list[int], max_new: int, params: SamplingParams = GREEDY, stop: set[int] = frozenset(),
            start_pos: int = 0, logprobs: int | None = None) -> Iterator[Step]:
    """`generate` yielding Steps; `logprobs` = k (0..20) adds each token's logprob and the k most likely alternatives,
    computed inside the captured step. A caller that stops resuming the iterator cancels the rest: nothing runs ahead,
    but for a greedy generation without logprobs on a device that runs steps asynchronously, which launches `run_ahead`
    steps before it reads their tokens (their cache rows past a stop are never counted as cached)."""
    max_new = self.begin(prompt, max_new, start_pos)
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS: raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
    sp = params.tensors()
    sampling = lambda step: () if params.greedy else (*sp, rng(seed, step))
    k = next(b for b in TOP_LOGPROBS_BUCKETS if b >= logprobs) if logprobs is not None else None  # few distinct k: few captured steps
    st, n = self.stats, len(prompt)
    t0 = time.perf_counter()
    tok = self.first_token(prompt, start_pos, params, sampling(0), k)
    if self.run_ahead > 1 and params.greedy and logprobs is None:
      yield from self._run_ahead(int(host_array(tok).item()), n, max_new, stop, t0)
      return
    for i in range(max_new):
      s = Step(int(host_array(tok).item())) if logprobs is None else Step.from_row(host_array(tok)[0], k, logprobs)
      # the clocks read once the token is on the host: a GPU runs the launched steps asynchronously
      if i == 0: st.prefill_s = st.first_token_s = (t1 := time.perf_counter()) - t0
      st.generated, st.decode_s = st.generated + 1, time.perf_counter() - t1  # kept current: the caller may stop early
      yield s
      if s.token in stop or i == max_new - 1: break
      tok = self.next_token(s.token, n + i, params, sampling(i + 1), k)  # writes the cache row of s.token

  def _run_ahead(self, first: int, n: int, max_new: int, stop: set[int], t0: float) -> Iterator[Step]:
    """`steps`' greedy generation after the first new token `first` (at position n): `run_ahead` chained steps launched,
    then their tokens read back in one copy, and so on."""
    st = self.stats
    st.prefill_s = st.first_token_s = (t1 := time.perf_counter()) - t0
    st.generated = 1
    yield Step(first)
    if first in stop or max_new == 1: return
    if self._ids is None: self._ids = zeros((1, self.model.max_ctx + 1), dtypes.int32, self.device)
    buf = self._ids.uop.base.buffer
    copy_in(Buffer(buf.device, 1, dtypes.int32, base=buf, offset=n * 4).ensure_allocated(), memoryview(np.array([first], np.int32)).cast("B"))
    step, prev, i = self._chained_step(), first, 1
    while i < max_new:
      m = min(self.run_ahead, max_new - i)
      for j in range(m): step(*self._where(n + i - 1 + j))
      got = np.frombuffer(copy_out(Buffer(buf.device, m, dtypes.int32, base=buf, offset=(n + i) * 4).ensure_allocated()), np.int32)
      for t in map(int, got):
        self._wrote(prev, n + i - 1)  # the row of the token the step fed
        st.generated, st.decode_s = st.generated + 1, time.perf_counter() - t1
        yield Step(t)
        if t in stop or (i := i + 1) == max_new: return
        prev = t

  def warm_steps(self) -> list[tuple[str, Callable[[], object]]]:
    """Every captured step generation can take for a request without logprobs, as (name, run it once): the prefill
    chunks that fit the context, the first token from a chunk (greedy and sampled), and the per-token steps (with
    slots: the batched steps of each size in BATCHES up to `parallel`, all rows greedy and with sampled rows). Each
    runs on a token of `0`s in the scratch slot (with slots) or slot 0, whose rows it leaves undefined: `cached` is
    reset by the caller (warm_up)."""
    m, sp = self.model, SamplingParams(temperature=1.0, seed=0)
    slot = m.slots - 1 if m.slots > 1 else 0
    sampled = lambda: (*sp.tensors(self.device), rng(0, 0, self.device))
    steps: list[tuple[str, Callable[[], object]]] = []
    for C in (c for c in m.PREFILL_CHUNKS if c <= m.max_ctx):
      chunk = lambda C=C: self.prefill_chunks([0] * C, 0, [C], slot)
      steps += [(f"prefill-{C}", chunk)]
      if C == m.PREFILL_CHUNKS[0]:
        steps += [("head-greedy", lambda chunk=chunk: (out := chunk(), self.head(out, "greedy")(out))),
                  ("head-sample", lambda chunk=chunk: (out := chunk(), self.head(out, "sample")(out, *sampled())))]
    if m.slots == 1:
      return steps + [("decode-greedy", lambda: self._per_token(0, 0, True, (), None)),
                      ("decode-sample", lambda: self._per_token(0, 0, False, sampled(), None))] + \
        ([("decode-run-ahead", lambda: list(self._run_ahead(0, 0, 2, frozenset(), time.perf_counter())))] if self.run_ahead > 1 else [])
    for B in (b for b in BATCHES if b <= self.parallel):
      arrays = lambda B=B: (np.array([False] * B), np.ones(B, np.float32), np.zeros(B, np.int32), np.ones(B, np.float32),
                            np.zeros(B, np.float32), np.zeros((B, 2), np.uint32))
      steps += [(f"batch-{B}-greedy", lambda B=B: self.batch_step([0] * B, [slot] * B, [0] * B)),
                (f"batch-{B}-sample", lambda B=B, arrays=arrays: self.batch_step([0] * B, [slot] * B, [0] * B, arrays()))]
    return steps

  def warm_up(self, progress: Callable[[int, int, str, float], None] | None = None, extra: list[tuple[str, Callable[[], object]]] = ()) -> None:
    """Capture (or load from the step cache) every step of warm_steps (and the `extra` ones) before the first request,
    so that no request waits on a compile; `progress(i, n, name, seconds)` after each."""
    steps = self.warm_steps() + list(extra)
    for i, (name, run) in enumerate(steps):
      t = time.perf_counter()
      run()
      if progress is not None: progress(i + 1, len(steps), name, time.perf_counter() - t)
    self.cached = []  # the warm-up's rows are not a prefix of anything

  # *** KV rows of a prefix, for a persistent cache ***
  # Byte copies on the cache buffers themselves (the tensors are allocated once and written in place by the captured
  # steps): no kernel is compiled per prefix length, and the captured steps keep pointing at the same memory.

  def kv_rows(self, n: int, slot: int = 0) -> list[tuple[str, np.ndarray]]:
    """Host copies of the state after n tokens of every cache tensor of `slot`: its rows [0:rows(n)] (the model's
    cache_tensors; only meaningful for a state that holds a prefix: n <= len(self.cached) for slot 0's single-sequence
    use, a Batcher's slot_tokens for its slots; for a model with `max_rewind`, all of them)."""
    out = []
    for name, t, axis, count in self.model.cache_tensors(slot):
      if (k := count(n)) == 0: continue  # nothing of it yet (a window not complete)
      if (view := _prefix_view(t, axis, k, slot)) is not None: a = view.numpy().reshape(*t.shape[:axis], k, *t.shape[axis + 1:])
      elif slot == 0: a = _buffer(t).numpy().reshape(t.shape)[(slice(None),) * axis + (slice(0, k),)]
      else: raise ValueError(f"{name}: rows of slot {slot} are not one contiguous run")
      out.append((name, np.array(a)))
    return out

  def load_kv_rows(self, tokens: list[int], rows: dict[str, np.ndarray], slot: int = 0) -> None:
    """Write the saved state after `tokens` back into the cache tensors of `slot` (slot 0: `cached` becomes `tokens`)."""
    if slot == 0: self.cached = []
    for name, t, axis, count in self.model.cache_tensors(slot):
      if (n := count(len(tokens))) == 0: continue
      a = rows[name]
      if a.shape[axis] < n or a.shape[:axis] + a.shape[axis + 1:] != t.shape[:axis] + t.shape[axis + 1:]:
        raise ValueError(f"{name}: saved rows {a.shape} do not fit {t.shape} up to row {n}")
      a = np.ascontiguousarray(a[(slice(None),) * axis + (slice(0, n),)], dtype=_to_np_dtype(t.dtype))
      if (view := _prefix_view(t, axis, n, slot)) is None:  # rows are not one contiguous prefix: rewrite the whole buffer
        if slot: raise ValueError(f"{name}: rows of slot {slot} are not one contiguous run")
        whole = _buffer(t).numpy().reshape(t.shape).copy()
        whole[(slice(None),) * axis + (slice(0, n),)] = a
        view, a = _buffer(t), whole
      view.copy_from(Buffer("PYTHON", a.size, t.dtype, opaque=memoryview(a.reshape(-1)).cast("B")))
    if slot == 0: self.cached = list(tokens)

  def cache_layout(self) -> list[tuple[str, tuple[int, ...], str, int]]:
    """(name, shape, dtype, row axis) of every cache tensor: part of a saved cache's identity."""
    return [(name, tuple(t.shape), t.dtype.name, axis) for name, t, axis, _ in self.model.cache_tensors()]
