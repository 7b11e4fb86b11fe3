"""Fuzz the GGUF loader: mutated and truncated versions of a small valid file either load or raise GGUFError, fast.

2,000+ cases run in `make test` (set TG_DS4_FUZZ_EXAMPLES for more). Mutations are biased toward the header and
tensor table, where the parser lives; a case that takes over 5 s counts as a hang."""
import os, signal

import pytest
from ggufgen import write_tiny
from gguf import GGUFReader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tg_ds4.io.gguf import GGUFError, GGUFFile

EXAMPLES = int(os.environ.get("TG_DS4_FUZZ_EXAMPLES", "2000"))
COUNT = {"ok": 0, "GGUFError": 0}

@pytest.fixture(scope="module")
def seed_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("fuzz") / "seed.gguf"
  write_tiny(path)
  return path.read_bytes(), GGUFReader(path).data_offset

class Hang(Exception): pass

def _alarm(*_): raise Hang()

mutation = st.one_of(
  st.tuples(st.just("set"), st.floats(0, 1), st.binary(min_size=1, max_size=8)),    # overwrite bytes
  st.tuples(st.just("flip"), st.floats(0, 1), st.integers(0, 7)),                    # flip one bit
  st.tuples(st.just("cut"), st.floats(0, 1), st.just(b"")),                          # truncate
  st.tuples(st.just("ins"), st.floats(0, 1), st.binary(min_size=1, max_size=16)),    # insert bytes
  st.tuples(st.just("del"), st.floats(0, 1), st.integers(1, 32)),                    # delete bytes
  st.tuples(st.just("big"), st.floats(0, 1), st.sampled_from([0xFFFFFFFFFFFFFFFF, 1 << 40, 1 << 31, 0x7FFFFFFF, 0])),  # huge counts
)

def _mutate(data: bytes, header_len: int, muts) -> bytes:
  b = bytearray(data)
  for kind, where, arg in muts:
    span = header_len if where < 0.9 else len(b)  # 90% of edits land in the header + tensor table
    i = min(int(where / 0.9 * span) if where < 0.9 else int(where * len(b)), max(len(b) - 1, 0))
    if kind == "set": b[i:i+len(arg)] = arg
    elif kind == "flip" and b: b[i] ^= 1 << arg
    elif kind == "cut": del b[i:]
    elif kind == "ins": b[i:i] = arg
    elif kind == "del": del b[i:i+arg]
    elif kind == "big": b[i:i+8] = arg.to_bytes(8, "little")
  return bytes(b)

@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(muts=st.lists(mutation, min_size=1, max_size=4))
def test_fuzz_loader(seed_file, tmp_path_factory, muts):
  data, header_len = seed_file
  path = tmp_path_factory.getbasetemp() / "fuzz_case.gguf"
  path.write_bytes(_mutate(data, header_len, muts))
  old = signal.signal(signal.SIGALRM, _alarm); signal.alarm(5)
  try:
    gf = GGUFFile(path)
    gf.tensors("CPU")  # building every packed tensor must work for any file the loader accepted
    COUNT["ok"] += 1
  except GGUFError:
    COUNT["GGUFError"] += 1
  finally:
    signal.alarm(0); signal.signal(signal.SIGALRM, old)

def test_fuzz_ran_enough_cases():
  # runs after test_fuzz_loader (file order): proves the count the closing note reports
  assert sum(COUNT.values()) >= EXAMPLES, COUNT
  print(f"\nGGUF fuzz: {sum(COUNT.values())} cases, {COUNT['ok']} loaded, {COUNT['GGUFError']} rejected with GGUFError")
