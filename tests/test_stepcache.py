"""tg_ds4.runtime.stepcache: captured steps saved by one process and loaded by the next give the same results bit for bit,
hold no weights, and a bad, foreign or stale entry costs a capture, never a wrong result."""
import logging, os, pathlib, subprocess, sys

import numpy as np
import pytest

from tg_ds4.runtime import stepcache
from tg_ds4.runtime.runner import Runner
from tg_ds4.runtime.sampling import SamplingParams

REPO = pathlib.Path(__file__).resolve().parents[1]
DS3 = REPO / "tests/fixtures/deepseek2/ds3/ds3-Q4_0.gguf"
DS3_Q8 = REPO / "tests/fixtures/deepseek2/ds3/ds3-Q8_0.gguf"
DS4 = REPO / "tests/fixtures/deepseek4/flash/flash-IQ2_XXS.gguf"
DS3K = REPO / "tests/fixtures/deepseek2/ds3k/ds3k-Q4_K_M.gguf"  # K-quant weights, re-encoded at load on the CPU
PROMPT = [1, 5, 9, 200, 33, 7, 81]
LONG = [(7 * i) % 250 + 1 for i in range(20)]  # a padded prefill chunk and the first-token head (PROMPT is fed per token)

@pytest.fixture
def cache(tmp_path, monkeypatch):
  monkeypatch.setenv("TG_DS4_CACHE", str(tmp_path))
  monkeypatch.delenv("TG_DS4_STEP_CACHE", raising=False)
  return tmp_path / "steps"

def _run(model, params=SamplingParams(), n=6, logprobs=None, max_ctx=64):
  e = Runner.load(str(model), max_ctx=max_ctx)
  steps = [list(e.steps(p, n, params, logprobs=logprobs)) for p in (PROMPT, LONG)]
  return steps, [j for j in e._jits.values() if j.captured is not None]

@pytest.mark.parametrize("model,params,logprobs", [(DS3, SamplingParams(), None), (DS3, SamplingParams(0.9, 40, 0.95, 0.02, seed=3), 5),
                                                   (DS3K, SamplingParams(), None)], ids=["greedy", "sampled-logprobs", "widened-weights"])
def test_a_second_model_loads_the_steps_and_gets_the_same_tokens(cache, model, params, logprobs):
  """Also a model whose weights are re-encoded at load: a re-encoded weight left lazy would be copied inside the first
  captured step (and replayed with it), and the step could not be saved."""
  cold, jits = _run(model, params, logprobs=logprobs)
  assert jits and not any(j.loaded for j in jits) and len(list(cache.glob("*.step"))) == len(jits)
  warm, jits = _run(model, params, logprobs=logprobs)
  assert jits and all(j.loaded for j in jits)  # nothing captured, nothing lowered
  assert warm == cold  # ids and logprobs, bit for bit

def _cli(*args, env) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "tg_ds4", *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=600)

@pytest.mark.parametrize("model", [DS3, DS4], ids=["deepseek2", "deepseek4"])
def test_warm_process_logits_are_bit_identical(tmp_path, model):
  """Two processes: the second loads every step the first saved (no new entry, each one touched) and its logits
  equal the first's bit for bit. deepseek4 also covers its ring caches and compressed-KV tables."""
  env = {**os.environ, "TG_DS4_CACHE": str(tmp_path), "PYTHONPATH": str(REPO)}
  env.pop("TG_DS4_STEP_CACHE", None)
  outs = []
  for i in range(2):
    r = _cli("logits", "-m", str(model), "--tokens", ",".join(map(str, PROMPT)), "--mode", "decode", "--out", str(tmp_path / f"{i}.npy"), env=env)
    assert r.returncode == 0 and "step cache" not in r.stderr, r.stderr
    entries = {p: p.stat().st_mtime_ns for p in (tmp_path / "steps").glob("*.step")}
    outs.append(entries)
  assert outs[0] and outs[1].keys() == outs[0].keys() and all(outs[1][p] > outs[0][p] for p in outs[0])  # loaded, not rewritten
  a, b = np.load(tmp_path / "0.npy"), np.load(tmp_path / "1.npy")
  assert a.tobytes() == b.tobytes()

def test_entries_hold_no_weights(cache):
  _run(DS3, SamplingParams(0.8, seed=1), logprobs=3)
  m = Runner.load(str(DS3), max_ctx=64).model
  blobs = [p.read_bytes() for p in cache.glob("*.step")]
  samples = [bytes(b.as_memoryview())[:64] for b in stepcache.named_buffers(m) if b.nbytes >= 64]
  assert len(samples) > 30 and blobs
  distinct = [s for s in samples if len(set(s)) > 8]  # (zeros or a constant run could occur anywhere)
  assert distinct and not [s for s in distinct for blob in blobs if s in blob]

def test_bad_entries_are_ignored_and_rebuilt(cache, caplog):
  ref, _ = _run(DS3)
  files = sorted(cache.glob("*.step"))
  assert len(files) >= 2
  data = files[0].read_bytes()
  files[0].write_bytes(data[:len(data) // 2])  # truncated
  raw = bytearray(files[1].read_bytes()); raw[len(raw) // 2] ^= 1; files[1].write_bytes(bytes(raw))  # one flipped bit
  for f in files[2:]: f.write_bytes(b"not a step file at all")
  caplog.set_level(logging.WARNING, "tg_ds4")
  got, jits = _run(DS3)
  assert got == ref and caplog.text.count("step cache: ignoring") == len(files) and "checksum mismatch" in caplog.text
  assert sum(not j.loaded for j in jits) == len(files)  # each bad one captured again...
  assert all(stepcache._split(f.read_bytes()) for f in files)  # ...and saved whole
  _, jits = _run(DS3)
  assert all(j.loaded for j in jits)

def test_an_entry_for_other_weights_is_refused(cache, caplog):
  """Two files with the same step names and a key forced equal: binding checks each model buffer's size and dtype, so
  the Q4_0 capture is not run on the Q8_0 weights (it would read them as Q4_0 blocks)."""
  _run(DS3)
  q8 = Runner.load(str(DS3_Q8), max_ctx=64)
  q4_identity = Runner.load(str(DS3), max_ctx=64).step_cache.identity
  q8.step_cache.identity = q4_identity
  caplog.set_level(logging.WARNING, "tg_ds4")
  assert q8.step_cache.path("greedy").exists() and q8.step_cache.load("greedy") is None
  assert "in this model" in caplog.text and not q8.step_cache.path("greedy").exists()

def test_keys_cover_what_changes_the_program(cache, monkeypatch):
  key = lambda model=DS3, **kw: Runner.load(str(model), **{"max_ctx": 64, **kw}).step_cache.key("decode")
  base = key()
  assert key() == base  # stable across model instances
  assert len({base, key(max_ctx=32), key(DS3_Q8), key(numerics="llama.cpp")}) == 4
  assert Runner.load(str(DS3), max_ctx=64).step_cache.key("greedy") != base
  monkeypatch.setenv("TG_DS4_WIDEN", "0")
  assert key() != base
  monkeypatch.setenv("TG_DS4_STEP_CACHE", "0")
  assert Runner.load(str(DS3), max_ctx=64).step_cache is None

def test_two_cold_processes_at_once(tmp_path):
  env = {**os.environ, "TG_DS4_CACHE": str(tmp_path), "PYTHONPATH": str(REPO)}
  env.pop("TG_DS4_STEP_CACHE", None)
  args = [sys.executable, "-m", "tg_ds4", "generate", "-m", str(DS3), "-p", "hello there", "-n", "6", "--max-context", "64"]
  procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env) for _ in range(2)]
  outs = [p.communicate(timeout=600) for p in procs]
  assert [p.returncode for p in procs] == [0, 0] and outs[0][0] == outs[1][0], outs
  assert all("step cache" not in err for _, err in outs)
  warm = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
  assert warm.returncode == 0 and warm.stdout == outs[0][0]
  assert not list((tmp_path / "steps").glob(".*.tmp"))
  listed = subprocess.run([sys.executable, "-m", "tg_ds4", "cache"], capture_output=True, text=True, cwd=REPO, env=env, timeout=120).stdout
  n = len(list((tmp_path / "steps").glob("*.step")))
  assert n == 1 and f"{n} entries" in listed and "greedy" in listed  # a short prompt: only the per-token step and DS3.name in listed, listed
  cleared = subprocess.run([sys.executable, "-m", "tg_ds4", "cache", "--clear"], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
  assert f"removed {n} step cache entries" in cleared.stdout and not list((tmp_path / "steps").iterdir())

def test_a_step_is_saved_once_with_tinygrads_replay(cache, monkeypatch):
  """With tinygrad's own replay (as on every device but the CPU) a capture is saved once, not again on every call
  (per token)."""
  monkeypatch.setenv("TG_DS4_FAST_REPLAY", "0")
  e = Runner.load(str(DS3), max_ctx=64)
  for i, t in enumerate(PROMPT): e.decode(t, i)
  assert type(e._jits["greedy"].captured).__name__ == "CapturedJit" and e.step_cache.saved == 1, e.step_cache.saved
