"""Drafting with DeepSeek V4's multi-token-prediction block (models/deepseek4.py's DS4NextN) from a draft file of its own.

The fixture (tests/fixtures/make_ds4_mtp_fixtures.py): the MTP block of tests/fixtures/deepseek4/flash's model, written
by llama.cpp's converter with --mtp and quantized Q4_0 by llama.cpp; its reference is transformers' deepseek_v4 decoder
layer and hyper head run over the file's dequantized weights the way llama.cpp's graph_mtp and draft loop feed it."""
import json
import pathlib

import numpy as np
import pytest

from tg_ds4.io.gguf import GGUFFile
from tg_ds4.models.families import is_mtp_file, mtp_unavailable
from family import assert_mtp_slots_answer_as_plain
from tg_ds4.runtime.runner import Runner
from tg_ds4.runtime.speculative import MTPDraft, mtp_source, speculate

FIX = pathlib.Path(__file__).parent / "fixtures/deepseek4"
TARGET, DRAFT = FIX / "flash/flash-MXFP4.gguf", FIX / "flash-mtp/flash-mtp-Q4_0.gguf"
MAN = json.loads((FIX / "flash-mtp/manifest.json").read_text())
SEQ, CHAIN = MAN["sequence"], MAN["chain_positions"]
CTX = 128

def rel(a, b) -> float: return float(np.abs(a - b).max() / np.abs(b).max())

@pytest.fixture(scope="module")
def exact() -> Runner:
  """One runner for every test (captures are what they cost): two slots, for serve's; the file's weights are F32 but
  for the experts, so its default numerics are the exact ones."""
  return Runner.load(TARGET, max_ctx=CTX, numerics="exact", parallel=2, mtp=GGUFFile(DRAFT))

def test_draft_logits_match_the_reference_through_every_step_kind(exact):
  """The draft step's logits at every position of 64 tokens (past the sliding window: the block's ring wraps) against
  transformers' (F32 arithmetic: 2e-5 relative), with the block's raw rows and hidden streams written by per-token
  target steps, a prefill chunk and a verify step; a second draft step, which reads the block's own streams. The
  target's own logits stay transformers' while every step also fills the block's rows."""
  r, ref, chain = exact, np.load(FIX / "flash-mtp/logits_mtp.npy"), dict(zip(CHAIN, np.load(FIX / "flash-mtp/logits_mtp_chain.npy")))
  target = np.load(FIX / "flash/logits_hf.npy")
  worst = worst_target = 0.0
  for p in range(len(SEQ)):  # the draft at p, then the target's own step at p (which overwrites what the draft wrote)
    worst = max(worst, rel(r.draft_logits(SEQ[p], p), ref[p]))
    if p in chain: assert rel(r.draft_logits(SEQ[p + 1], p + 1), chain[p]) <= 2e-5, p
    worst_target = max(worst_target, rel(r.decode(SEQ[p], p).numpy()[0, 0], target[p]))
  assert worst <= 2e-5 and worst_target <= 2e-5, (worst, worst_target)
  r.prefill_last(SEQ[:16])  # a chunk (32, padded) writes rows 0..15
  assert rel(r.draft_logits(SEQ[16], 16), ref[16]) <= 2e-5
  r.verify(SEQ[16:21], 16)  # five rows at once: each row's block input is the row before's streams
  assert rel(r.draft_logits(SEQ[21], 21), ref[21]) <= 2e-5
  assert rel(r.draft_logits(SEQ[22], 22), ref[22]) > 1e-3  # row 21's draft streams, not the target's: not row 22's reference

def test_mtp_speculation_gives_plain_greedy_tokens(exact):
  """Greedy speculation drafted by the block gives token for token what plain greedy decoding gives, for k = 1..4, from
  a prompt that goes through a chunk and one short enough for per-token steps."""
  t, d = exact, MTPDraft(exact)
  for prompt, ks in ((SEQ[:20], (1, 2, 3, 4)), (SEQ[:6], (3,))):
    want = list(t.generate(prompt, 24))
    for k in ks:
      assert list(speculate(t, d, prompt, 24, k)) == want, (len(prompt), k)
      st = t.stats
      assert st.drafted % k == 0 and 0 <= st.accepted <= st.drafted

def test_mtp_speculation_in_server_slots(exact):
  """family.assert_mtp_slots_answer_as_plain: the block's ring and hidden streams have slots too."""
  prompts, n = [SEQ[:14], SEQ[20:29]], [30, 8]
  assert_mtp_slots_answer_as_plain(exact, prompts, n, [list(exact.generate(p, k)) for p, k in zip(prompts, n)])

def test_a_draft_file_is_told_from_a_draft_model():
  """The --mtp file drafts as a block for its target (not as a model of its own, also where the CLI loads it); the
  target alone has none."""
  from tg_ds4 import cli
  args = cli.build_parser().parse_args(["generate", "-m", str(TARGET), "-p", "hi", "--speculative", "2", "--draft", str(DRAFT),
                                        "--max-context", "64"])
  _, runner, _, drafter = cli._load(args)
  assert isinstance(drafter, MTPDraft) and drafter.runner is runner and runner.model.nextn is not None
  d, t = GGUFFile(DRAFT), GGUFFile(TARGET)
  assert is_mtp_file(d) and not is_mtp_file(t) and mtp_source(d) is d and mtp_source(None) is True and mtp_source(t) is False
  assert mtp_unavailable(t, d) is None
  assert mtp_unavailable(t) == ("it has no multi-token-prediction block; a deepseek4 model's is a file of its own, written by "
                                "convert_hf_to_gguf.py --mtp")
  from dataclasses import replace

  from tg_ds4.models.deepseek4 import DS4Config, DS4Transformer
  cfg = DS4Config.from_gguf(t)
  assert DS4Transformer.draft_mismatch(cfg, DS4Config.from_gguf(d)) is None
  assert DS4Transformer.draft_mismatch(cfg, replace(cfg, hc=2)) == "its multi-token-prediction block does not fit the model (hc 2, the model's 4)"
  ds3 = GGUFFile(FIX.parent / "deepseek2/ds3/ds3-Q4_0.gguf")
  assert mtp_unavailable(ds3, d) == "its multi-token-prediction block is deepseek4's, the model is deepseek2"
