"""`tg_ds4 profile` on a tiny MoE MLA fixture: every kernel of the replayed decode step is timed and attributed to the
block and op that own it, and the CSV/JSON/PNG files are written."""
import csv, json, pathlib, re

import pytest
from tinygrad import GlobalCounters, TinyJit, UOp

from tg_ds4 import backend
from tg_ds4.models.transformer import Transformer
from tg_ds4.runtime.runner import Runner
from tg_ds4.runtime.sampling import greedy
from tg_ds4.tools.profile import CATEGORIES, profile_model, write

DS3 = pathlib.Path(__file__).parent / "fixtures" / "deepseek2" / "ds3" / "ds3-Q4_0.gguf"
# MLA's attention: one kernel (nn/attention_kernel.py) where the CPU has it, else scores, softmax and the weighted sum
KERNEL = backend.capabilities("CPU").c_attention is not None
ATTENTION = {"attention"} if KERNEL else {"scores", "softmax", "attn·v"}

@pytest.fixture(scope="module")
def prof():
  return profile_model(Runner.load(DS3, max_ctx=48).model, pos=40, repeat=3, prefill=True)

def test_every_kernel_timed_and_attributed(prof):
  d = prof["decode"]
  m = Runner.load(DS3, max_ctx=48).model
  step = TinyJit(lambda tok, sp: greedy(m.forward(tok, sp, last_only=True)[:, -1]).realize())
  args = lambda: (UOp.variable("token", 0, m.cfg.n_vocab - 1).bind(1), UOp.variable("start_pos", 0, m.max_ctx - 1).bind(40))
  for _ in range(3): step(*args())
  GlobalCounters.reset(); step(*args())
  assert len(d["kernels"]) == GlobalCounters.kernel_count  # the profile sees exactly the kernels the engine's step launches
  assert all(k["time_s"] > 0 and k["op"] in CATEGORIES for k in d["kernels"])
  assert sum(v["kernels"] for v in d["by_op"].values()) == len(d["kernels"])
  assert {"blk.0", "blk.1", "blk.2", "head"} <= set(d["by_block"])
  # ds3: a dense first layer, then MoE layers with a shared expert and sigmoid routing
  assert {"norm", "attn q", "attn kv", "absorb", *ATTENTION, "attn out", "ffn", "router", "top-k", "experts",
          "shared expert", "head", "sampling"} <= set(d["by_op"])
  for k in d["kernels"]:  # a kernel reading a layer's weight belongs to that layer
    for n in k["reads"]:
      if (mm := re.match(r"(blk\.\d+)\.(attn_q_b|ffn_gate_exps|ffn_down)\.", n)): assert k["block"] == mm.group(1), k
    if any("_exps." in n for n in k["reads"]): assert k["op"] == "experts", k
  ops = [k["op"] for k in d["kernels"] if k["block"] == "blk.1"]
  order = [ops.index(o) for o in (("attention",) if KERNEL else ("scores", "softmax", "attn·v")) + ("attn out",)]
  assert order == sorted(order) and ops.index("router") < ops.index("top-k") < ops.index("experts")
  assert prof["prefill"]["tokens"] == Transformer.PREFILL_CHUNK and len(prof["prefill"]["kernels"]) > 0

def test_files_written(prof, tmp_path):
  paths = write(prof, tmp_path, "ds3-Q4_0", read_gbps=20.0)
  assert {p.name for p in paths} == {f"{s}.{e}" for s in ("decode", "prefill") for e in ("csv", "json", "png")}
  rows = list(csv.DictReader(open(tmp_path / "decode.csv")))
  assert len(rows) == len(prof["decode"]["kernels"]) and {r["op"] for r in rows} <= set(CATEGORIES)
  assert json.loads((tmp_path / "decode.json").read_text())["decode"]["by_op"].keys() == prof["decode"]["by_op"].keys()
  assert (tmp_path / "decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

def test_batched_step_profiled():
  """`profile --parallel 4`: the batched decode step of 4 sequences, kernel for kernel the step Runner.batch_step runs."""
  r = Runner.load(DS3, max_ctx=48, parallel=4)
  d = profile_model(r.model, pos=40, repeat=2, rows=4)["decode"]
  for _ in range(3): r.batch_step([1, 2, 3, 4], [0, 1, 2, 3], [40] * 4)
  GlobalCounters.reset(); r.batch_step([1, 2, 3, 4], [0, 1, 2, 3], [40] * 4)
  assert d["tokens"] == 4 and len(d["kernels"]) == GlobalCounters.kernel_count
  assert all(k["time_s"] > 0 for k in d["kernels"])
  assert {"absorb", *ATTENTION, "router", "experts", "shared expert", "head"} <= set(d["by_op"])
  ops = [k["op"] for k in d["kernels"] if k["block"] == "blk.1"]
  if KERNEL: assert sum(k["name"].startswith("attention_") for k in d["kernels"] if k["block"] == "blk.1") == 4  # each row's own
  else: assert ops.count("scores") == 4 and ops.index("scores") < ops.index("softmax") < ops.index("attn·v")  # each row's own
