"""Chat templates: `tokenizer.chat_template` rendered with jinja2 the way transformers renders it.

Same environment as transformers' `apply_chat_template`: a sandbox with trim_blocks/lstrip_blocks and loop controls,
`raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape, and `bos_token`/`eos_token` in scope.
A file without a template falls back to ChatML (`<|im_start|>role\\ncontent<|im_end|>`), which is also llama.cpp's
fallback; `Template.is_fallback` says when that happened."""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

class ChatTemplateError(ValueError):
  """A template that fails to compile or render; the message says which and why."""

def _raise(message: str): raise ChatTemplateError(f"the chat template raised: {message}")

def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

@dataclass(frozen=True)
class Template:
  source: str
  bos_token: str = ""
  eos_token: str = ""
  is_fallback: bool = False

  @staticmethod
  def from_gguf(gf, tokens: list[str] | None = None) -> Template:
    tokens = tokens if tokens is not None else gf.get("tokenizer.ggml.tokens") or []
    tok = lambda key: tokens[i] if isinstance(i := gf.get(key), int) and 0 <= i < len(tokens) else ""
    src = gf.get("tokenizer.chat_template")
    return Template(src or CHATML, tok("tokenizer.ggml.bos_token_id"), tok("tokenizer.ggml.eos_token_id"), is_fallback=not src)

  def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None, **kwargs) -> str:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try: tmpl = env.from_string(self.source)
    except TemplateError as e: raise ChatTemplateError(f"the chat template does not compile: {e}") from None
    try:
      return tmpl.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, bos_token=self.bos_token,
                         eos_token=self.eos_token, **kwargs)
    except ChatTemplateError: raise
    except Exception as e:  # jinja2 surfaces template bugs as many exception types; report them as one
      raise ChatTemplateError(f"the chat template failed to render: {type(e).__name__}: {e}") from None
