"""Chat templates: `tokenizer.chat_template` rendered with jinja2 the way transformers renders it.

Same environment as transformers' `apply_chat_template`: a sandbox with trim_blocks/lstrip_blocks and loop controls,
`raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape, and `bos_token`/`eos_token` in scope; plus the
`from_json` filter that llama.cpp's template engine has (the DeepSeek V4 templates parse string tool arguments with it).
`thinking` turns reasoning on/off: it is passed as both `thinking` (DeepSeek V3.1+/V4) and `enable_thinking` (Qwen3 and
others), so the same flag works for either spelling; None leaves the template's own default (V4: off).
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

_REASONING = ("reasoning_content", "thinking", "reasoning")

def _alias_reasoning(m: Any) -> Any:
  """As transformers: a message's reasoning under any of its names is also `reasoning_content` (what DeepSeek/Qwen templates
  read) and `thinking` (gpt-oss)."""
  if not isinstance(m, dict) or (r := next((m[k] for k in _REASONING if m.get(k) is not None), None)) is None: return m
  return {"thinking": r, **m, "reasoning_content": r}

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

  def encode_add_special(self, text: str) -> bool:
    """Whether tokenizing a rendered conversation should still add the vocab's BOS: not when the template already wrote it
    (transformers tokenizes templates with add_special_tokens=False; llama.cpp would otherwise start with two BOS)."""
    return not (self.bos_token and text.startswith(self.bos_token))

  def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
             thinking: bool | None = None, **kwargs) -> str:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.filters["from_json"] = json.loads
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    if thinking is not None: kwargs = {"thinking": thinking, "enable_thinking": thinking, **kwargs}
    messages = [_alias_reasoning(m) for m in messages]
    try: tmpl = env.from_string(self.source)
    except TemplateError as e: raise ChatTemplateError(f"the chat template does not compile: {e}") from None
    try:
      return tmpl.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, documents=None,
                         bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
    except ChatTemplateError: raise
    except Exception as e:  # jinja2 surfaces template bugs as many exception types; report them as one
      raise ChatTemplateError(f"the chat template failed to render: {type(e).__name__}: {e}") from None

def assistant_message(reply: str) -> dict:
  """The history entry for a generated reply. Text before a `</think>` is reasoning (the prompt ended in `<think>`):
  it goes to `reasoning_content`, which the DeepSeek V4 template re-renders for the latest turn and drops for older ones."""
  head, sep, tail = reply.partition("</think>")
  return {"role": "assistant", "content": tail, "reasoning_content": head.removeprefix("<think>")} if sep else {"role": "assistant", "content": reply}
