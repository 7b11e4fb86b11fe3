"""Command-line contract: bad input is one line on stderr and exit status 2; generate streams only generated text."""
import itertools, pathlib, socket, subprocess, sys

import pytest

FIX = pathlib.Path(__file__).parent / "fixtures"
DS3 = str(FIX / "deepseek2/ds3/ds3-Q4_0.gguf")

def tg(*args, timeout=600):
  return subprocess.run([sys.executable, "-m", "tg_ds4", *args], capture_output=True, text=True, timeout=timeout)

@pytest.mark.parametrize("args,msg", [
  (["generate", "-m", "no-such-model", "-p", "hi"], "not a known model name"),
  (["generate", "-m", "smollm2", "-p", ""], "the prompt is empty"),
  (["generate", "-m", "smollm2", "-p", "hi", "--top-p", "3"], "top_p must be in (0, 1]"),
  (["generate", "-m", "smollm2", "-p", "hi", "--temperature", "-1"], "temperature must be >= 0"),
  (["generate", "-m", "smollm2", "-p", "word " * 40, "--max-context", "16"], "the context holds 16"),
  (["logits", "-m", "smollm2", "--tokens", "1,x"], "comma-separated integers"),
  (["generate", "-m", DS3, "-p", "hi", "-n", "0"], "-n/--n-predict must be at least 1, got 0"),
  (["generate", "-m", DS3, "-p", "hi", "-n", "-3"], "-n/--n-predict must be at least 1, got -3"),
  (["chat", "-m", DS3, "-n", "0"], "-n/--n-predict must be at least 1"),
  (["logits", "-m", DS3, "--max-context", "2", "--tokens", "1,2,3"], "--tokens has 3 tokens; --max-context 2"),
  (["logits", "-m", DS3, "--tokens", "1,512"], "token ids [512] are outside the vocabulary [0, 512)"),
  (["generate", "-m", DS3, "-p", "hi", "--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
  (["generate", "-m", DS3, "-p", "hi", "--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
  (["generate", "-m", str(FIX), "-p", "hi"], "is a directory without config.json, expected a .gguf file or a Hugging Face checkpoint folder"),
  (["serve", "-m", DS3, "--parallel", "9", "--port", "1"], "--parallel must be in [1, 8]"),
  (["serve", "-m", DS3, "--port", "99999"], "--port 99999: a TCP port is 0..65535"),
  (["serve", "-m", DS3, "--host", "no-such-host.invalid", "--port", "0"], "--host no-such-host.invalid --port 0: cannot listen there"),
  (["serve", "-m", DS3, "--served-model-name", " "], "--served-model-name ' ': give a non-empty printable name"),
  (["generate", "-m", DS3, "-p", "hi", "--quantize", "q4_0"], "--quantize applies to checkpoint folders; a GGUF file is used as it is"),
  (["generate", "-m", DS3, "-p", "hi", "--speculative", "2"],
   "has nothing to draft with (it has no multi-token-prediction layers): pass --draft MODEL"),
  (["generate", "-m", DS3, "-p", "hi", "--speculative", "2", "--draft", str(FIX / "deepseek4/flash/flash-MXFP4.gguf")],
   "cannot draft for " + DS3 + ": its vocabulary differs (token 2 is"),
  (["generate", "-m", DS3, "-p", "hi", "--speculative", "17", "--draft", DS3], "--speculative must be in [1, 16], got 17"),
  (["generate", "-m", str(FIX / "deepseek4/flash/flash-MXFP4.gguf"), "-p", "hi", "--speculative", "2"],
   "has nothing to draft with (it has no multi-token-prediction block; a deepseek4 model's is a file of its own, written by "
   "convert_hf_to_gguf.py --mtp): pass --draft MODEL"),
  (["bench", "-m", DS3, "--speculative", "2"], "has nothing to draft with (it has no multi-token-prediction layers): pass --draft MODEL"),
  (["serve", "-m", DS3, "--speculative", "2", "--port", "0"], "has nothing to draft with (it has no multi-token-prediction layers)"),
  (["bench", "-m", DS3, "--speculative", "17", "--draft", DS3], "--speculative must be in [1, 16], got 17"),
  (["generate", "-m", str(FIX / "gpt2/gpt2-Q8_0.gguf"), "-p", "hi", "--max-context", "300"],
   "learned positions (position_embd) for 128 tokens, a context of 300 was asked for"),
])
def test_bad_input_is_one_line_exit_2(args, msg):
  r = tg(*args)
  assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("tg_ds4: error: ") and msg in r.stderr, r.stderr

def test_serve_reports_a_taken_port_before_loading_the_model():
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0)); taken.listen()
    port = taken.getsockname()[1]
    r = tg("serve", "-m", DS3, "--port", str(port), timeout=120)
  assert r.returncode == 2 and r.stderr == f"tg_ds4: error: --host 127.0.0.1 --port {port}: cannot listen there (Address already in use)\n", r.stderr

def test_generate_streams_only_the_continuation():
  r = tg("generate", "-m", "smollm2", "-p", "The capital of France is", "-n", "3")
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith(" Paris") and "capital" not in r.stdout and "tok/s" in r.stderr

def test_default_context_is_the_models_when_smaller_and_a_larger_one_warns():
  """The default context is 4096 or the model's (64 for the ds3 fixture), silently; a larger one given is honoured with
  one warning (as llama.cpp's n_ctx > n_ctx_train)."""
  quiet, loud = tg("generate", "-m", DS3, "-p", "hi", "-n", "2"), tg("generate", "-m", DS3, "-p", "hi", "-n", "2", "--max-context", "100")
  assert quiet.returncode == 0 and loud.returncode == 0, (quiet.stderr, loud.stderr)
  assert "trained for" not in quiet.stderr
  assert loud.stderr.count("ds3-Q4_0.gguf: a context of 100 positions exceeds the 64 the model was trained for") == 1

def test_generate_from_a_checkpoint_folder_quantized_at_load():
  """`-m FOLDER --quantize q8_0`: the text is the greedy continuation the same quantized model gives in-process."""
  from tg_ds4.io.hf_folder import Checkpoint
  from tg_ds4.runtime.runner import GREEDY, Runner
  from tg_ds4.text.tokenizer import Tokenizer
  folder = FIX / "hf" / "ds3"
  r = tg("generate", "-m", str(folder), "--quantize", "q8_0", "-p", "the model reads packed weights", "-n", "6")
  assert r.returncode == 0, r.stderr
  ck = Checkpoint(folder, "q8_0")
  tok = Tokenizer.from_gguf(ck)
  ids = tok.encode("the model reads packed weights")
  want = list(itertools.takewhile(lambda t: t not in tok.stop_ids, Runner.load(ck, max_ctx=64).generate(ids, 6, GREEDY)))
  assert r.stdout == tok.decode(want)
