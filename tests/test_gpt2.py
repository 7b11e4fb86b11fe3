"""gpt2 (learned positions, LayerNorm with bias, one q|k|v tensor, ungated gelu MLP, tied head) against transformers:
the tiny random GPT-2 of tests/fixtures/gpt2 (make_gpt2_fixtures.py), converted by llama.cpp's converter. F32: the
original model; Q8_0: transformers on that file's gguf-py-dequantized weights. Exact mode over the prompt and the
reference's continuation, the engine path (a captured 32-token chunk, then per-token steps), and `generate`."""
import json, pathlib

import pytest

from family import assert_matches_transformers
from tg_ds4.io.gguf import GGUFError
from tg_ds4.runtime.runner import Runner

ROOT = pathlib.Path(__file__).parent / "fixtures" / "gpt2"
MAN = json.loads((ROOT / "manifest.json").read_text())
IDS = MAN["token_ids"]

@pytest.mark.parametrize("q", ["F32", "Q8_0"])
def test_gpt2_matches_transformers(q):
  assert_matches_transformers(f"gpt2 {q}", ROOT, MAN["ggufs"][q], IDS, tol=2e-5 if q == "F32" else 5e-5)

def test_gpt2_context_is_its_learned_positions():
  with pytest.raises(GGUFError, match=r"learned positions \(position_embd\) for 128 tokens, a context of 129 was asked for"):
    Runner.load(ROOT / "gpt2-F32.gguf", max_ctx=129)
