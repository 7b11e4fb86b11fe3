r"""Tokenizer from GGUF metadata (`tokenizer.ggml.*`) that reproduces llama.cpp's ids (src/llama-vocab.cpp, src/unicode.cpp).

How llama.cpp tokenizes, and how each step is reproduced here:
- Special tokens (control, user-defined, unknown) are cut out of the text first, longest text first; control and unknown
  ones only with `parse_special`. What is left is tokenized fragment by fragment (`_partition`).
- BPE (`tokenizer.ggml.model` "gpt2"): a list of regexes chosen by `tokenizer.ggml.pre` splits each fragment, every regex
  splitting the pieces of the one before (matches and the text between them both become pieces). llama.cpp runs them with
  std::regex (ECMAScript) on a "collapsed" copy of the text in which every non-ASCII codepoint is one byte naming its
  class (letter/number/punctuation/mark/symbol/whitespace/other, from its own Unicode 15.1 tables); its hand-written
  gpt2/llama3/qwen2 splitters compute the same splits as those regexes. We collapse the same way and use Python's `re` in
  ASCII mode, whose \s and alternation/backtracking rules are ECMAScript's. (tokenizers' `Split(Regex)` would run
  Oniguruma on the real text: other Unicode tables, a wider \s, and `$` before a newline, so it is not used.)
  Each piece is then byte-level encoded and merged by rank. The merging is the `tokenizers` library's BPE model (Rust),
  which applies merges in llama.cpp's order (lowest rank, then leftmost) whenever it accepts the merge list (every part
  and result a vocab token); otherwise, and with backend="python", a heap-based loop here mirrors llama.cpp's.
- SPM (`model` "llama": llama-spm, gemma, phi-3): llama.cpp merges the adjacent pair whose concatenation is the
  highest-scoring vocab token (leftmost on ties), any such pair, with `<0xNN>` byte fallback. That is no BPE with a ranked
  merge list (a ranked list breaks score ties by rank, not by position), so it is the loop in `_merge_spm`, run on pieces
  cut where no vocab token can span the cut, with a cache per piece.
Decoding is llama.cpp's `llama_detokenize` (pieces, the SPM leading-space strip, `clean_spaces`).
"""
from __future__ import annotations

import bisect
import codecs
import functools
import heapq
import itertools
import os
import re
import unicodedata
from typing import Iterable

from tg_ds4.io.gguf import GGUFFile

# GGUF token types and llama.cpp's token attributes (llama.h)
UNDEFINED, UNKNOWN, UNUSED, NORMAL, CONTROL, USER_DEFINED, BYTE = 0, 1, 2, 4, 8, 16, 32
LSTRIP, RSTRIP = 128, 256
_TYPE_ATTR = {0: UNDEFINED, 1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}

# *** Unicode classes as llama.cpp's unicode_regex_split collapses them ***

_WS = frozenset((*range(9, 14), 32, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000))
_CLASS_CHAR = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}  # anything else (C*, Z*, unassigned) -> "\xd0"
# Codepoints llama.cpp's Unicode 15.1 table assigns that Python 3.11's unicodedata (Unicode 14.0) does not (hex range + class).
# (A Python with Unicode 16+ would class the codepoints assigned since 15.1, which llama.cpp leaves unassigned.)
_UNICODE_15 = ("CF3M ECEM 2FFC-2FFFS 31EFS 10EFD-10EFFM 1123F-11240L 11241M 11B00-11B09P 11F00-11F01M 11F02L 11F03M 11F04-11F10L "
               "11F12-11F33L 11F34-11F3AM 11F3E-11F42M 11F43-11F4FP 11F50-11F59N 1342FL 13440M 13441-13446L 13447-13455M 1B132L "
               "1B155L 1D2C0-1D2D3N 1DF25-1DF2AL 1E030-1E06DL 1E08FM 1E4D0-1E4EBL 1E4EC-1E4EFM 1E4F0-1E4F9N 1F6DCS 1F774-1F776S "
               "1F77B-1F77FS 1F7D9S 1FA75-1FA77S 1FA87-1FA88S 1FAAD-1FAAFS 1FABB-1FABDS 1FABFS 1FACE-1FACFS 1FADA-1FADBS 1FAE8S "
               "1FAF7-1FAF8S 2B739L 2EBF0-2EE5DL 31350-323AFL")

def _ranges(spec: str) -> dict[int, str]:
  out = {}
  for item in spec.split():
    lo, _, hi = item[:-1].partition("-")
    out.update(dict.fromkeys(range(int(lo, 16), int(hi or lo, 16) + 1), item[-1]))
  return out

_NEWER = _ranges(_UNICODE_15)

class _Collapse(dict):
  """str.translate table: codepoint -> the one char llama.cpp collapses it to (ASCII stays itself), filled on demand."""
  def __missing__(self, c: int) -> str:
    v = chr(c) if c < 128 else "\x0b" if c in _WS else _CLASS_CHAR.get(_NEWER.get(c) or unicodedata.category(chr(c))[0], "\xd0")
    self[c] = v
    return v

_COLLAPSE = _Collapse()
_WIDE = {c: "\x0b" for c in _WS if c >= 128}  # std::wregex path: only non-ASCII whitespace is replaced (by \v)

# *** pre-tokenizer regexes (llama.cpp's llm_tokenizer_bpe), by regex set ***

_CONTRACT = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACT + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACT + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_DS3 = r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+"""
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CASED = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACT}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACT}?|"
          r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LOOKCASE = (r"[^\r\n\p{{L}}\p{{N}}]?((?=[{0}])([^a-z]))*((?=[{0}])([^A-Z]))+{1}|[^\r\n\p{{L}}\p{{N}}]?((?=[{0}])([^a-z]))+"
             r"((?=[{0}])([^A-Z]))*{1}|{2}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_CJK_DS = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_LATIN = ("\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d"
          "\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
          "\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
          "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
          "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149"
          "\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
          "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
          "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+")
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_NEWLINES, _AFMOE_DIGITS = r"[^\n]+|[\n]+", r"\p{AFMoE_digits}"  # the latter is a hand-written splitter in llama.cpp
_REGEXES: dict[str, tuple[str, ...]] = {
  "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
  "llama3": (_LLAMA3,),
  "jais2": (_LLAMA3.replace(r"\s+(?!\S)|\s+", "|".join(rf"\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4, "1,2")) + r"|\s{1}"),),
  "deepseek-llm": ("[\r\n]", _LATIN, "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$", _CJK_DS, r"\p{N}+"),
  "deepseek-v3": (r"\p{N}{1,3}", _CJK, _DS3 + r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
  "spark2_5": (r"\p{N}{1,3}", _CJK, _DS3 + r"|[\r\n]|\s+(?!\S)|\s+", r"\p{N}"),
  "youtu": ("[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+|"
            "[\u3105-\u312f]+|" + _CJK, _CASED.replace(r"\p{N}{1,3}", r"\p{N}")),
  "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_DS, r"\p{N}"),
  "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"),
  "starcoder": (r"\p{N}", _GPT2),
  "gpt2": (_GPT2,),
  "qwen2": (_QWEN2,),
  "qwen35": (_CONTRACT + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
  "bloom": (_BLOOM,),
  "viking": (_BLOOM, r"\p{N}"),
  "tekken": (_LOOKCASE.format(r"\p{L}", "", r"\p{N}"),),
  "chameleon": ("<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )", r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", _GPT2),
  "gpt4o": (_LOOKCASE.format(r"\p{L}", _CONTRACT + "?", r"\p{N}{1,3}"),),
  "granite-emb-multi": (_LOOKCASE.format(r"\p{L}\p{M}", _CONTRACT + "?", r"\p{N}{1,3}"),),
  "tiny_aya": (_AFMOE_DIGITS, _CASED),  # llama.cpp runs its afmoe digit splitter for "\d{1,3}(?=(?:\d{3})*\b)"
  "bailingmoe": (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",),
  "seed-coder": (_CONTRACT + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",),
  "ufakzeka": (_QWEN2[len(_CONTRACT) + 1:],),
  "afmoe": (_AFMOE_DIGITS, "[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f\u2f00-\u2fdf\u0e40-\u0e7f"
            "\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+",
            _DS3 + r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
  "laguna": (_NEWLINES, _QWEN2),
  "exaone-moe": (_CONTRACT + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",),
  "gemma4": (_NEWLINES,),
  "minicpm5": (r"\p{N}{1,3}", _QWEN2.replace(r"|\p{N}|", r"|\p{N}+|")),
}
# tokenizer.ggml.pre -> (regex set, flags): c = no clean_spaces, i = ignore_merges, b = add BOS, n = no BOS token,
# e = escape whitespace (spaces as U+2581), r = raw UTF-8 pieces (no byte-level encoding), g = llama.cpp's Gemma 4 special cases
_PRE: dict[str, tuple[str, str]] = {
  "default": ("default", ""), "minicpm5": ("minicpm5", "i"),
  **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"), ("llama3", "ib")),
  "deepseek-llm": ("deepseek-llm", "c"), "deepseek-coder": ("deepseek-coder", "c"), "deepseek-v3": ("deepseek-v3", "c"),
  "spark2_5": ("spark2_5", "c"), "youtu": ("youtu", "ci"), "falcon": ("falcon", ""), "mpt": ("gpt2", ""), "starcoder": ("starcoder", ""),
  **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum", "modern-bert",
                   "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4"), ("gpt2", "")),
  "jais-2": ("jais2", ""), "gemma4": ("gemma4", "erg"), "granite-embed-multi-311m": ("gemma4", "erg"), "sarvam-moe": ("gemma4", "erc"),
  "refact": ("starcoder", ""), "command-r": ("starcoder", "c"),
  **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"), ("qwen2", "c")),
  "qwen35": ("qwen35", "c"), "stablelm2": ("qwen2", ""), "olmo": ("gpt2", ""), "dbrx": ("llama3", ""), "smaug-bpe": ("llama3", ""),
  "poro-chat": ("bloom", "c"), "chatglm-bpe": ("llama3", "n"), "glm4": ("llama3", "ni"), "glm5": ("llama3", "ni"),
  "viking": ("viking", "c"), "jais": ("gpt2", ""), "tekken": ("tekken", "cib"), "smollm": ("starcoder", "c"), "codeshell": ("starcoder", ""),
  "bloom": ("bloom", ""), "gpt3-finnish": ("bloom", ""), "exaone": ("starcoder", ""), "exaone-moe": ("exaone-moe", ""),
  "chameleon": ("chameleon", "bc"), "minerva-7b": ("starcoder", ""), "megrez": ("qwen2", ""),
  **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), ("gpt4o", "c")),
  "granite-embed-multi-97m": ("granite-emb-multi", "ci"), "tiny_aya": ("tiny_aya", "c"), "cohere2moe": ("tiny_aya", "c"),
  "trillion": ("gpt2", "c"), "granite-docling": ("gpt2", "c"),
  **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), ("bailingmoe", "c")),
  "seed-coder": ("seed-coder", "c"), "hunyuan": ("qwen2", "c"), "hunyuan-dense": ("deepseek-v3", "c"), "hy_v4": ("deepseek-v3", "c"),
  "joyai-llm": ("deepseek-v3", "c"), "ufakzeka": ("ufakzeka", "c"), "grok-2": ("qwen2", "c"), "afmoe": ("afmoe", "c"),
  "laguna": ("laguna", "c"), "solar-open": ("qwen2", "c"), "mellum2": ("starcoder", ""),
}
# known to llama.cpp but needing hand-written splitters or sessions that are not reproduced here
_UNSUPPORTED_PRE = {"kimi-k2": "a hand-written Han/K2 splitter", "superbpe": "a regex that matches empty strings",
                    "whitespace": "a whitespace-splitting session"}

_UCAT = {"N": "\\xd10-9", "L": "\\xd2A-Za-z", "P": "\\xd3!-#%-*,-/:-;?-@\\[-\\]_\\{\\}", "M": "\\xd4", "S": "\\xd5\\$\\+<->\\^`\\|~"}
_UCAT_NAMES = {"N": "N", "L": "L", "P": "P", "M": "M", "S": "S", "Lu": "L", "Ll": "L", "Lt": "L", "Lm": "L", "Lo": "L"}

def _compile(expr: str) -> tuple[re.Pattern, bool]:
  """llama.cpp pre-tokenizer regex -> (Python regex, whether it runs on the collapsed text), converted the way
  unicode_regex_split converts it: \\p{..} becomes the class's collapse byte plus its ASCII members."""
  collapsed = any(f"\\p{{{k}}}" in expr for k in _UCAT_NAMES)
  if collapsed and not expr.isascii(): raise ValueError(f"regex mixes unicode categories and non-ASCII characters: {expr!r}")
  out, inside, i = [], False, 0
  while i < len(expr):
    ch = expr[i]
    if collapsed and expr.startswith("\\p{", i) and i + 3 < len(expr) and i < (j := expr.find("}", i + 3)) <= i + 10 and expr[i+3:j] in _UCAT_NAMES:
      cls = _UCAT[_UCAT_NAMES[expr[i+3:j]]]
      out.append(cls if inside else f"[{cls}]")
      i = j + 1
      continue
    if ch == "[" and (i == 0 or expr[i-1] != "\\"): inside = True
    elif inside and ch == "]" and expr[i-1] != "\\": inside = False
    elif ch == "$" and not inside and expr[i-1] != "\\": ch = r"\Z"  # ECMAScript $ is the end of input only, never before a final \n
    out.append(ch)
    i += 1
  return re.compile("".join(out), re.ASCII), collapsed

_NUMBER_RUN = re.compile("[0-9\xd1]+")

def _split_afmoe(s: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
  """llama.cpp's afmoe digit splitter: a number run splits into its leading len%3 digits and then threes; the text before
  a run is glued to the run's first group (as llama.cpp does; later regexes split it off again)."""
  out = []
  for a, b in spans:
    prev = a
    for m in _NUMBER_RUN.finditer(s, a, b):
      i, j = m.span()
      cur = i + (j - i) % 3
      if cur > i: out.append((prev, cur)); prev = cur
      while cur < j: out.append((prev, cur + 3)); prev = cur = cur + 3
    if prev < b: out.append((prev, b))
  return out

@functools.cache
def _context_free(pattern: str) -> bool:
  """No lookaround and no anchor: whether a match depends only on the characters it consumes."""
  return not re.search(r"\\[ZbBA]|\(\?[=!<]", pattern) and not re.search(r"[$^]", re.sub(r"\\.|\[\^", "", pattern))

def _split(pat: re.Pattern, s: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
  """std::regex_iterator over each piece: matches and the gaps between them become pieces."""
  todo = range(len(spans))
  if len(spans) > 16 and _context_free(pat.pattern):
    # Without lookarounds or anchors a match inside a piece is a match in the whole text too, and every position where
    # one can start is a start of, or inside, a match of a scan over the whole text: pieces that overlap none of those
    # matches cannot split. Worth it when such matches are rare.
    lo, hi = spans[0][0], spans[-1][1]
    hits = []
    for m in pat.finditer(s, lo, hi):
      hits.append(m.span())
      if len(hits) > len(spans) >> 3: break
    else:
      starts, todo = [a for a, _ in spans], set()
      for i, j in hits:
        k = bisect.bisect_right(starts, i) - 1
        while k < len(spans) and spans[k][0] < j: todo.add(k); k += 1
      if not todo: return spans
      todo = sorted(todo)
  out, prev = [], 0
  for k in todo:
    out += spans[prev:k]
    prev = k + 1
    a, b = spans[k]
    if b - a == 1: out.append((a, b)); continue  # a one-char piece stays one piece
    for m in pat.finditer(s, a, b):
      i, j = m.span()
      if i > a: out.append((a, i))
      if j > i: out.append((i, j))
      a = j
    if a < b: out.append((a, b))
  return out + spans[prev:]

def _split_trailing_space(s: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
  """The regex \\s+$ (deepseek-llm): a piece's trailing whitespace becomes its own piece."""
  out = []
  for a, b in spans:
    if s[b-1] in _C_SPACE and (i := a + len(s[a:b].rstrip(_C_SPACE))) > a: out += ((a, i), (i, b))
    else: out.append((a, b))
  return out

# GPT-2 byte-level alphabet: printable bytes stand for themselves, the other 68 for chr(256), chr(257), ... in byte order
_PRINTABLE = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
_BYTE_CHARS = dict(zip(_PRINTABLE + [b for b in range(256) if b not in _PRINTABLE], map(chr, _PRINTABLE + [*range(256, 324)])))
_BYTE_DECODE = {c: b for b, c in _BYTE_CHARS.items()}

def _byte_encode(s: str) -> str: return s.encode("utf-8", "surrogatepass").decode("latin-1").translate(_BYTE_CHARS)

def _byte_decode(text: str) -> bytes:
  """llama_decode_text: byte-level chars back to bytes; a char outside the byte alphabet becomes llama.cpp's marker."""
  try: return bytes(_BYTE_DECODE[c] for c in text)
  except KeyError: pass
  out = bytearray()
  for c in text:
    if (b := _BYTE_DECODE.get(c)) is not None: out.append(b)
    else: out += b"[UNK_BYTE_0x" + c.encode("utf-8", "surrogatepass").hex().encode() + text.encode("utf-8", "surrogatepass") + b"]"
  return bytes(out)

_SURROGATE = re.compile("[\ud800-\udfff]")
_C_SPACE = " \t\n\v\f\r"  # C isspace(), what llama.cpp's lstrip/rstrip attributes strip
_CLEAN = ((re.compile(rb" (?=[?!.,])"), b""), (re.compile(rb" ' "), b"'"), (re.compile(rb" '(?=[sm]|re|ve)"), b"'"))

def _clean_spaces(b: bytes) -> bytes:
  """llama_detokenize's clean_spaces passes: " ?" " !" " ." " ," -> no space, " ' " -> "'", " 's" " 'm" " 're" " 've" -> no space."""
  for pat, rep in _CLEAN: b = pat.sub(rep, b)
  return b

def _meta(gf) -> dict:
  if hasattr(gf, "metadata"): return gf.metadata
  if isinstance(gf, dict): return gf
  return GGUFFile(gf).metadata

class Tokenizer:
  """llama.cpp's tokenizer for a GGUF vocab. backend "auto": the `tokenizers` library merges BPE words where it is exact;
  "python" (or TG_DS4_TOKENIZER=python): the merge loops here. Both give the same ids."""

  def __init__(self, md: dict, backend: str = "auto"):
    if backend not in ("auto", "python"): raise ValueError(f"backend must be 'auto' or 'python', not {backend!r}")
    g = lambda k, d=None: md.get(f"tokenizer.ggml.{k}", d)
    self.model = model = g("model")
    if model is None: raise ValueError("no tokenizer in this GGUF (tokenizer.ggml.model is missing)")
    if model not in ("llama", "gpt2", "gemma4"):
      raise ValueError(f"tokenizer.ggml.model {model!r} is not supported (supported: 'llama' (SPM), 'gpt2' (BPE), 'gemma4')")
    self.spm = model == "llama"
    # pre "hf": a checkpoint folder's tokenizer.json runs (io/hf_tokenizer.py), for a byte-level vocab or an SPM one (Gemma's)
    pre = self.pre = "gemma4" if model == "gemma4" else (g("pre") or "default") if not self.spm or g("pre") == "hf" else "default"
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(g("tokens") or [])]
    if not tokens: raise ValueError("tokenizer.ggml.tokens is missing or empty")
    n = self.vocab_size = len(tokens)
    self.tokens, self.scores = tokens, list(g("scores") or [0.0] * n)
    types = g("token_type")
    self.attrs = attrs = [_TYPE_ATTR.get(t, UNDEFINED) for t in types[:n]] if types else [NORMAL] * n
    if len(self.scores) < n or len(attrs) < n: raise ValueError("tokenizer.ggml.scores/token_type are shorter than tokens")
    self.vocab = dict(zip(tokens, range(n)))
    if len(self.vocab) != n: raise ValueError("tokenizer.ggml.tokens has duplicate entries")

    # per-type defaults (llama_vocab::impl::load)
    flags, self.byte_encode, self._gemma4 = "", True, False
    self.add_space_prefix, self.clean_spaces, self.ignore_merges, self.escape_whitespaces = self.spm, not self.spm, False, False
    self.add_bos, self.add_eos = self.spm, False
    ids = {"bos": 1, "eos": 2, "unk": 0} if self.spm else {} if model == "gemma4" or pre == "hf" else {"bos": 11, "eos": 11}
    self._hf_pipeline = None
    if pre == "hf":  # a checkpoint folder's tokenizer.json, whose own pipeline splits and merges (io/hf_tokenizer.py)
      from tokenizers import Tokenizer as HFTokenizer
      self._hf_pipeline = HFTokenizer.from_file(md["tokenizer.huggingface.json"])
      self._hf_pipeline.encode_special_tokens = True  # special tokens are cut out here first, as for every vocab
      self.clean_spaces = False
    elif not self.spm:
      if pre in _UNSUPPORTED_PRE: raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported: llama.cpp uses {_UNSUPPORTED_PRE[pre]} for it")
      if pre not in _PRE: raise ValueError(f"unknown tokenizer.ggml.pre {pre!r} (llama.cpp refuses it too)")
      rset, flags = _PRE[pre]
      self.clean_spaces, self.ignore_merges, self.byte_encode = "c" not in flags, "i" in flags, "r" not in flags
      self.add_bos, self.escape_whitespaces, self._gemma4 = "b" in flags, "e" in flags, "g" in flags
      if "n" in flags: del ids["bos"]
      custom = {_AFMOE_DIGITS: (_split_afmoe, True), r"\s+$": (_split_trailing_space, False)}
      self._stages = [custom.get(r) or _compile(r) for r in _REGEXES[rset]]
    self.add_space_prefix = bool(g("add_space_prefix", self.add_space_prefix))
    self.special_ids = {k: v for k, v in ids.items() if v < n}
    for k, key in (("bos", "bos"), ("eos", "eos"), ("eot", "eot"), ("eom", "eom"), ("unk", "unknown"), ("sep", "seperator"),
                   ("pad", "padding"), ("mask", "mask"), ("fim_pre", "fim_pre"), ("fim_suf", "fim_suf"), ("fim_mid", "fim_mid"),
                   ("fim_pad", "fim_pad"), ("fim_rep", "fim_rep"), ("fim_sep", "fim_sep"), ("fim_pre", "prefix"), ("fim_suf", "suffix"),
                   ("fim_mid", "middle")):
      if isinstance(v := g(f"{key}_token_id"), int) and 0 <= v < n: self.special_ids[k] = v
    self.add_bos, self.add_eos = bool(g("add_bos_token", self.add_bos)), bool(g("add_eos_token", self.add_eos))
    if "g" in flags: self.add_bos = True  # llama.cpp overrides it for Gemma 4
    self._mark_special(md)

    # special tokens cut out before tokenizing: control/user-defined/unknown, longest (in bytes) first; ties by id
    # (llama.cpp's std::sort leaves their order unspecified)
    special = [i for i in range(n) if attrs[i] & (CONTROL | USER_DEFINED | UNKNOWN)]
    self._rstrip_by_name(md, special)
    special.sort(key=lambda i: -len(tokens[i].encode("utf-8", "surrogatepass")))
    self._specials = {ps: [(tokens[i], i, attrs[i]) for i in special if ps or not attrs[i] & (CONTROL | UNKNOWN)] for ps in (False, True)}
    self._special_re = {ps: re.compile("|".join(re.escape(t) for t, _, _ in sorted(sp, key=lambda s: -len(s[0])))) if sp else None
                        for ps, sp in self._specials.items()}
    self._special_text = {ps: {t: (i, a) for t, i, a in sp} for ps, sp in self._specials.items()}
    self._pieces: dict[int, bytes] = {}
    self._cache: dict[str, list[int]] = {}

    if self.spm and self._hf_pipeline is None:
      # a cut before "▁" is safe where no vocab token contains (previous char + "▁"): no merge can ever span it
      before = {t[k-1] for t in tokens for k in range(1, len(t)) if t[k] == "\u2581"}
      self._spm_cut = re.compile(f"(?<=[^{re.escape(''.join(sorted(before)))}])(?=\u2581)" if before else "(?=\u2581)")
      self.backend = "python"
    else:
      # "a b" -> (a, b), split at the first space after the first char; rank = position (only the order matters)
      pairs = [(m[:p], m[p+1:]) for m in g("merges") or [] if (p := m.find(" ", 1)) >= 0]
      self._ranks = dict(zip(pairs, range(len(pairs))))
      if len(self._ranks) < len(pairs):  # a repeated pair keeps its first rank (std::map::emplace)
        self._ranks = {}
        for r, pr in enumerate(pairs): self._ranks.setdefault(pr, r)
      self.backend = "tokenizer.json" if self._hf_pipeline is not None else "python" if backend == "python" else self._init_hf()

  # *** llama.cpp's token attribute fix-ups and end-of-generation set ***

  def _mark_special(self, md: dict):
    tokens, attrs, ids, vocab = self.tokens, self.attrs, self.special_ids, self.vocab
    def mark(i):
      attrs[i] |= CONTROL
      return i
    # llama.cpp looks these texts up while iterating an unordered_map, so with several candidates its pick is arbitrary;
    # here the first listed text present wins
    auto = {"eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]",
                    "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
            "eom": ("<|eom_id|>",),
            "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
            "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
            "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>", "<|middle|>"),
            "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
            "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
            "fim_sep": ("<|file_sep|>",)}
    for k, texts in auto.items():
      if k not in ids and (found := [vocab[t] for t in texts if t in vocab]): ids[k] = mark(found[0])
    for i, t in enumerate(tokens):  # control tokens named "unused" are unused
      if attrs[i] & CONTROL and "unused" in t: attrs[i] |= UNUSED
    eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if k in ids}
    for t in ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>", "<|endoftext|>",
              "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>",
              "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~["):
      if t in vocab: eog.add(mark(vocab[t]))
    for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # llama.cpp's gpt-oss hack: always rendered
      if t in vocab: attrs[vocab[t]] = USER_DEFINED
    eog |= {ids[k] for k in ("eos", "eot", "eom") if k in ids}
    texts = {tokens[i] for i in eog}
    if "<|end|>" in texts and (("<|return|>" in texts and "<|call|>" in texts) or ("<|calls|>" in texts and "<|flush|>" in texts)):
      eog.discard(e := vocab["<|end|>"]); attrs[e] = USER_DEFINED  # o200k_harmony / solar-open: <|end|> is not EOG
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
      eog.discard(s := vocab["</s>"]); attrs[s] = NORMAL  # gemma4 / plamo: a normal </s>
    self.eog_ids = frozenset(eog)

  def _rstrip_by_name(self, md: dict, special: list[int]):
    """llama.cpp's per-model lstrip/rstrip attributes, chosen by name."""
    name, pre, arch = (md.get(k) or "" for k in ("general.name", "tokenizer.ggml.pre", "general.architecture"))
    name, attrs, vocab = name.lower(), self.attrs, self.vocab
    def setattr_(t, a, on):
      if t in vocab: attrs[vocab[t]] = attrs[vocab[t]] | a if on else attrs[vocab[t]] & ~a
    if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):
      setattr_("<mask>", LSTRIP, True)
    elif "phi-3" in name or "phi3" in name:
      for i in special: attrs[i] |= RSTRIP
      setattr_("</s>", RSTRIP, True)
      for t in ("<unk>", "<s>", "<|endoftext|>"): setattr_(t, RSTRIP, False)
    elif "modern-bert" in name: setattr_("[MASK]", LSTRIP, True)

  def _init_hf(self) -> str:
    """tokenizers' BPE model does the merges when it provably merges like llama.cpp: every merge's parts and result are
    vocab tokens (the library refuses other merge lists; llama.cpp would merge into a non-token and fall back to bytes)."""
    vocab = self.vocab
    if os.environ.get("TG_DS4_TOKENIZER") == "python": return "python"
    if not self.byte_encode:  # unknown chars become <0xNN> symbols up front there: all must exist and none may merge
      byte_tokens = {f"<0x{b:02X}>" for b in range(256)}
      if not byte_tokens <= vocab.keys() or not byte_tokens.isdisjoint(itertools.chain.from_iterable(self._ranks)): return "python"
    try:
      from tokenizers.models import BPE
      self._hf = BPE(vocab=vocab, merges=list(self._ranks), byte_fallback=not self.byte_encode)  # _ranks is in rank order
    except Exception: return "python"  # no library, or a merge list it refuses
    # A byte char missing from the vocab is a symbol no merge touches and that is dropped at the end in llama.cpp; the
    # library drops it up front and would merge its neighbours across it, so words are cut there instead.
    holes = "".join(c for c in _BYTE_CHARS.values() if c not in vocab) if self.byte_encode else ""
    self._holes = re.compile(f"[{re.escape(holes)}]") if holes else None
    return "tokenizers"

  # *** properties ***

  bos_id = property(lambda self: self.special_ids.get("bos"))
  eos_id = property(lambda self: self.special_ids.get("eos"))
  eot_id = property(lambda self: self.special_ids.get("eot"))
  eom_id = property(lambda self: self.special_ids.get("eom"))
  pad_id = property(lambda self: self.special_ids.get("pad"))
  unk_id = property(lambda self: self.special_ids.get("unk"))
  stop_ids = eot_ids = property(lambda self: self.eog_ids)  # every id llama.cpp's llama_vocab_is_eog accepts
  def is_eog(self, i: int) -> bool: return i in self.eog_ids
  def is_control(self, i: int) -> bool: return bool(self.attrs[i] & CONTROL)
  def __len__(self): return self.vocab_size
  def __repr__(self): return f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, backend={self.backend!r})"

  @classmethod
  def from_gguf(cls, gf, backend: str = "auto") -> Tokenizer:
    """From a `tg_ds4.io.gguf.GGUFFile` (or its path, or its metadata dict)."""
    return cls(_meta(gf), backend)

  # *** encode ***

  def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
    out: list[int] = []
    if add_special and self.add_bos: out.append(self._need("bos"))
    prev_special = True  # SPM: a space is prefixed to the first text and to text right after a special token
    for frag in self._partition(text, parse_special):
      if isinstance(frag, int): out.append(frag); prev_special = True; continue
      if self.spm and self._hf_pipeline is None:
        self._spm(((" " if self.add_space_prefix and prev_special else "") + frag).replace(" ", "\u2581"), out)
        prev_special = False
      else: self._bpe(frag.replace(" ", "\u2581") if self.escape_whitespaces else frag, out)
    if add_special and self.add_eos: out.append(self._need("eos"))
    return out

  def _need(self, k: str) -> int:
    if (i := self.special_ids.get(k)) is None: raise ValueError(f"this vocab adds a {k.upper()} token but has none")
    return i

  def _partition(self, text: str, parse_special: bool) -> list:
    """tokenizer_st_partition: each special token (longest first) splits every text fragment at each of its occurrences."""
    if not text: return []
    if (pat := self._special_re[parse_special]) is None or not (matches := list(pat.finditer(text))): return [text]
    # which specials occur: the leftmost-longest matches, the longest ones starting inside those, and their prefixes
    known, found = self._special_text[parse_special], {m.group() for m in matches}
    for m in matches:
      for q in range(m.start() + 1, m.end()):
        if mm := pat.match(text, q): found.add(mm.group())
    found |= {t[:k] for t in list(found) for k in range(1, len(t)) if t[:k] in known}
    frags: list = [(0, len(text))]
    for tok, tid, attr in self._specials[parse_special]:
      if tok not in found: continue
      new = []
      for f in frags:
        if isinstance(f, int): new.append(f); continue
        a, b = f
        while (m := text.find(tok, a, b)) >= 0:
          left = m
          if attr & LSTRIP:
            while left > a and text[left-1] in _C_SPACE: left -= 1
          if left > a: new.append((a, left))
          new.append(tid)
          a = m + len(tok)
          if attr & RSTRIP:
            while a < b and text[a] in _C_SPACE: a += 1
        if a < b: new.append((a, b))
      frags = new
    return [f if isinstance(f, int) else text[f[0]:f[1]] for f in frags]

  def pretokenize(self, text: str) -> list[str]:
    """The pieces llama.cpp's regex split makes of one text fragment (before byte-level encoding)."""
    if self._hf_pipeline is not None: return [text[a:b] for _, (a, b) in self._hf_pipeline.pre_tokenizer.pre_tokenize_str(text)]
    spans, col, wide = [(0, len(text))], None, None
    for pat, collapsed in self._stages:
      if collapsed: s = col = col if col is not None else text if text.isascii() else text.translate(_COLLAPSE)
      else: s = wide = wide if wide is not None else text if text.isascii() else text.translate(_WIDE)
      spans = pat(s, spans) if callable(pat) else _split(pat, s, spans)
    return [text[a:b] for a, b in spans]

  def _bpe(self, text: str, out: list[int]):
    if self._hf_pipeline is not None: out += self._hf_pipeline.encode(text, add_special_tokens=False).ids; return
    cache = self._cache
    if len(cache) > 1 << 18: cache.clear()
    for w in self.pretokenize(text):
      if (ids := cache.get(w)) is None: ids = cache[w] = self._bpe_word(w)
      out += ids

  def _bpe_word(self, word: str) -> list[int]:
    w = _byte_encode(word) if self.byte_encode else word
    vocab = self.vocab
    if (self.ignore_merges or (self._gemma4 and not w.strip("\n"))) and (i := vocab.get(w)) is not None: return [i]
    if self.backend == "tokenizers" and (self.byte_encode or not _SURROGATE.search(w)):  # the library takes valid UTF-8 only
      if self._holes is None: return [t.id for t in self._hf.tokenize(w)]
      return [t.id for part in self._holes.split(w) if part for t in self._hf.tokenize(part)]
    out = []
    for s in self._merge_bpe(w):
      if (i := vocab.get(s)) is not None: out.append(i); continue
      for b in s.encode("utf-8", "surrogatepass"):  # a symbol that is no token: its bytes one by one, skipping tokenless ones
        if (i := vocab.get(f"<0x{b:02X}>" if not self.byte_encode else chr(b) if b < 128 else "")) is not None: out.append(i)
    return out

  def _merge_bpe(self, w: str) -> list[str]:
    """llm_tokenizer_bpe_session: merge the adjacent pair of lowest rank (leftmost on ties) until none is left."""
    ranks, syms = self._ranks, list(w)
    n = len(syms)
    nxt, prv = [*range(1, n), -1], [*range(-1, n - 1)]
    heap = [(r, i, i + 1, syms[i], syms[i+1]) for i in range(n - 1) if (r := ranks.get((syms[i], syms[i+1]))) is not None]
    heapq.heapify(heap)
    while heap:
      _, i, j, a, b = heapq.heappop(heap)
      if syms[i] != a or syms[j] != b: continue  # stale: one side has merged since
      syms[i], syms[j] = a + b, ""
      nxt[i] = k = nxt[j]
      if k >= 0: prv[k] = i
      for l, r in ((prv[i], i), (i, nxt[i])):
        if l >= 0 and r >= 0 and (rk := ranks.get((syms[l], syms[r]))) is not None: heapq.heappush(heap, (rk, l, r, syms[l], syms[r]))
    return [s for s in syms if s]

  def _spm(self, text: str, out: list[int]):
    cache = self._cache
    if len(cache) > 1 << 18: cache.clear()
    for piece in self._spm_cut.split(text):
      if (ids := cache.get(piece)) is None: ids = cache[piece] = self._spm_piece(piece)
      out += ids

  def _spm_piece(self, text: str) -> list[int]:
    out, vocab = [], self.vocab
    for s in self._merge_spm(text):
      if (i := vocab.get(s)) is not None: out.append(i); continue
      for b in s.encode("utf-8", "surrogatepass"):  # byte fallback: <0xNN>, else the byte itself as a token
        if (i := vocab.get(f"<0x{b:02X}>", vocab.get(chr(b)) if b < 128 else None)) is None:
          raise ValueError(f"SPM vocab has no token for byte 0x{b:02X}")
        out.append(i)
    return out

  def _merge_spm(self, text: str) -> list[str]:
    """llm_tokenizer_spm_session: merge the adjacent pair whose concatenation is the highest-scoring token (leftmost on ties)."""
    vocab, scores, syms = self.vocab, self.scores, list(text)
    n = len(syms)
    nxt, prv = [*range(1, n), -1], [*range(-1, n - 1)]
    heap = []
    def push(l, r):
      if (t := vocab.get(s := syms[l] + syms[r])) is not None: heap.append((-scores[t], l, len(s), r))
    for i in range(n - 1): push(i, i + 1)
    heapq.heapify(heap)
    while heap:
      _, i, size, j = heapq.heappop(heap)
      if not syms[i] or not syms[j] or len(syms[i]) + len(syms[j]) != size: continue
      syms[i], syms[j] = syms[i] + syms[j], ""
      nxt[i] = k = nxt[j]
      if k >= 0: prv[k] = i
      for l, r in ((prv[i], i), (i, nxt[i])):
        if l >= 0 and r >= 0 and (t := vocab.get(s := syms[l] + syms[r])) is not None: heapq.heappush(heap, (-scores[t], l, len(s), r))
    return [s for s in syms if s]

  # *** decode ***

  def token_to_piece(self, i: int, special: bool = True) -> bytes:
    """llama_token_to_piece: control and unknown tokens are empty unless `special`; user-defined ones are always their text."""
    if not 0 <= i < self.vocab_size: raise ValueError(f"token id {i} is out of range (vocab size {self.vocab_size})")
    attr = self.attrs[i]
    if not special and attr & (UNKNOWN | CONTROL): return b""
    if (p := self._pieces.get(i)) is None: p = self._pieces[i] = self._piece(i, attr)
    return p

  def _piece(self, i: int, attr: int) -> bytes:
    t = self.tokens[i]
    if attr & (UNKNOWN | CONTROL | USER_DEFINED): return t.encode("utf-8", "surrogatepass")
    if attr & NORMAL:
      if self.spm or self.escape_whitespaces: return t.replace("\u2581", " ").encode("utf-8", "surrogatepass")
      return _byte_decode(t)
    if attr & BYTE: return bytes([int(t[3:5], 16)])
    return b""

  def detokenize(self, ids: Iterable[int], remove_special: bool = False, unparse_special: bool = True) -> bytes:
    """llama_detokenize: the pieces, minus one leading space (add_space_prefix), then clean_spaces."""
    ids = list(ids)
    remove_space = self.add_space_prefix
    if remove_special and self.add_bos and ids and ids[0] == self.bos_id: remove_space, ids = False, ids[1:]
    if remove_special and self.add_eos and ids and ids[-1] == self.eos_id: ids = ids[:-1]
    out = b"".join(self.token_to_piece(i, unparse_special) for i in ids)
    if remove_space and ids and out[:1] == b" " and self.token_to_piece(ids[0], unparse_special)[:1] == b" ": out = out[1:]
    return _clean_spaces(out) if self.clean_spaces else out

  def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
    """Text of `ids` as llama.cpp detokenizes it (invalid UTF-8 becomes U+FFFD); skip_special drops control tokens and a
    leading BOS / trailing EOS the vocab adds."""
    return self.detokenize(ids, remove_special=skip_special, unparse_special=not skip_special).decode("utf-8", "replace")

  def stream(self, skip_special: bool = False) -> StreamDecoder: return StreamDecoder(self, skip_special)

class StreamDecoder:
  """Feed ids one at a time, get back the text that is final: a multi-byte character is held back until all its bytes are
  in, and with clean_spaces the last few bytes are held back while a later piece could still remove a space from them.
  The concatenation of every feed() and the final flush() equals `tokenizer.decode(ids, skip_special)`."""

  def __init__(self, tok: Tokenizer, skip_special: bool = False):
    self.tok, self.skip = tok, skip_special
    self.first, self.pending, self.tail = True, b"", b""  # tail: the last bytes emitted (raw), context for the next cut
    self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")

  def feed(self, i: int) -> str:
    tok, piece = self.tok, self.tok.token_to_piece(i, not self.skip)
    if self.first:
      if self.skip and tok.add_bos and i == tok.bos_id: self.first = False; return ""  # a removed BOS keeps the next space
      if tok.add_space_prefix and piece[:1] == b" ": piece = piece[1:]
      self.first = False
    if not tok.clean_spaces: return self.utf8.decode(piece)
    # cut where the cleanup cannot reach across: none of the 3 bytes before the cut is a space or an apostrophe (those are
    # kept as they are, so the cleanup of what follows the cut starts as it would on the whole text)
    buf, n = self.pending + piece, len(self.tail)
    ctx, k = self.tail + buf, len(buf)
    while k > 0 and (b" " in (w := ctx[max(0, n + k - 3):n + k]) or b"'" in w): k -= 1
    self.pending, self.tail = buf[k:], (self.tail + buf[:k])[-3:]
    return self.utf8.decode(_clean_spaces(buf[:k]))

  def flush(self, drop_incomplete: bool = False) -> str:
    """The rest of the text. A character whose bytes were cut off (generation stopped inside it) ends in U+FFFD, as
    `decode` writes it, or with `drop_incomplete` is left out: an answer cut by max_tokens then ends at a whole character."""
    out, self.pending, self.tail = self.pending, b"", b""
    text = self.utf8.decode(_clean_spaces(out) if self.tok.clean_spaces else out, final=not drop_incomplete)
    self.utf8.reset()
    return text
