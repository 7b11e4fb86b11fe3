"""The scheduler's store-hazard checks, answered without walking the whole graph once per store.

Before it splits a graph into kernels, tinygrad asks of every STORE whether the value stored reads the buffer it is
stored into (a write-after-read hazard: the value is then realized first), twice per store (schedule/rangeify.py's
fix_store_hazard, schedule/indexing.py's realize_store_after_src), each time as `dest.base in src.toposort()`. A
model step stores into every layer's caches, and each stored value hangs off the whole graph of the layers below it:
that is a walk of the step's graph per store, quadratic in the depth. In a 30-layer decode step these walks were a
third of the schedule's time (smollm2: 6.8 s of scheduling, 4.3 s without them).

Here every node of the graph gets, once, a bitmask of the buffers (PARAM and BUFFER nodes) it reads, the OR of its
sources' masks; a UOp never changes, so a mask stays valid for as long as its node lives (a weak dictionary: masks go
with their nodes). A check is then one lookup. The answer is the same boolean as tinygrad's walk (enter_calls=False:
a CALL's body is not entered, its arguments are), checked against it in tests/test_store_hazard.py; a base that is
not a buffer node, never seen in practice, is answered by tinygrad's own walk. Where a store does read its buffer,
tinygrad's own function runs unchanged.

Installed by backend.prepare_device for every device, on the release backend/compat.py knows; TG_DS4_FAST_SCHEDULE=0
leaves tinygrad's checks as they are."""
from __future__ import annotations

import threading, types, weakref

from tg_ds4.backend import compat

LEAVES = frozenset({compat.Ops.BUFFER, compat.Ops.PARAM})
CALLS = frozenset({compat.Ops.CALL, compat.Ops.FUNCTION})  # toposort(enter_calls=False) skips their first source
MAX_BITS = 1 << 14  # buffers numbered before the masks start over (a long-lived server sees ever new ones)

_lock = threading.Lock()
_masks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # node -> bitmask of the buffers it reads
_bits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # buffer node -> its bit
_next_bit = 0

def _mask(root) -> int:
  global _next_bit
  masks, bits = _masks, _bits
  if (m := masks.get(root)) is not None: return m
  stack = [(root, False)]
  while stack:
    node, visited = stack.pop()
    if node in masks: continue
    srcs = node.src[1:] if node.op in CALLS else node.src
    if not visited:
      stack.append((node, True))
      stack.extend((s, False) for s in reversed(srcs) if s not in masks)
      continue
    m = 0
    if node.op in LEAVES:
      if (b := bits.get(node)) is None: b, bits[node], _next_bit = _next_bit, _next_bit, _next_bit + 1
      m = 1 << b
    for s in srcs: m |= masks[s]
    masks[node] = m
  return masks[root]

def reads(src, base) -> bool:
  """`base in src.toposort(enter_calls=False)`."""
  global _next_bit
  if base.op not in LEAVES: return base in src.toposort(enter_calls=False)
  with _lock:
    if _next_bit > MAX_BITS: _masks.clear(); _bits.clear(); _next_bit = 0
    m = _mask(src)
    return (b := _bits.get(base)) is not None and bool(m >> b & 1)

def _fix_store_hazard(target, src, _reads=reads, _stock=None):
  return _stock(target, src) if _reads(src, target.base) else None

def _realize_store_after_src(ctx, dest, src, _reads=reads):
  if _reads(src, dest.base): ctx.realize_map[src] = None

_installed = False

def recompile() -> None:
  """tinygrad compiles a pattern matcher's rules on first use with a copy of each rule's function as it is then (code
  and defaults), memoised per rule and function: the memo is dropped and the matchers that hold the two checks start
  over, so that their next use copies them as they are now (the other matchers keep the rules they compiled)."""
  compat.upat_compile.cache_clear(); compat.upat_interpret.cache_clear()
  R = compat.schedule_rangeify
  for pm in (compat.schedule_indexing.pm_generate_realize_map, R.earliest_rewrites, R.pm_mops + R.earliest_rewrites):  # (+ is cached)
    pm.__init__(pm.patterns)

def install() -> None:
  """Idempotent. tinygrad's pattern matchers hold the two functions themselves, so their code is replaced in place
  (tinygrad's own fix_store_hazard is kept, as a copy, for the stores that do read their buffer), and matchers already
  compiled are compiled again."""
  global _installed
  if _installed or not compat.fast_schedule_on(): return
  fix, realize_after = compat.schedule_rangeify.fix_store_hazard, compat.schedule_indexing.realize_store_after_src
  if fix.__code__.co_varnames[:2] != ("target", "src") or realize_after.__code__.co_varnames[:3] != ("ctx", "dest", "src"): return
  stock = types.FunctionType(fix.__code__, fix.__globals__, "fix_store_hazard", fix.__defaults__, fix.__closure__)
  fix.__code__, fix.__defaults__ = _fix_store_hazard.__code__, (reads, stock)
  realize_after.__code__, realize_after.__defaults__ = _realize_store_after_src.__code__, (reads,)
  recompile()
  _installed = True
