"""Request bodies as pydantic models: strict types (no "1" for 1, no 0 for false), ranges, unknown fields ignored.
The same models give the OpenAPI schema the server publishes at /openapi.json."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import models_json_schema

from tg_ds4.server.errors import ApiError

MAX_STOP, MAX_STOP_LEN = 16, 512  # stop strings are matched against every token's text: bounded work per token

class Strict(BaseModel):
  model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

def _union_branch(p) -> bool:
  """pydantic's labels for union members in an error location ('str', 'list[...]', 'constrained-str'): not field names."""
  return isinstance(p, str) and ("[" in p or "-" in p or p in ("str", "int", "float", "bool", "list", "dict", "none"))

def validate(model: type[Strict], body: dict) -> Strict:
  """Parse or raise a 400 that names the first offending field."""
  try: return model.model_validate(body)
  except ValidationError as e:
    # in a union the deepest error is the specific one; at equal depth, a wrong value says more than a wrong type
    err = max(e.errors(), key=lambda x: (len(x["loc"]), not x["type"].endswith("_type")))
    loc = ".".join(str(p) for p in err["loc"] if not _union_branch(p))
    raise ApiError(400, f"{loc or 'body'}: {err['msg']}", param=loc or None) from None

StopString = Annotated[str, Field(max_length=MAX_STOP_LEN)]
Stop = Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP)], None]

class StreamOptions(Strict):
  include_usage: bool = False

class Sampling(Strict):
  """Fields both OpenAI endpoints share."""
  model: str
  max_tokens: int | None = Field(None, ge=1)
  temperature: float | None = Field(None, ge=0, le=2)
  top_p: float | None = Field(None, gt=0, le=1)
  top_k: int | None = Field(None, ge=0)
  min_p: float | None = Field(None, ge=0, le=1)
  seed: int | None = None
  stop: Stop = None
  n: int | None = Field(None, ge=1, le=128)
  stream: bool = False
  stream_options: StreamOptions | None = None
  presence_penalty: float | None = Field(None, ge=-2, le=2)
  frequency_penalty: float | None = Field(None, ge=-2, le=2)
  logit_bias: dict[str, float] | None = None
  user: str | None = None

# *** OpenAI chat ***

class TextPart(Strict):
  type: Literal["text"]
  text: str

class FunctionCall(Strict):
  name: str
  arguments: str | dict[str, Any]

class ToolCallIn(Strict):
  id: str | None = None
  type: Literal["function"] = "function"
  function: FunctionCall

class ChatMessage(Strict):
  role: Literal["system", "developer", "user", "assistant", "tool"]
  content: str | list[TextPart] | None = None
  name: str | None = None
  tool_calls: list[ToolCallIn] | None = None
  tool_call_id: str | None = None

class FunctionDef(Strict):
  name: str = Field(min_length=1, max_length=256)
  description: str | None = None
  parameters: dict[str, Any] | None = None
  strict: bool | None = None

class Tool(Strict):
  type: Literal["function"]
  function: FunctionDef

class NamedFunction(Strict):
  name: str

class NamedToolChoice(Strict):
  type: Literal["function"]
  function: NamedFunction

class ResponseFormat(Strict):
  type: Literal["text", "json_object", "json_schema"]

class ChatRequest(Sampling):
  messages: list[ChatMessage] = Field(min_length=1)
  max_completion_tokens: int | None = Field(None, ge=1)
  logprobs: bool | None = None
  top_logprobs: int | None = Field(None, ge=0, le=20)
  tools: list[Tool] | None = None
  tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
  parallel_tool_calls: bool | None = None
  response_format: ResponseFormat | None = None
  # extra chat template variables, as llama.cpp's server and vLLM take them: {"enable_thinking": false} turns a reasoning
  # template's thinking off (tg_ds4.text.chat_template passes `thinking` and `enable_thinking` together)
  chat_template_kwargs: dict[str, Any] | None = None

# *** OpenAI legacy completions ***

class CompletionRequest(Sampling):
  prompt: str | list[str] | list[int] | list[list[int]]
  max_tokens: int | None = Field(16, ge=1)  # the legacy endpoint's documented default
  logprobs: int | None = Field(None, ge=0, le=5)
  echo: bool = False
  suffix: str | None = None
  best_of: int | None = Field(None, ge=1)

# *** Anthropic messages ***

class ATextBlock(Strict):
  type: Literal["text"]
  text: str

class AToolUseBlock(Strict):
  type: Literal["tool_use"]
  id: str
  name: str
  input: dict[str, Any]

class AToolResultBlock(Strict):
  type: Literal["tool_result"]
  tool_use_id: str
  content: str | list[ATextBlock] | None = None
  is_error: bool | None = None

ABlock = Annotated[Union[ATextBlock, AToolUseBlock, AToolResultBlock], Field(discriminator="type")]

class AMessage(Strict):
  role: Literal["user", "assistant"]
  content: str | list[ABlock]

class ATool(Strict):
  name: str = Field(min_length=1, max_length=256)
  description: str | None = None
  input_schema: dict[str, Any]

class AToolChoice(Strict):
  type: Literal["auto", "any", "tool", "none"]
  name: str | None = None

class AThinking(Strict):
  type: str  # "enabled", "adaptive", ...: only "disabled" can be honoured

class MessagesRequest(Strict):
  model: str
  messages: list[AMessage] = Field(min_length=1)
  max_tokens: int = Field(ge=1)
  system: str | list[ATextBlock] | None = None
  temperature: float | None = Field(None, ge=0, le=1)
  top_p: float | None = Field(None, gt=0, le=1)
  top_k: int | None = Field(None, ge=0)
  stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
  stream: bool = False
  tools: list[ATool] | None = None
  tool_choice: AToolChoice | None = None
  metadata: dict[str, Any] | None = None
  thinking: AThinking | None = None

def openapi(title: str, version: str) -> dict:
  """The OpenAPI 3.1 document of the POST endpoints (request bodies from the models above)."""
  routes = {"/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest, "/v1/messages": MessagesRequest}
  keys, defs = models_json_schema([(m, "validation") for m in routes.values()], ref_template="#/components/schemas/{model}")
  ok = {"200": {"description": "the answer (JSON, or text/event-stream with stream=true)"}, "400": {"description": "invalid request"},
        "404": {"description": "unknown model"}, "413": {"description": "body too large"}, "429": {"description": "queue full"}}
  paths = {p: {"post": {"requestBody": {"required": True, "content": {"application/json": {"schema": keys[(m, "validation")]}}}, "responses": ok}}
           for p, m in routes.items()}
  for p in ("/v1/models", "/health"): paths[p] = {"get": {"responses": {"200": {"description": "OK"}}}}
  return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths, "components": {"schemas": defs.get("$defs", {})}}
