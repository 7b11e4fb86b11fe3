"""A checkpoint folder's tokenizer files as the `tokenizer.*` GGUF metadata the converter writes for a BPE vocab.

The vocab (padded to config.json's vocab_size), token types (added special tokens are control tokens, other added
tokens user-defined), merges, BOS/EOS and whether they are added, and the chat template come from tokenizer.json,
tokenizer_config.json (and `chat_template.jinja`, where transformers 5 saves the template). How text is split before
merging is what the converter cannot write down without recognising the tokenizer (it hashes a test encoding into a
`tokenizer.ggml.pre` name): here `pre` is "hf" and tokenizer.Tokenizer runs tokenizer.json's own pipeline through the
`tokenizers` library for the text between special tokens. Byte-level BPE only (llama 3, qwen2, DeepSeek): decoding
reverses the byte-level encoding, which other tokenizer.json kinds do not use."""
from __future__ import annotations

import json, pathlib
from typing import Any

from tg_ds4.gguf import GGUFError

HF_JSON_KEY = "tokenizer.huggingface.json"  # not a GGUF key: the tokenizer.json path, for pre "hf"

def _load(p: pathlib.Path) -> Any:
  try: return json.loads(p.read_text())
  except (UnicodeDecodeError, json.JSONDecodeError) as e: raise GGUFError(f"{p}: not valid JSON ({e})") from None

def _byte_level(node: Any) -> bool:
  if not isinstance(node, dict): return False
  return node.get("type") == "ByteLevel" or any(_byte_level(n) for n in node.get("pretokenizers", []) + node.get("decoders", []))

def _content(t: Any) -> str | None: return t.get("content") if isinstance(t, dict) else t if isinstance(t, str) else None

def tokenizer_metadata(folder: pathlib.Path, cfg: dict) -> dict[str, Any]:
  tj_path = folder / "tokenizer.json"
  if not tj_path.is_file(): raise GGUFError(f"{folder}: no tokenizer.json (a checkpoint folder's tokenizer is read from it)")
  tj = _load(tj_path)
  tc = _load(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
  model = tj.get("model") or {}
  if model.get("type") != "BPE" or not (_byte_level(tj.get("pre_tokenizer")) and _byte_level(tj.get("decoder"))):
    raise GGUFError(f"{tj_path}: only byte-level BPE tokenizers are supported for checkpoint folders "
                    f"(model {model.get('type')!r}, decoder {(tj.get('decoder') or {}).get('type')!r})")
  vocab: dict[str, int] = dict(model.get("vocab") or {})
  added = {t["content"]: t for t in tj.get("added_tokens", []) if isinstance(t, dict) and "content" in t and "id" in t}
  vocab.update({c: t["id"] for c, t in added.items()})
  n = max(int(cfg.get("vocab_size") or 0), max(vocab.values(), default=-1) + 1)
  by_id: dict[int, str] = {i: tok for tok, i in vocab.items()}
  tokens, types = [], []
  for i in range(n):  # the converter's get_vocab_base: holes become [PAD{i}] (unused)
    tok = by_id.get(i)
    if tok is None: tokens.append(f"[PAD{i}]"); types.append(5)
    else: tokens.append(tok); types.append((3 if added[tok].get("special") else 4) if tok in added else 1)
  merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
  # BOS/EOS added: tokenizer_config's flags, else what tokenizer.json's post-processor puts around a single text
  # (transformers 5 saves no flags, llama 3's template adds <|begin_of_text|>)
  single = (tj.get("post_processor") or {}).get("single") or [] if (tj.get("post_processor") or {}).get("type") == "TemplateProcessing" else []
  around = [s["SpecialToken"]["id"] for s in single if isinstance(s, dict) and "SpecialToken" in s]
  first_special, last_special = bool(single) and "SpecialToken" in single[0], bool(single) and "SpecialToken" in single[-1]
  md: dict[str, Any] = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "hf", HF_JSON_KEY: str(tj_path),
                        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
                        "tokenizer.ggml.add_bos_token": bool(tc.get("add_bos_token", first_special)),
                        "tokenizer.ggml.add_eos_token": bool(tc.get("add_eos_token", last_special and len(single) > 1))}
  if first_special and around[0] in vocab: md["tokenizer.ggml.bos_token_id"] = vocab[around[0]]
  for key in ("bos", "eos", "unk", "pad"):
    if f"tokenizer.ggml.{key}_token_id" in md: continue
    if (c := _content(tc.get(f"{key}_token"))) is not None and c in vocab: md[f"tokenizer.ggml.{key}_token_id"] = vocab[c]
    elif isinstance(i := cfg.get(f"{key}_token_id"), int) and 0 <= i < n: md[f"tokenizer.ggml.{key}_token_id"] = i
  template = tc.get("chat_template")
  if isinstance(template, list): template = next((t.get("template") for t in template if t.get("name") == "default"), None)
  if template is None and (folder / "chat_template.jinja").is_file(): template = (folder / "chat_template.jinja").read_text()
  if isinstance(template, str): md["tokenizer.chat_template"] = template
  return md
