"""`tg_ds4 probe` against transformers: the residual stream after every layer equals `output_hidden_states`, the MoE
routing equals the router's choice (tests/fixtures/make_probe_fixtures.py), and the logit lens at the last layer is
the model's own top 5; deepseek4's streams through its head equal transformers' logits; the CLI writes what it says."""
import json, pathlib, subprocess, sys

import numpy as np
import pytest

from tg_ds4.runtime.runner import Runner
from tg_ds4.tools import probe

FIX = pathlib.Path(__file__).parent / "fixtures"
DS3 = FIX / "deepseek2" / "ds3"

def rel(a, b) -> float: return float(np.abs(a - b).max() / np.abs(b).max())

@pytest.fixture(scope="module")
def ds3():
  man = json.loads((DS3 / "manifest.json").read_text())
  ids = man["token_ids"]  # 32 tokens in two forwards: the chunks' records are joined
  return man, probe.run(Runner.load(DS3 / man["ggufs"]["F32"]["file"], max_ctx=len(ids)), ids, chunk=len(ids) // 2)

def test_hidden_states_equal_transformers(ds3):
  man, p = ds3
  hf = np.load(DS3 / man["probe"]["hidden"])
  assert hf.shape == (len(p.hidden), *p.hidden[0].shape)  # (the last entry before the final norm: make_probe_fixtures.py)
  errs = [rel(ours, ref) for ours, ref in zip(p.hidden, hf)]
  print("\nds3 F32 hidden states vs transformers, per layer (max|d| / max|h|): " + ", ".join(f"{e:.1e}" for e in errs))
  assert max(errs) <= 1e-5, errs  # measured 0 (embeddings) .. ~4e-7
  assert errs[0] == 0.0  # the embedding rows are the file's values

def test_routing_equals_the_routers_choice(ds3):
  man, p = ds3
  hf = np.load(DS3 / man["probe"]["router"])
  assert sorted(p.routes) == man["probe"]["moe_layers"]
  for i, (ids, w) in p.routes.items():
    order = np.argsort(ids, -1)
    assert (np.take_along_axis(ids, order, -1) == hf[f"ids_{i}"]).all(), f"blk.{i}: expert ids differ from transformers'"
    assert rel(np.take_along_axis(w, order, -1), hf[f"weights_{i}"]) <= 1e-5

def test_last_layer_lens_is_the_models_top5(ds3):
  man, p = ds3
  logits = np.load(DS3 / "logits_hf.npy")
  ids, vals = p.lens[-1]
  assert (ids[:, 0] == logits.argmax(-1)).all()
  assert rel(vals, np.take_along_axis(logits, ids, -1)) <= 1e-5
  assert (np.diff(vals, axis=-1) <= 0).all()  # best first

def test_deepseek4_streams_through_the_head_equal_transformers():
  """V4's residual is 4 hyper-connection streams; its lens applies the head's stream collapse. One 32-token forward
  (transformers' logits are causal, so its first 32 rows are those of this shorter prompt)."""
  d = FIX / "deepseek4" / "flash"
  man = json.loads((d / "manifest.json").read_text())
  ids = man["token_ids"][:32]
  p = probe.run(Runner.load(d / man["ggufs"]["MXFP4"]["file"], max_ctx=len(ids)), ids)
  hc, dim = 4, p.hidden[0].shape[-1]
  assert all(h.shape == (32, hc, dim) for h in p.hidden) and all(a.shape == (32, dim) for a in p.attn)
  hf = np.load(d / "logits_hf.npy")[:32]
  top, vals = p.lens[-1]
  assert (top[:, 0] == hf.argmax(-1)).all() and rel(vals, np.take_along_axis(hf, top, -1)) <= 2e-5
  assert sorted(p.routes) == list(range(len(p.attn)))  # hash-routed layers record their table's choice too

def test_cli_writes_the_layers_asked_for(tmp_path):
  out = tmp_path / "probe"
  r = subprocess.run([sys.executable, "-m", "tg_ds4", "probe", "-m", str(DS3 / "ds3-Q4_0.gguf"), "-p", "def import class",
                      "--layers", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "logit lens at position" in r.stdout and "blk.1" in r.stdout and "blk.2" not in r.stdout
  names = sorted(f.name for f in out.iterdir())
  assert names == ["blk.1.attn.npy", "blk.1.expert_weights.npy", "blk.1.experts.npy", "blk.1.hidden.npy", "embed.npy", "probe.png", "summary.json"]
  s = json.loads((out / "summary.json").read_text())
  assert [row["layer"] for row in s["layers"]] == [1] and sum(s["layers"][0]["experts"].values()) == len(s["tokens"]) * 2
  assert np.load(out / "blk.1.hidden.npy").shape == (len(s["tokens"]), 64)

@pytest.mark.parametrize("args,msg", [(["--layers", "3"], "--layers '3': block numbers in [0, 3)"),
                                      (["--tokens", "1,x"], "--tokens must be comma-separated integers"),
                                      (["--tokens", "1,9999"], "outside the vocabulary")])
def test_cli_bad_input_is_one_line(tmp_path, args, msg):
  base = ["-p", "hi"] if "--tokens" not in args else []
  r = subprocess.run([sys.executable, "-m", "tg_ds4", "probe", "-m", str(DS3 / "ds3-Q4_0.gguf"), *base, *args, "--out", str(tmp_path)],
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
