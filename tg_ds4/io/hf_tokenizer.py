"""A checkpoint folder's tokenizer files as the `tokenizer.*` GGUF metadata the converter writes.

Two kinds of tokenizer.json, told apart by their pipeline:
  * byte-level BPE (llama 3, qwen2, DeepSeek): `tokenizer.ggml.model` "gpt2", as the converter's get_vocab_base writes
    it: the vocab (padded to config.json's vocab_size), token types (added special tokens are control tokens, other
    added tokens user-defined), merges;
  * SentencePiece-style BPE (Gemma's, as transformers converts its tokenizer.model: byte fallback, spaces written as
    "▁" by the normalizer, a decoder that turns "▁" back into spaces and `<0xNN>` tokens into bytes):
    `tokenizer.ggml.model` "llama", as the converter's _create_vocab_sentencepiece writes it from tokenizer.model:
    token types normal / byte (`<0xNN>`) / control (added special tokens and those the converter deems
    special-looking: `<unusedN>`, `<mask>`, `<|...|>`) / user-defined (other added tokens, their "▁" written as
    spaces) / unused padding; scores that order the tokens by the first merge that makes each (the order of
    SentencePiece's scores, by which transformers ranks the merges: minus the rank), -1000 for added tokens, 0 for
    byte tokens; add_space_prefix false. Pipelines that prepend "▁" (llama 2's Metaspace) are refused: where
    transformers prepends depends on how special tokens split the text (prepend_scheme "first", the legacy flag),
    which tokenizing the text between special tokens piece by piece, as here, does not reproduce.
Both carry BOS/EOS and whether they are added, the special ids, and the chat template, from tokenizer.json,
tokenizer_config.json (and `chat_template.jinja`, where transformers 5 saves the template). How text is split and
merged is what the converter cannot write down without recognising the tokenizer (it hashes a test encoding into a
`tokenizer.ggml.pre` name): here `pre` is "hf" and tokenizer.Tokenizer runs tokenizer.json's own pipeline through the
`tokenizers` library for the text between special tokens, so the ids are transformers'."""
from __future__ import annotations

import json, pathlib, re
from typing import Any, Iterator

from tg_ds4.io.gguf import GGUFError

HF_JSON_KEY = "tokenizer.huggingface.json"  # not a GGUF key: the tokenizer.json path, for pre "hf"
# GGUF token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")

def _load(p: pathlib.Path) -> Any:
  try: return json.loads(p.read_text())
  except (UnicodeDecodeError, json.JSONDecodeError) as e: raise GGUFError(f"{p}: not valid JSON ({e})") from None

def _nodes(node: Any) -> Iterator[dict]:
  """A normalizer / pre-tokenizer / decoder and the members of its Sequences."""
  if not isinstance(node, dict): return
  yield node
  for key in ("normalizers", "pretokenizers", "decoders"):
    for n in node.get(key) or []: yield from _nodes(n)

def _byte_level(node: Any) -> bool: return any(n.get("type") == "ByteLevel" for n in _nodes(node))

def _spm_style(tj: dict) -> bool:
  """Spaces written as "▁" (a Replace normalizer or a Metaspace pre-tokenizer) and decoded back to spaces."""
  text = lambda n: ((n.get("pattern") or {}).get("String"), n.get("content"))
  writes = any(n.get("type") == "Metaspace" or (n.get("type") == "Replace" and text(n) == (" ", "\u2581"))
               for n in (*_nodes(tj.get("normalizer")), *_nodes(tj.get("pre_tokenizer"))))
  reads = any(n.get("type") == "Metaspace" or (n.get("type") == "Replace" and text(n) == ("\u2581", " ")) for n in _nodes(tj.get("decoder")))
  return writes and reads

def _prepends(tj: dict) -> bool:
  """Whether the pipeline puts a "▁" before each text (a Prepend normalizer, a Metaspace that prepends)."""
  return any(n.get("type") == "Prepend" for n in _nodes(tj.get("normalizer"))) or \
    any(n.get("type") == "Metaspace" and n.get("prepend_scheme", "always" if n.get("add_prefix_space", True) else "never") != "never"
        for n in _nodes(tj.get("pre_tokenizer")))

def _content(t: Any) -> str | None: return t.get("content") if isinstance(t, dict) else t if isinstance(t, str) else None

def _looks_special(t: str) -> bool:
  """The converter's does_token_look_special: added tokens some models forgot to mark special."""
  return t in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (t.startswith("<|") and t.endswith("|>")) or \
    (t.startswith("<\uff5c") and t.endswith("\uff5c>")) or (t.startswith("<unused") and t.endswith(">"))

def tokenizer_metadata(folder: pathlib.Path, cfg: dict) -> dict[str, Any]:
  tj_path = folder / "tokenizer.json"
  if not tj_path.is_file(): raise GGUFError(f"{folder}: no tokenizer.json (a checkpoint folder's tokenizer is read from it)")
  tj = _load(tj_path)
  tc = _load(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
  model = tj.get("model") or {}
  byte_level = model.get("type") == "BPE" and _byte_level(tj.get("pre_tokenizer")) and _byte_level(tj.get("decoder"))
  spm = not byte_level and model.get("type") == "BPE" and _spm_style(tj)
  if not (byte_level or spm):
    raise GGUFError(f"{tj_path}: only byte-level BPE and SentencePiece-style (Gemma's) tokenizers are supported for checkpoint folders "
                    f"(model {model.get('type')!r}, decoder {(tj.get('decoder') or {}).get('type')!r})")
  if spm and _prepends(tj):
    raise GGUFError(f"{tj_path}: a SentencePiece-style tokenizer that prepends '\u2581' to each text (llama 2's Metaspace) is not supported "
                    "for checkpoint folders (only Gemma's, which writes spaces as they are)")
  vocab: dict[str, int] = dict(model.get("vocab") or {})
  unk = model.get("unk_token")
  added = {t["content"]: t for t in tj.get("added_tokens", []) if isinstance(t, dict) and "content" in t and "id" in t}
  vocab.update({c: t["id"] for c, t in added.items()})
  n = max(int(cfg.get("vocab_size") or 0), max(vocab.values(), default=-1) + 1)
  by_id: dict[int, str] = {i: tok for tok, i in vocab.items()}
  merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
  scores: dict[int, float] = {}
  if spm:  # a token's score: minus the rank of the first merge that makes it
    for r, m in enumerate(merges):
      if (k := m.find(" ", 1)) >= 0 and (i := vocab.get(m[:k] + m[k + 1:])) is not None: scores.setdefault(i, -float(r))
  tokens: list[str] = []
  types: list[int] = []
  spm_scores: list[float] = []
  for i in range(n):  # the converter's get_vocab_base / _create_vocab_sentencepiece: holes become [PAD{i}] (unused)
    tok = by_id.get(i)
    if tok is None: tokens.append(f"[PAD{i}]"); types.append(UNUSED); spm_scores.append(-10000.0); continue
    if tok in added:
      special = bool(added[tok].get("special")) or (spm and _looks_special(tok))
      types.append(CONTROL if special else USER_DEFINED)
      tokens.append(tok if special or not spm else tok.replace("\u2581", " "))  # the converter pre-normalizes user-defined spaces
      spm_scores.append(-1000.0)
      continue
    byte = spm and bool(model.get("byte_fallback")) and _BYTE_TOKEN.fullmatch(tok) is not None
    tokens.append(tok)
    types.append(BYTE if byte else UNKNOWN if spm and tok == unk else NORMAL)
    spm_scores.append(0.0 if byte else scores.get(i, -float(len(merges) + i)))
  # BOS/EOS added: tokenizer_config's flags, else what tokenizer.json's post-processor puts around a single text
  # (transformers 5 saves no flags, llama 3's template adds <|begin_of_text|>, Gemma's <bos>)
  single = (tj.get("post_processor") or {}).get("single") or [] if (tj.get("post_processor") or {}).get("type") == "TemplateProcessing" else []
  around = [s["SpecialToken"]["id"] for s in single if isinstance(s, dict) and "SpecialToken" in s]
  first_special, last_special = bool(single) and "SpecialToken" in single[0], bool(single) and "SpecialToken" in single[-1]
  md: dict[str, Any] = {"tokenizer.ggml.model": "llama" if spm else "gpt2", "tokenizer.ggml.pre": "hf", HF_JSON_KEY: str(tj_path),
                        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                        "tokenizer.ggml.add_bos_token": bool(tc.get("add_bos_token", first_special)),
                        "tokenizer.ggml.add_eos_token": bool(tc.get("add_eos_token", last_special and len(single) > 1))}
  if spm: md.update({"tokenizer.ggml.scores": spm_scores, "tokenizer.ggml.add_space_prefix": False})
  else: md["tokenizer.ggml.merges"] = merges
  if first_special and around[0] in vocab: md["tokenizer.ggml.bos_token_id"] = vocab[around[0]]
  for key, name in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"), ("mask", "mask")):
    if f"tokenizer.ggml.{name}_token_id" in md: continue
    if (c := _content(tc.get(f"{key}_token"))) is not None and c in vocab: md[f"tokenizer.ggml.{name}_token_id"] = vocab[c]
    elif isinstance(i := cfg.get(f"{key}_token_id"), int) and 0 <= i < n: md[f"tokenizer.ggml.{name}_token_id"] = i
  if spm and "tokenizer.ggml.unknown_token_id" not in md and unk in vocab: md["tokenizer.ggml.unknown_token_id"] = vocab[unk]
  template = tc.get("chat_template")
  if isinstance(template, list): template = next((t.get("template") for t in template if t.get("name") == "default"), None)
  if template is None and (folder / "chat_template.jinja").is_file(): template = (folder / "chat_template.jinja").read_text()
  if isinstance(template, str): md["tokenizer.chat_template"] = template
  return md
