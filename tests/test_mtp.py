"""Drafting with a file's multi-token-prediction block (models/nextn.py, runtime/speculative.py's MTPDraft).

The fixture (tests/fixtures/make_mtp_fixtures.py): a GLM-4.7-Flash-style deepseek2 file with an MTP block, converted by
llama.cpp's converter and quantized to Q8_0 by llama.cpp; its reference is transformers' own decoder layer and rotary
embedding run over the file's dequantized weights the way llama.cpp's MTP graph and draft loop feed it."""
import json
import pathlib

import numpy as np
import pytest

from family import assert_mtp_slots_answer_as_plain
from tg_ds4.io.gguf import GGUFError, GGUFFile
from tg_ds4.models.families import is_mtp_file, mtp_unavailable
from tg_ds4.runtime.runner import Runner
from tg_ds4.runtime.speculative import MTPDraft, speculate

FIX = pathlib.Path(__file__).parent / "fixtures"
MTP = FIX / "deepseek2/glm-mtp"
FILE = MTP / "glm-mtp-Q8_0.gguf"
MAN = json.loads((MTP / "manifest.json").read_text())
SEQ, CHAIN = MAN["sequence"], MAN["chain_positions"]
CTX = 64

def rel(a, b) -> float: return float(np.abs(a - b).max() / np.abs(b).max())

@pytest.fixture(scope="module")
def exact() -> Runner: return Runner.load(FILE, max_ctx=CTX, numerics="exact", mtp=True)

def test_draft_logits_match_the_reference_through_every_step_kind(exact):
  """The draft step's logits at every position of the 48-token sequence against transformers' (F32 arithmetic: 2e-5
  relative), with the block's cache rows and hidden states written by per-token target steps, a prefill chunk and a
  verify step; and a second draft step, which reads the block's own hidden state."""
  r, ref, chain = exact, np.load(MTP / "logits_mtp.npy"), dict(zip(CHAIN, np.load(MTP / "logits_mtp_chain.npy")))
  worst = 0.0
  for p in range(len(SEQ)):  # the draft at p, then the target's own step at p (which overwrites what the draft wrote)
    worst = max(worst, rel(r.draft_logits(SEQ[p], p), ref[p]))
    if p in chain: assert rel(r.draft_logits(SEQ[p + 1], p + 1), chain[p]) <= 2e-5, p
    r.next_token(SEQ[p], p)
  assert worst <= 2e-5, worst
  r.prefill_last(SEQ[:16])  # a chunk (32, padded) writes rows 0..15
  assert rel(r.draft_logits(SEQ[16], 16), ref[16]) <= 2e-5
  r.verify(SEQ[16:21], 16)  # five rows at once: each row's block input is the row before's hidden state
  assert rel(r.draft_logits(SEQ[21], 21), ref[21]) <= 2e-5
  assert rel(r.draft_logits(SEQ[22], 22), ref[22]) > 1e-3  # row 21's draft h, not the target's: not row 22's reference

@pytest.fixture(scope="module")
def plain() -> Runner: return Runner.load(FILE, max_ctx=CTX)

@pytest.fixture(scope="module")
def auto() -> Runner: return Runner.load(FILE, max_ctx=CTX, mtp=True)

def test_mtp_speculation_gives_plain_greedy_tokens(plain, auto):
  """Greedy speculation drafted by the block gives token for token what plain greedy decoding gives (the default
  numerics), for k = 1..4, from a prompt that goes through a chunk and one short enough for per-token steps."""
  t, d = auto, MTPDraft(auto)
  for prompt, ks in ((SEQ[:20], (1, 2, 3, 4)), (SEQ[:6], (3,))):
    want = list(plain.generate(prompt, 24))
    assert list(t.generate(prompt, 24)) == want  # the block's bookkeeping leaves the target's logits as they were
    for k in ks:
      assert list(speculate(t, d, prompt, 24, k)) == want, (len(prompt), k)
      st = t.stats
      assert st.drafted % k == 0 and 0 <= st.accepted <= st.drafted

def test_mtp_speculation_in_server_slots(plain):
  """family.assert_mtp_slots_answer_as_plain: the block's cache and hidden states have slots too."""
  prompts, n = [SEQ[:14], SEQ[20:29]], [30, 8]
  want = [list(plain.generate(p, k)) for p, k in zip(prompts, n)]
  assert_mtp_slots_answer_as_plain(Runner.load(FILE, max_ctx=CTX, parallel=2, mtp=True), prompts, n, want)

def test_files_without_a_block_that_drafts_say_why(tmp_path):
  assert mtp_unavailable(GGUFFile(FILE)) is None
  assert mtp_unavailable(GGUFFile(FIX / "deepseek2/ds3/ds3-Q4_0.gguf")) == "it has no multi-token-prediction layers"
  with pytest.raises(GGUFError, match="no multi-token-prediction layers"): Runner.load(FIX / "deepseek2/ds3/ds3-Q4_0.gguf", max_ctx=CTX, mtp=True)
  with pytest.raises(ValueError, match="without the multi-token-prediction block"): Runner.load(FILE, max_ctx=CTX).draft_next(1, 0)

def test_a_file_holding_only_the_block_drafts_as_the_model_file_does(tmp_path):
  """convert_hf_to_gguf.py --mtp's layout (the block, with copies of the model's embedding, head norm and head, in a file
  of its own; the metadata unchanged) drafts for the model as its own block does: the reference's logits (exact
  numerics, 2e-5) at the first 8 positions. A block that follows another number of layers cannot."""
  import gguf
  src = gguf.GGUFReader(FILE)
  def write(path, block_count=None):
    w = gguf.GGUFWriter(str(path), "deepseek2")
    for f in src.fields.values():
      if f.name.startswith("GGUF.") or f.name == "general.architecture": continue
      v = block_count if f.name == "deepseek2.block_count" and block_count is not None else f.contents()
      w.add_key_value(f.name, v, f.types[0], sub_type=f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in src.tensors:
      if t.name.startswith("blk.3.") or t.name in ("token_embd.weight", "output_norm.weight", "output.weight"):
        w.add_tensor(t.name, np.array(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return GGUFFile(path)
  d, target = write(tmp_path / "mtp-glm.gguf"), GGUFFile(FILE)
  assert is_mtp_file(d) and not is_mtp_file(target) and mtp_unavailable(target, d) is None
  assert mtp_unavailable(target, write(tmp_path / "other.gguf", 5)) == "its multi-token-prediction block follows 4 layers, the model has 3"
  r, ref = Runner.load(FILE, max_ctx=CTX, numerics="exact", mtp=d), np.load(MTP / "logits_mtp.npy")
  for p in range(8):
    assert rel(r.draft_logits(SEQ[p], p), ref[p]) <= 2e-5, p
    r.next_token(SEQ[p], p)
