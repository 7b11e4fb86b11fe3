"""backend/store_hazard.py: the scheduler's store-hazard checks answered from per-node buffer masks give tinygrad's own
answers (`dest.base in src.toposort(enter_calls=False)`) on a real model's step, and a store whose value reads its own
buffer through a permute is still realized first."""
import json, pathlib

import numpy as np
from tinygrad import Context, Tensor

from tg_ds4.backend import compat, prepare_device, store_hazard
from tg_ds4.runtime.runner import Runner

DS4 = pathlib.Path(__file__).parent / "fixtures" / "deepseek4" / "flash"

def test_masks_answer_as_tinygrads_walk(monkeypatch):
  """deepseek4's load and decode step, and a store that reads its own buffer (transposed_assign): every check of both
  kinds, with the masks started over every 64 buffers (a long-lived process's reset), against the walk."""
  monkeypatch.setenv("TG_DS4_STEP_CACHE", "0")  # captured here, so scheduled here
  monkeypatch.setattr(store_hazard, "MAX_BITS", 64)
  prepare_device("CPU")
  fix, after = compat.schedule_rangeify.fix_store_hazard, compat.schedule_indexing.realize_store_after_src
  assert fix.__code__ is store_hazard._fix_store_hazard.__code__ and after.__code__ is store_hazard._realize_store_after_src.__code__
  seen, defaults = [], (fix.__defaults__, after.__defaults__)
  def check(src, base):
    got = store_hazard.reads(src, base)
    seen.append((got, base in src.toposort(enter_calls=False)))
    return got
  try:
    fix.__defaults__, after.__defaults__ = (check, defaults[0][1]), (check,)
    store_hazard.recompile()
    man = json.loads((DS4 / "manifest.json").read_text())
    # scheduled here even when this process scheduled the fixture's step before: tinygrad's schedule cache off, and a
    # context no other test loads it with
    with Context(SCACHE=0): Runner.load(DS4 / man["ggufs"]["MXFP4"]["file"], max_ctx=80).decode(man["token_ids"][0], 0)
    transposed_assign()
  finally:
    fix.__defaults__, after.__defaults__ = defaults
    store_hazard.recompile()
  print(f"\n{len(seen)} checks, {sum(w for _, w in seen)} of them stores that read their buffer")
  assert len(seen) > 100 and all(g == w for g, w in seen) and sum(w for _, w in seen) > 0

def transposed_assign() -> None:
  a = Tensor(np.arange(64, dtype=np.float32).reshape(8, 8)).contiguous().realize()
  a.assign(a.T * 2 + 1).realize()
  np.testing.assert_array_equal(a.numpy(), np.arange(64, dtype=np.float32).reshape(8, 8).T * 2 + 1)

def test_a_store_that_reads_its_buffer_through_a_permute_is_realized_first():
  prepare_device("CPU")
  assert store_hazard._installed
  transposed_assign()
