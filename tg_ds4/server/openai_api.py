"""OpenAI-compatible endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models. Answers are JSON, or
SSE (`data: {chunk}` ... `data: [DONE]`) with stream=true."""
from __future__ import annotations

import functools, logging, time, uuid

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import StreamingResponse

from tg_ds4.runtime.runner import Step
from tg_ds4.server.body import read_request
from tg_ds4.server.completion import Completion, Finish, Piece, cancel_on_disconnect
from tg_ds4.server.errors import ApiError
from tg_ds4.server.schemas import ChatMessage, ChatRequest, CompletionRequest, Sampling
from tg_ds4.server.served import Served, sampling
from tg_ds4.server.toolcalls import ToolCall, parse
from tg_ds4.server.wire import JSON, sse

log = logging.getLogger("tg_ds4.server")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# what the server passes a chat template itself (tg_ds4.text.chat_template.Template.render)
TEMPLATE_VARIABLES = {"messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token"}

def _unsupported(req: Sampling) -> None:
  """Fields we accept but can only honour at their neutral value: anything else is a 400 naming the field."""
  if req.n not in (None, 1): raise ApiError(400, "n: only n=1 is supported", "n")
  for name in ("presence_penalty", "frequency_penalty"):
    if getattr(req, name): raise ApiError(400, f"{name}: only 0 is supported", name)
  if req.logit_bias: raise ApiError(400, "logit_bias: not supported", "logit_bias")

def _stops(stop: str | list[str] | None) -> list[str]: return [s for s in ([stop] if isinstance(stop, str) else stop or []) if s]

def _usage(fin: Finish) -> dict:
  u = fin.usage
  return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.prompt_tokens + u.completion_tokens,
          "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}

def _params(req: Sampling, served: Served):
  return sampling(req.temperature, req.top_p, req.top_k, req.min_p, req.seed, served.tok.vocab_size)

def _piece(served: Served, token: int) -> bytes: return served.tok.token_to_piece(token)

def _chat_logprobs(served: Served, steps: list[Step]) -> dict:
  def entry(t: int, lp: float) -> dict:
    b = _piece(served, t)
    return {"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b)}
  return {"content": [{**entry(s.token, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.top]} for s in steps]}

def _tool_calls_json(calls: list[ToolCall], streaming: bool = False) -> list[dict]:
  return [{**({"index": i} if streaming else {}), "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
          for i, c in enumerate(calls)]

def finish_tools(text: str, fin: Finish) -> tuple[str, list[ToolCall], str]:
  """Content, parsed tool calls and finish_reason once the answer is complete."""
  if fin.tool_text is None: return text, [], fin.reason
  p = parse(fin.tool_text)
  for e in p.errors: log.warning("%s", e)
  content = text + p.content if not p.calls else (text.rstrip() + ("\n" + p.content if p.content else "")).strip()
  return content, p.calls, "tool_calls" if p.calls and fin.reason == "stop" else fin.reason

# *** chat ***

def _message(m: ChatMessage) -> dict:
  """A request message as chat templates expect it (content a string, tool calls as dicts)."""
  text = "".join(p.text for p in m.content) if isinstance(m.content, list) else m.content or ""
  out = {"role": "system" if m.role == "developer" else m.role, "content": text}
  if m.name: out["name"] = m.name
  if m.tool_calls: out["tool_calls"] = [tc.model_dump() for tc in m.tool_calls]
  if m.tool_call_id: out["tool_call_id"] = m.tool_call_id
  return out

async def chat_completions(request: Request):
  served: Served = request.app.state.served
  async with read_request(request, ChatRequest) as req:  # a parsing slot, until the prompt is built
    served.check_model(req.model)
    _unsupported(req)
    if req.response_format and req.response_format.type != "text":
      raise ApiError(400, "response_format: only type 'text' is supported", "response_format")
    if req.tool_choice is not None and req.tool_choice not in ("auto", "none"):
      raise ApiError(400, "tool_choice: only 'auto' and 'none' are supported (a call cannot be forced)", "tool_choice")
    if req.top_logprobs is not None and not req.logprobs: raise ApiError(400, "top_logprobs: requires logprobs=true", "top_logprobs")
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none" else None
    kw = dict(req.chat_template_kwargs or {})
    flags = [kw.pop(n) for n in ("thinking", "enable_thinking") if n in kw]  # (a list: a value may be unhashable)
    if any(not isinstance(f, bool) for f in flags) or len(set(flags)) > 1:
      raise ApiError(400, "chat_template_kwargs: thinking / enable_thinking must be one boolean", "chat_template_kwargs")
    if taken := sorted(kw.keys() & TEMPLATE_VARIABLES):
      raise ApiError(400, f"chat_template_kwargs: {', '.join(taken)} cannot be set (the server sets them)", "chat_template_kwargs")
    # a long prompt must not stall the event loop
    prompt = await run_in_threadpool(functools.partial(served.render, [_message(m) for m in req.messages], tools, next(iter(flags), None), **kw))
    c = Completion(served, prompt, req.max_completion_tokens or req.max_tokens, _params(req, served), _stops(req.stop),
                   (req.top_logprobs or 0) if req.logprobs else None, tools=bool(tools)).submit()
  cid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
  if req.stream:
    usage = bool(req.stream_options and req.stream_options.include_usage)
    return StreamingResponse(_chat_stream(c, served, cid, created, bool(req.logprobs), usage), media_type="text/event-stream", headers=SSE_HEADERS)
  async with cancel_on_disconnect(request, c.job): text, steps, fin = await c.collect()
  content, calls, reason = finish_tools(text, fin)
  msg = {"role": "assistant", "content": content if content or not calls else None}
  if calls: msg["tool_calls"] = _tool_calls_json(calls)
  return JSON({"id": cid, "object": "chat.completion", "created": created, "model": served.model_id,
                       "choices": [{"index": 0, "message": msg, "logprobs": _chat_logprobs(served, steps) if req.logprobs else None,
                                    "finish_reason": reason}], "usage": _usage(fin)})

async def _chat_stream(c: Completion, served: Served, cid: str, created: int, logprobs: bool, include_usage: bool):
  base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": served.model_id}
  def chunk(delta: dict, finish: str | None = None, lp: dict | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
    return sse({**base, "choices": [choice], **({"usage": None} if include_usage else {})})
  try:
    yield chunk({"role": "assistant", "content": ""})
    text = []
    async for ev in c.events():
      if isinstance(ev, Piece) and (ev.text or (logprobs and ev.steps)):
        text.append(ev.text)
        yield chunk({"content": ev.text}, lp=_chat_logprobs(served, ev.steps) if logprobs else None)
      elif isinstance(ev, Finish):
        content, calls, reason = finish_tools("", ev)
        if content: yield chunk({"content": content})
        if calls: yield chunk({"tool_calls": _tool_calls_json(calls, streaming=True)})
        yield chunk({}, reason)
        if include_usage: yield sse({**base, "choices": [], "usage": _usage(ev)})
  except ApiError as e: yield sse(e.body("openai"))
  except Exception as e: yield sse(stream_failure(e).body("openai"))
  yield sse("[DONE]")

def stream_failure(e: Exception) -> ApiError:
  """Headers are out: an unexpected error can only be reported in the stream."""
  log.exception("error while streaming")
  return ApiError(500, "internal server error")

# *** legacy completions ***

def _prompt_ids(served: Served, prompt) -> list[int]:
  if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int): prompt = prompt[0]
  if isinstance(prompt, str): return served.encode(prompt, parse_special=False, param="prompt")
  if not prompt or not all(isinstance(t, int) for t in prompt): raise ApiError(400, "prompt: only one prompt per request is supported", "prompt")
  if bad := [t for t in prompt if not 0 <= t < served.tok.vocab_size]:
    raise ApiError(400, f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {served.tok.vocab_size})", "prompt")
  return served.check_prompt(list(prompt), "prompt")

def _completion_logprobs(served: Served, steps: list[Step]) -> dict:
  tokens, offsets, pos = [], [], 0
  for s in steps:
    t = _piece(served, s.token).decode("utf-8", "replace")
    tokens.append(t); offsets.append(pos); pos += len(t)
  return {"tokens": tokens, "token_logprobs": [s.logprob for s in steps], "text_offset": offsets,
          "top_logprobs": [{_piece(served, t).decode("utf-8", "replace"): lp for t, lp in s.top} for s in steps]}

async def completions(request: Request):
  served: Served = request.app.state.served
  async with read_request(request, CompletionRequest) as req:  # a parsing slot, until the prompt is built
    served.check_model(req.model)
    _unsupported(req)
    if req.echo: raise ApiError(400, "echo: not supported", "echo")
    if req.suffix: raise ApiError(400, "suffix: not supported", "suffix")
    if req.best_of not in (None, 1): raise ApiError(400, "best_of: only 1 is supported", "best_of")
    prompt = await run_in_threadpool(_prompt_ids, served, req.prompt)
    c = Completion(served, prompt, req.max_tokens, _params(req, served), _stops(req.stop), req.logprobs).submit()
  cid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())
  base = {"id": cid, "object": "text_completion", "created": created, "model": served.model_id}
  lp = req.logprobs is not None
  if req.stream:
    usage = bool(req.stream_options and req.stream_options.include_usage)
    async def stream():
      try:
        async for ev in c.events():
          if isinstance(ev, Piece) and (ev.text or (lp and ev.steps)):
            yield sse({**base, "choices": [{"index": 0, "text": ev.text, "logprobs": _completion_logprobs(served, ev.steps) if lp else None,
                                            "finish_reason": None}]})
          elif isinstance(ev, Finish):
            yield sse({**base, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": ev.reason}]})
            if usage: yield sse({**base, "choices": [], "usage": _usage(ev)})
      except ApiError as e: yield sse(e.body("openai"))
      except Exception as e: yield sse(stream_failure(e).body("openai"))
      yield sse("[DONE]")
    return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)
  async with cancel_on_disconnect(request, c.job): text, steps, fin = await c.collect()
  return JSON({**base, "choices": [{"index": 0, "text": text, "logprobs": _completion_logprobs(served, steps) if lp else None,
                                            "finish_reason": fin.reason}], "usage": _usage(fin)})

async def models(request: Request):
  """One listing both clients read: OpenAI's (object/owned_by) and Anthropic's (type/display_name/created_at) fields."""
  s: Served = request.app.state.served
  m = {"id": s.model_id, "object": "model", "type": "model", "created": s.created, "owned_by": "tg_ds4", "display_name": s.model_id,
       "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(s.created))}
  return JSON({"object": "list", "data": [m], "has_more": False, "first_id": s.model_id, "last_id": s.model_id})
