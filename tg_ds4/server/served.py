"""The loaded model as the HTTP side sees it (names, tokenizer, chat template, context size, the worker), and the prompt
checks both APIs share: tokenizing, the context limit (a 400 before any inference) and the sampling parameters."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from tg_ds4.runtime.sampling import SamplingParams
from tg_ds4.server.errors import ApiError
from tg_ds4.server.toolcalls import template_tool_calls
from tg_ds4.server.worker import Worker
from tg_ds4.text.chat_template import ChatTemplateError, Template
from tg_ds4.text.tokenizer import Tokenizer


@dataclass
class Served:
  """`model_id` is the one id the server lists and answers under; `aliases` the other names it goes by (the file's
  name and stem, its general.name, what `-m` said). A request may name any model: clients send whatever name they were
  configured with, and one model serves them all (its responses say which); `strict` refuses names outside the aliases
  with a 404 instead."""
  model_id: str
  aliases: frozenset[str]
  tok: Tokenizer
  template: Template
  max_ctx: int
  worker: Worker
  created: int = field(default_factory=lambda: int(time.time()))
  strict: bool = False

  def check_model(self, name: str) -> None:
    if self.strict and name != self.model_id and name not in self.aliases:
      raise ApiError(404, f"model {name!r} does not exist; this server serves {self.model_id!r}", "model", "model_not_found")

  def render(self, messages: list[dict], tools: list[dict] | None, thinking: bool | None = None, **template_kwargs) -> list[int]:
    """Chat messages -> prompt ids through the model's template. Tool-call arguments go in as objects, or as JSON strings
    for templates that concatenate them (DeepSeek V3). `thinking`: reasoning on/off (None: the template's default);
    `template_kwargs`: further template variables."""
    def with_args(as_object: bool) -> list[dict]:
      return [{**m, "tool_calls": template_tool_calls(m["tool_calls"], as_object)} if m.get("tool_calls") else m for m in messages]
    kw = {**template_kwargs, "tools": tools or None, "thinking": thinking}
    try:
      try: text = self.template.render(with_args(True), **kw)
      except ChatTemplateError:
        if not any(m.get("tool_calls") for m in messages): raise
        text = self.template.render(with_args(False), **kw)
    except ChatTemplateError as e: raise ApiError(400, str(e), "messages") from None
    add_bos = getattr(self.template, "encode_add_special", lambda _: True)(text)  # no second BOS when the template wrote one
    return self.encode(text, parse_special=True, param="messages", add_special=add_bos)

  def encode(self, text: str, parse_special: bool, param: str, add_special: bool = True) -> list[int]:
    return self.check_prompt(self.tok.encode(text, add_special=add_special, parse_special=parse_special), param)

  def check_prompt(self, ids: list[int], param: str) -> list[int]:
    if not ids: raise ApiError(400, "the prompt is empty", param)
    if len(ids) >= self.max_ctx:
      raise ApiError(400, f"the prompt is {len(ids)} tokens; the context holds {self.max_ctx} (prompt and at least one generated token)",
                     param, "context_length_exceeded")
    return ids

  def room(self, prompt: list[int], max_tokens: int | None) -> int:
    """Tokens to generate: as asked, capped by what is left of the context (finish_reason "length" when that cuts)."""
    return min(max_tokens or self.max_ctx, self.max_ctx - len(prompt))

def sampling(temperature: float | None, top_p: float | None, top_k: int | None, min_p: float | None, seed: int | None,
             n_vocab: int) -> SamplingParams:
  """API defaults are the APIs' own (temperature 1); 0 means greedy. top_k beyond the vocabulary means no limit."""
  return SamplingParams(1.0 if temperature is None else temperature, min(top_k or 0, n_vocab), 1.0 if top_p is None else top_p,
                        min_p or 0.0, seed)
