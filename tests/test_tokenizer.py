"""tg_ds4.text.tokenizer against llama.cpp.

1. llama.cpp's own tokenizer test vectors (models/ggml-vocab-*.gguf + .gguf.inp/.gguf.out, read the way
   tests/test-tokenizer-0.cpp reads them: add_special=False, parse_special=False), fetched from the llama-cpp-python
   0.3.36 sdist by tests/vocab_vectors.py. Never skipped: if they cannot be had, these tests fail.
2. The registry models (smollm2, qwen2.5-coder-0.5b, gemma3-270m): the literals below are what llama.cpp returned,
   computed with llama-cpp-python 0.3.36 (`Llama(path, vocab_only=True).tokenize(text.encode(), add_bos=True,
   special=...)`, `llama_vocab_is_eog`, `llama_detokenize`), an independent reference.
Both backends run: "auto" (tokenizers' Rust BPE does the merges) and "python" (the merge loops in text/tokenizer.py).
"""
import functools

import pytest
import vocab_vectors

from tg_ds4.io.gguf import GGUFFile
from tg_ds4.io.registry import resolve
from tg_ds4.text.tokenizer import StreamDecoder, Tokenizer

# every vocab with vectors in the 0.3.36 sdist; all but bert-bge must match on 100% of them
VOCABS = ["bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe", "llama-spm", "mpt",
          "phi-3", "qwen2", "qwen35", "refact", "starcoder"]
UNSUPPORTED = {"bert-bge": "WPM (BERT WordPiece) vocabs are not implemented"}
SUPPORTED = [v for v in VOCABS if v not in UNSUPPORTED]

@functools.cache
def vocab_path(name: str): return vocab_vectors.ensure() / f"ggml-vocab-{name}.gguf"

@functools.cache
def metadata(path) -> dict: return GGUFFile(path).metadata

def tok(name: str, backend: str = "auto") -> Tokenizer: return _tok(name, backend)

@functools.cache
def _tok(name: str, backend: str) -> Tokenizer: return Tokenizer(metadata(vocab_path(name) if name in VOCABS else resolve(name)), backend)

@functools.cache
def vectors(name: str) -> dict[str, list[int]]: return vocab_vectors.read(vocab_path(name))

def test_vector_files_are_all_covered():
  assert vocab_vectors.names(vocab_vectors.ensure()) == VOCABS

@pytest.mark.parametrize("name", [pytest.param(v, marks=pytest.mark.xfail(raises=ValueError, strict=True, reason=UNSUPPORTED[v]))
                                  if v in UNSUPPORTED else v for v in VOCABS])
@pytest.mark.parametrize("backend", ["auto", "python"])
def test_llama_cpp_vectors(name, backend):
  t, vec = tok(name, backend), vectors(name)
  bad = [(s, ids, got) for s, ids in vec.items() if (got := t.encode(s, add_special=False, parse_special=False)) != ids]
  detail = "".join(f"\n  {s[:50]!r}\n    llama.cpp {ids[:16]}\n    ours      {got[:16]}" for s, ids, got in bad[:5])
  assert not bad, f"{name} ({t.backend}): {len(vec) - len(bad)}/{len(vec)} vectors match{detail}"

def test_backends():
  # the Rust merges are used wherever the merge list is consistent, which every BPE vocab here is; SPM is always ours
  assert {n: tok(n).backend for n in SUPPORTED} == {n: "python" if n in ("llama-spm", "phi-3") else "tokenizers" for n in SUPPORTED}

@pytest.mark.parametrize("name", SUPPORTED)
def test_round_trip(name):
  """decode(encode(text)) is the text wherever llama.cpp's own detokenize gives it back. The exception is llama.cpp's:
  vocabs with clean_spaces drop the space in " ?" (and " !", " .", " ,", " 's", ...), which two vectors contain."""
  t = tok(name)
  for s in vectors(name):
    want = s.replace("\U0001f601 ?", "\U0001f601?") if t.clean_spaces else s
    assert t.decode(t.encode(s, add_special=False)) == want, s

@pytest.mark.parametrize("name", SUPPORTED)
def test_stream_decoder_matches_decode(name):
  t = tok(name)
  for s in vectors(name):
    ids = t.encode(s, add_special=True, parse_special=True)
    for skip in (False, True):
      dec = StreamDecoder(t, skip_special=skip)
      assert "".join(dec.feed(i) for i in ids) + dec.flush() == t.decode(ids, skip_special=skip), (s, skip)

@pytest.mark.parametrize("name", ["gpt-2", "llama-spm"])
def test_stream_decoder_holds_back_partial_characters(name):
  t = tok(name)
  ids = t.encode("\U0001f999", add_special=False)  # the llama emoji: bytes f0 9f a6 99, more than one token in both vocabs
  assert len(ids) > 1
  dec = StreamDecoder(t)
  assert [dec.feed(i) for i in ids] == [""] * (len(ids) - 1) + ["\U0001f999"] and dec.flush() == ""

def test_stream_decoder_holds_back_cleanable_spaces():
  t = tok("gpt-2")  # clean_spaces: " ," loses its space, but only once the "," has arrived
  dec = StreamDecoder(t)
  out = [dec.feed(i) for i in t.encode("Hello , world", add_special=False)] + [dec.flush()]
  assert "".join(out) == t.decode(t.encode("Hello , world")) == "Hello, world"
  assert not any(o.endswith(" ") for o in out[:-1])

def test_decode_cleanup_like_llama_cpp():
  t = tok("gpt-2")
  s = "Hello , world . Is it ? Yes ! I 'm here , it 's ok ' quoted ' they 're and 've , 't 'd 'll"
  assert t.decode(t.encode(s)) == "Hello, world. Is it? Yes! I'm here, it's ok'quoted'they're and've, 't 'd 'll"
  assert t.decode(t.encode("a ' b")) == "a'b"
  assert tok("qwen2").decode(tok("qwen2").encode(s)) == s  # no clean_spaces there

def test_add_special_defaults():
  # llama.cpp's results for "Hello world" with add_special=True (per-type defaults and tokenizer.ggml.add_bos_token)
  want = {"llama-spm": [1, 15043, 3186], "llama-bpe": [128000, 9906, 1917], "qwen2": [9707, 1879], "deepseek-llm": [100000, 17464, 1843],
          "deepseek-coder": [32013, 17535, 1835], "gpt-2": [15496, 995], "phi-3": [1, 15043, 3186], "command-r": [5, 28339, 3845],
          "gemma-4": [2, 9259, 1902]}
  for name, ids in want.items():
    assert tok(name).encode("Hello world") == ids, name
    assert tok(name).encode("Hello world", add_special=False) == [i for i in ids if i != tok(name).bos_id], name

def test_special_tokens_like_llama_cpp():
  q = tok("qwen2")
  assert q.encode("<|im_start|>user<|im_end|>", add_special=False) == [27, 91, 318, 4906, 91, 29, 872, 27, 91, 318, 6213, 91, 29]
  assert q.encode("<|im_start|>user<|im_end|>", add_special=False, parse_special=True) == [151644, 872, 151645]
  # user-defined tokens are cut out even without parse_special: qwen2's [PAD..] and deepseek's byte-like letters
  assert q.encode("[PAD151700]x", add_special=False) == [151700, 87]
  assert tok("deepseek-llm").encode("\u00c4pfel sch\u00f6n", add_special=False) == [82077, 26723, 282, 9619, 100003, 77]
  # SPM: a space is prefixed to text after a special token; the BOS-prefixed decode keeps the prefix space
  s = tok("llama-spm")
  assert s.encode("<s>Hello</s> world") == [1, 529, 29879, 29958, 10994, 829, 29879, 29958, 3186]
  assert s.encode("<s>Hello</s> world", parse_special=True) == [1, 1, 15043, 2, 29871, 3186]
  assert s.decode([1, 1, 15043, 2, 29871, 3186]) == "<s><s> Hello</s>  world"
  assert s.decode([1, 1, 15043, 2, 29871, 3186], skip_special=True) == " Hello  world"
  assert s.decode([1, 15043]) == "<s> Hello" and s.decode([15043]) == "Hello" and s.decode([29871, 15043]) == " Hello"

def test_token_to_piece():
  g, s = tok("gpt-2"), tok("llama-spm")
  assert g.token_to_piece(995) == b" world" and g.token_to_piece(50256) == b"<|endoftext|>" and g.token_to_piece(50256, special=False) == b""
  assert s.token_to_piece(13) == b"\n" and s.token_to_piece(15043) == b" Hello" and s.token_to_piece(1, special=False) == b""
  assert g.vocab_size == 50257 and s.vocab_size == 32000
  with pytest.raises(ValueError, match="out of range"): g.token_to_piece(50257)

def _tiny_bpe(tokens: list[str], merges: list[str]) -> dict:
  printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
  alphabet = [chr(b) for b in printable] + [chr(256 + i) for i in range(256 - len(printable))]  # GPT-2 byte chars, "a" = id 64
  tokens = [t for t in alphabet if t not in tokens] + [t for t in tokens if t not in alphabet]
  return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": [1] * len(tokens), "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 0}

def test_merge_lists_the_library_cannot_take():
  # llama.cpp's ids for these hand-made vocabs (written as GGUFs and run through llama-cpp-python)
  t = Tokenizer(_tiny_bpe(["ab", "\u0120H"], ["a b", "ab c", "\u0120 H"]))  # "abc" is merged but is no token: bytes instead
  assert t.backend == "python"
  assert [t.encode(s, add_special=False) for s in ("abc", "abcab xab", " Habc")] == [[64, 65, 66], [64, 65, 66, 256, 220, 87, 256], [257, 64, 65, 66]]
  md = _tiny_bpe(["ab"], ["a b"])
  md["tokenizer.ggml.tokens"] = [c for c in md["tokenizer.ggml.tokens"] if c != "x"]  # "x" is no token: nothing merges across it
  for backend in ("auto", "python"):
    t = Tokenizer(md, backend)
    assert t.backend == {"auto": "tokenizers", "python": "python"}[backend]
    assert [t.encode(s, add_special=False) for s in ("axb", "ab", "xabx")] == [[64, 65], [255], [255]]

def test_unsupported_vocabs_fail_clearly():
  md = dict(metadata(vocab_path("gpt-2")))
  with pytest.raises(ValueError, match="unknown tokenizer.ggml.pre 'no-such-pre'"): Tokenizer({**md, "tokenizer.ggml.pre": "no-such-pre"})
  with pytest.raises(ValueError, match="'kimi-k2' is not supported"): Tokenizer({**md, "tokenizer.ggml.pre": "kimi-k2"})
  with pytest.raises(ValueError, match="'bert' is not supported"): Tokenizer({**md, "tokenizer.ggml.model": "bert"})
  # no pre-tokenizer name: llama.cpp falls back to its default regexes
  assert Tokenizer({k: v for k, v in md.items() if k != "tokenizer.ggml.pre"}).pre == "default"

# *** the registry models ***

TEXTS = ["Hello world! How are you doing today?",
         "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
         "\u00dcn\u00efc\u00f6d\u00e9 \u65e5\u672c\u8a9e \U0001f999 na\u00efve caf\u00e9 \u2014 3.14159 + 12345678 = ?",
         "  leading spaces\t\ttabs\n\n\nnewlines   trailing  ",
         "I'm sure they've said it's John's, WE'LL see"]
CHATML = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWrite hello world in C.<|im_end|>\n"
          "<|im_start|>assistant\n")
GEMMA = "<start_of_turn>user\nWrite hello world in C.<end_of_turn>\n<start_of_turn>model\n"
LLAMA_CPP = {  # name -> (ids of TEXTS with add_special=True, chat text, its ids with parse_special True / False, llama_vocab_is_eog ids)
  "smollm2": ([
    [19556, 905, 17, 1073, 359, 346, 2567, 1834, 47],
    [1604, 3987, 24, 94, 727, 472, 1003, 304, 585, 304, 2067, 216, 34, 1745, 3987, 24, 94, 731, 216, 33, 25, 1232, 3987, 24, 94, 731, 216, 34,
     25, 198],
    [142, 246, 94, 25972, 83, 7466, 84, 2756, 17097, 241, 115, 40993, 179, 120, 248, 15107, 116, 243, 15486, 46494, 37366, 1841, 216, 35, 30,
     33, 36, 33, 37, 41, 1232, 216, 33, 34, 35, 36, 37, 38, 39, 40, 446, 9148],
    [216, 2899, 5600, 197, 197, 100, 7366, 1116, 198, 2241, 5110, 256, 35079, 256],
    [57, 5248, 2090, 502, 3543, 1137, 357, 506, 2322, 506, 28, 26587, 23, 16421, 963]], CHATML,
    [1, 9690, 198, 2683, 359, 253, 5356, 11173, 30, 2, 198, 1, 4093, 198, 19161, 33662, 905, 281, 340, 30, 2, 198, 1, 520, 9531, 198],
    [44, 108, 306, 79, 3738, 108, 46, 9690, 198, 2683, 359, 253, 5356, 11173, 15602, 108, 306, 79, 486, 108, 46, 198, 44, 108, 306, 79, 3738,
     108, 46, 4093, 198, 19161, 33662, 905, 281, 340, 15602, 108, 306, 79, 486, 108, 46, 198, 44, 108, 306, 79, 3738, 108, 46, 520, 9531, 198],
    {0, 2, 4}),
  "qwen2.5-coder-0.5b": ([
    [9707, 1879, 0, 2585, 525, 498, 3730, 3351, 30],
    [750, 15801, 1445, 982, 262, 470, 308, 421, 308, 366, 220, 17, 770, 15801, 1445, 481, 220, 16, 8, 488, 15801, 1445, 481, 220, 17, 340],
    [52491, 77, 37572, 66, 2956, 128505, 75402, 21894, 102819, 11162, 99, 247, 94880, 586, 51950, 1959, 220, 18, 13, 16, 19, 16, 20, 24, 488,
     220, 16, 17, 18, 19, 20, 21, 22, 23, 284, 937],
    [220, 6388, 12621, 197, 3244, 3435, 1406, 931, 7969, 256, 27748, 256],
    [40, 2776, 2704, 807, 3003, 1053, 432, 594, 3757, 594, 11, 19677, 6, 4086, 1490]], CHATML,
    [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, 151644, 872, 198, 7985, 23811, 1879, 304, 356, 13, 151645, 198, 151644,
     77091, 198],
    [27, 91, 318, 4906, 91, 29, 8948, 198, 2610, 525, 264, 10950, 17847, 15757, 91, 318, 6213, 91, 397, 27, 91, 318, 4906, 91, 29, 872, 198,
     7985, 23811, 1879, 304, 356, 15757, 91, 318, 6213, 91, 397, 27, 91, 318, 4906, 91, 29, 77091, 198],
    {128247, 151643, 151645, 151662, 151663, 151664}),  # 128247 is a plain "</s>" that llama.cpp's EOG text list catches
  "gemma3-270m": ([
    [2, 9259, 1902, 236888, 2088, 659, 611, 3490, 3124, 236881],
    [2, 2063, 10779, 236769, 236749, 1473, 107, 140, 2060, 538, 768, 538, 655, 236743, 236778, 1663, 10779, 236769, 236749, 753, 236743,
     236770, 236768, 900, 10779, 236769, 236749, 753, 236743, 236778, 236768, 107],
    [2, 238194, 236749, 238527, 236755, 55515, 236859, 33375, 238582, 236743, 478, 397, 404, 391, 120362, 33443, 2192, 236743, 236800, 236761,
     236770, 236812, 236770, 236810, 236819, 900, 236743, 236770, 236778, 236800, 236812, 236810, 236825, 236832, 236828, 578, 2360],
    [2, 138, 26016, 9952, 255969, 39218, 109, 208697, 139, 136697, 138],
    [2, 236777, 236789, 236757, 2889, 901, 236789, 560, 1176, 625, 236789, 236751, 3415, 236789, 236751, 236764, 19716, 236789, 2182, 1460]], GEMMA,
    [2, 105, 2364, 107, 6974, 29104, 1902, 528, 565, 236761, 106, 107, 105, 4368, 107],
    [2, 236820, 3041, 236779, 1340, 236779, 887, 236813, 2364, 107, 6974, 29104, 1902, 528, 565, 21603, 643, 236779, 1340, 236779, 887, 236813,
     107, 236820, 3041, 236779, 1340, 236779, 887, 236813, 4368, 107],
    {1, 106, 212}),
}

@pytest.mark.parametrize("name", list(LLAMA_CPP))
@pytest.mark.parametrize("backend", ["auto", "python"])
def test_registry_models(name, backend):
  t = tok(name, backend)
  texts_ids, chat, chat_special, chat_plain, eog = LLAMA_CPP[name]
  for s, ids in zip(TEXTS, texts_ids):
    assert t.encode(s) == ids, s
    assert t.decode(ids, skip_special=True) == s
  assert t.encode(chat, parse_special=True) == chat_special
  assert t.encode(chat, parse_special=False) == chat_plain
  assert t.decode(chat_special) == ("<bos>" if t.add_bos else "") + chat
  assert set(t.stop_ids) == eog and t.eos_id in eog
