"""Where a forward's batch rows live in the caches: per row its cache slot and the position of its first token.

A model loaded with several slots (runtime/runner.py's Runner.load(parallel=N): N slots and a scratch one) keeps N
sequences' caches side by side, `[slots, rows, ...]`. A batched decode step runs one token of several sequences at
once: the projections, FFNs, experts and head see the rows together (each weight is read once per step for all of
them), and only what touches a cache (the cache write and the attention over it) runs per row, since each row has its
own slot and its own position (symbolic, so one captured step serves every position)."""
from __future__ import annotations

from dataclasses import dataclass

from tinygrad import Tensor, UOp


@dataclass(frozen=True)
class Rows:
  slot: tuple[int | UOp, ...]  # per row of x: its cache slot
  pos: tuple[int | UOp, ...]   # per row of x: the position of its first token

  @staticmethod
  def of(start_pos: int | UOp | Rows) -> Rows:
    """One row in slot 0 at `start_pos` (a single-sequence forward), or `start_pos` itself."""
    return start_pos if isinstance(start_pos, Rows) else Rows((0,), (start_pos,))

  def continues(self, b: int) -> bool:
    """Row b continues row b - 1's sequence: the same slot (one variable, or one int), as a verify step's rows at
    consecutive positions have it (runtime/runner.py's Runner.verify); a batched step's rows each have a slot of their own."""
    if b == 0: return False
    s, t = self.slot[b], self.slot[b - 1]
    return s is t or (isinstance(s, int) and isinstance(t, int) and s == t)

  def __len__(self) -> int: return len(self.pos)
  def __iter__(self): return iter(zip(self.slot, self.pos))

  def table(self, table: Tensor, T: int) -> Tensor:
    """Rows [pos, pos + T) of a per-position table `[n, ...]` for every row -> `[len(self), T, ...]`."""
    parts = [table[p:p + T] for p in self.pos]
    return parts[0].unsqueeze(0) if len(parts) == 1 else Tensor.stack(*parts)

def store_rows(cache: Tensor, new: Tensor, rows: Rows) -> Tensor:
  """Store row b of `new` `[B, T, ...]` at cache rows pos_b..pos_b+T of slot_b of `cache` `[slots, max_ctx, ...]`;
  return all of the cache, ordered after the stores. Building the stores into the graph (not `assign().realize()`)
  keeps them fusable and lets TinyJit capture them with symbolic positions and slots."""
  return Tensor(cache.uop.after(*row_stores(cache, new, rows)))

def row_stores(cache: Tensor, new: Tensor, rows: Rows) -> list[UOp]:
  """store_rows' stores, for a caller that orders them after others (models/nextn.py): the after-node of a buffer may
  list stores into other buffers, as long as their values do not read that buffer's after-node."""
  T, new = new.shape[1], new.cast(cache.dtype)
  return [cache[s:s + 1, p:p + T].uop.store((new if len(rows) == 1 else new[b:b + 1]).uop) for b, (s, p) in enumerate(rows)]

def slot_rows(cache: Tensor, slot: int | UOp, n: int | UOp) -> Tensor:
  """Rows [0, n) of one slot of `cache` `[slots, max_ctx, ...]` -> `[1, n, ...]`."""
  return cache[slot:slot + 1, :n]
