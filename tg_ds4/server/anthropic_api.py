"""Anthropic-compatible POST /v1/messages: content blocks (text, tool_use, tool_result) in and out; with stream=true the
event sequence message_start, content_block_start/delta/stop per block, message_delta (stop reason, usage), message_stop."""
from __future__ import annotations

import uuid

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import StreamingResponse

from tg_ds4.server.body import read_request
from tg_ds4.server.completion import Completion, Finish, Piece, cancel_on_disconnect
from tg_ds4.server.errors import ApiError
from tg_ds4.server.openai_api import SSE_HEADERS, finish_tools, stream_failure
from tg_ds4.server.schemas import AMessage, ATextBlock, AToolResultBlock, AToolUseBlock, MessagesRequest
from tg_ds4.server.served import Served, sampling
from tg_ds4.server.toolcalls import ToolCall
from tg_ds4.server.wire import JSON, sse
from tg_ds4.server.worker import Started


def _text(content: str | list[ATextBlock] | None) -> str:
  return content if isinstance(content, str) else "".join(b.text for b in content or [])

def template_messages(req: MessagesRequest) -> list[dict]:
  """Anthropic turns as chat-template messages: tool_use blocks become the assistant's tool_calls, tool_result blocks
  become `tool` messages (before the user's text of the same turn)."""
  out = [{"role": "system", "content": _text(req.system)}] if req.system else []
  for m in req.messages:
    m: AMessage
    if isinstance(m.content, str): out.append({"role": m.role, "content": m.content}); continue
    text = "".join(b.text for b in m.content if isinstance(b, ATextBlock))
    if m.role == "assistant":
      calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
               for b in m.content if isinstance(b, AToolUseBlock)]
      out.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
    else:
      for b in m.content:
        if isinstance(b, AToolResultBlock): out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)})
      if text or not any(isinstance(b, AToolResultBlock) for b in m.content): out.append({"role": "user", "content": text})
  return out

def _stop_reason(fin: Finish, calls: list[ToolCall]) -> str:
  if calls and fin.reason == "stop": return "tool_use"
  return "max_tokens" if fin.reason == "length" else "stop_sequence" if fin.stop_sequence else "end_turn"

def _usage(fin: Finish) -> dict:
  u = fin.usage  # Anthropic's input_tokens excludes what was read from the cache
  return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens, "cache_read_input_tokens": u.cached_tokens,
          "cache_creation_input_tokens": 0}

def _tool_block(c: ToolCall, streaming: bool = False) -> dict:
  return {"type": "tool_use", "id": "toolu_" + c.id.removeprefix("call_"), "name": c.name, "input": {} if streaming else c.arguments}

async def messages(request: Request):
  served: Served = request.app.state.served
  async with read_request(request, MessagesRequest) as req:  # a parsing slot, until the prompt is built
    served.check_model(req.model)
    if req.tool_choice and req.tool_choice.type not in ("auto", "none"):
      raise ApiError(400, "tool_choice: only 'auto' and 'none' are supported (a call cannot be forced)", "tool_choice")
    if req.thinking and req.thinking.type != "disabled": raise ApiError(400, "thinking: only type 'disabled' is supported", "thinking")
    tools = None
    if req.tools and not (req.tool_choice and req.tool_choice.type == "none"):
      tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema}}
               for t in req.tools]
    # thinking {"type": "disabled"} renders a reasoning template with its thinking off (False); absent, its default
    prompt = await run_in_threadpool(served.render, template_messages(req), tools, False if req.thinking else None)
    params = sampling(req.temperature, req.top_p, req.top_k, None, None, served.tok.vocab_size)
    c = Completion(served, prompt, req.max_tokens, params, [s for s in req.stop_sequences or [] if s], tools=bool(tools)).submit()
  mid = "msg_" + uuid.uuid4().hex[:24]
  if req.stream: return StreamingResponse(_stream(c, served, mid), media_type="text/event-stream", headers=SSE_HEADERS)
  async with cancel_on_disconnect(request, c.job): text, _, fin = await c.collect()
  content, calls, _ = finish_tools(text, fin)
  blocks = ([{"type": "text", "text": content}] if content or not calls else []) + [_tool_block(t) for t in calls]
  return JSON({"id": mid, "type": "message", "role": "assistant", "model": served.model_id, "content": blocks,
                       "stop_reason": _stop_reason(fin, calls), "stop_sequence": fin.stop_sequence, "usage": _usage(fin)})

async def _stream(c: Completion, served: Served, mid: str):
  ev_ = lambda kind, **data: sse({"type": kind, **data}, kind)
  index, open_text = 0, False
  try:
    async for ev in c.events():
      if isinstance(ev, Started):
        u = c.usage
        yield ev_("message_start", message={"id": mid, "type": "message", "role": "assistant", "model": served.model_id, "content": [],
                                            "stop_reason": None, "stop_sequence": None,
                                            "usage": {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": 0,
                                                      "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}})
      elif isinstance(ev, Piece) and ev.text:
        if not open_text: yield ev_("content_block_start", index=index, content_block={"type": "text", "text": ""}); open_text = True
        yield ev_("content_block_delta", index=index, delta={"type": "text_delta", "text": ev.text})
      elif isinstance(ev, Finish):
        content, calls, _ = finish_tools("", ev)
        if content or not (open_text or calls):  # text outside unparsed calls, or an empty answer: still one text block
          if not open_text: yield ev_("content_block_start", index=index, content_block={"type": "text", "text": ""}); open_text = True
          if content: yield ev_("content_block_delta", index=index, delta={"type": "text_delta", "text": content})
        if open_text: yield ev_("content_block_stop", index=index); index += 1
        for call in calls:
          yield ev_("content_block_start", index=index, content_block=_tool_block(call, streaming=True))
          yield ev_("content_block_delta", index=index, delta={"type": "input_json_delta", "partial_json": call.arguments_json})
          yield ev_("content_block_stop", index=index); index += 1
        yield ev_("message_delta", delta={"stop_reason": _stop_reason(ev, calls), "stop_sequence": ev.stop_sequence},
                  usage={"output_tokens": ev.usage.completion_tokens})
        yield ev_("message_stop")
  except ApiError as e: yield sse(e.body("anthropic"), "error")
  except Exception as e: yield sse(stream_failure(e).body("anthropic"), "error")
