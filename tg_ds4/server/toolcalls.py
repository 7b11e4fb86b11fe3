"""Tool calls in model output parsed back into (name, arguments) for the template families we ship:
- qwen2.5 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, repeated;
- DeepSeek V3: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...`,
  and V3.1's `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`;
- GLM (4.5 .. 5, GLM-4.7-Flash): `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`, strings as
  they are and other values as JSON (the template's `tojson` for non-strings), so a value that reads as JSON is taken
  as that JSON (a string argument "42" comes back as 42: the markup cannot tell them apart without the tool's schema);
- DeepSeek DSML (V3.2 / V4): `<｜DSML｜function_calls><｜DSML｜invoke name="NAME"><｜DSML｜parameter name="P" string="true">v
  </｜DSML｜parameter>...</｜DSML｜invoke></｜DSML｜function_calls>`.
Output cut short (max_tokens) or slightly malformed is repaired when the repair is unambiguous (close open strings and
brackets, drop a trailing comma); a call that still cannot be read is reported in `errors` and its raw text is kept as
content, so a client always gets a well-formed answer."""
from __future__ import annotations

import json, re, uuid
from dataclasses import dataclass, field

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DSML = "｜DSML｜"
DSML_CALLS_BEGIN, DSML_CALLS_END = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
# a streamed answer is held back from the first of these on (DeepSeek V3 sometimes omits the outer begin marker)
START_MARKERS = [HERMES_OPEN, DS_CALLS_BEGIN, DS_CALL_BEGIN, DSML_CALLS_BEGIN, f"<{DSML}invoke"]

@dataclass
class ToolCall:
  name: str
  arguments: dict
  id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])
  repaired: bool = False  # the arguments were completed or fixed, not read verbatim

  @property
  def arguments_json(self) -> str: return json.dumps(self.arguments, ensure_ascii=False)

@dataclass
class Parsed:
  content: str                 # text outside the calls (unparseable calls stay in it, verbatim)
  calls: list[ToolCall]
  errors: list[str]            # one line per call that could not be read

def repair_json(text: str) -> tuple[object, bool]:
  """json.loads, else the same text with open strings/brackets closed and trailing commas dropped. Returns (value,
  repaired); raises ValueError when even that does not parse."""
  try: return json.loads(text), False
  except ValueError: pass
  out, stack, in_str, esc = [], [], False, False
  for ch in text.strip():
    out.append(ch)
    if in_str:
      if esc: esc = False
      elif ch == "\\": esc = True
      elif ch == '"': in_str = False
    elif ch == '"': in_str = True
    elif ch in "[{": stack.append("]" if ch == "[" else "}")
    elif ch in "]}":
      if not stack or stack[-1] != ch: raise ValueError(f"mismatched {ch!r}")
      stack.pop()
  s = "".join(out)
  if esc: s = s[:-1]
  if in_str: s += '"'
  s = re.sub(r"[,:\s]+$", "", s)  # a dangling comma or key separator
  if s.endswith('"') and stack and stack[-1] == "}" and re.search(r'[{,]\s*"(?:[^"\\]|\\.)*"$', s): s += ": null"  # a key without value
  s = re.sub(r",(\s*[\]}])", r"\1", s + "".join(reversed(stack)))
  return json.loads(s), True

def _args(text: str) -> tuple[dict, bool]:
  value, repaired = repair_json(text) if text.strip() else ({}, False)
  if not isinstance(value, dict): raise ValueError(f"arguments are a JSON {type(value).__name__}, not an object")
  return value, repaired

def _hermes(body: str, closed: bool) -> ToolCall:
  if not body.lstrip().startswith("{"): return _glm(body, closed)  # the same <tool_call> markers, GLM's XML-ish body
  obj, repaired = repair_json(body)
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]: raise ValueError("no function name")
  args = obj.get("arguments", obj.get("parameters", {}))
  if isinstance(args, str): args, rep2 = _args(args); repaired |= rep2  # some models double-encode the arguments
  if not isinstance(args, dict): raise ValueError("arguments are not a JSON object")
  return ToolCall(obj["name"], args, repaired=repaired or not closed)

def _deepseek(body: str, closed: bool) -> ToolCall:
  if DS_SEP not in body: raise ValueError("no <｜tool▁sep｜> in the call")
  head, rest = body.split(DS_SEP, 1)
  if head.strip() in ("function", ""):  # V3: type, then name on the first line, then a fenced JSON block
    name, _, rest = rest.partition("\n")
    rest = re.sub(r"^\s*```(?:json)?\s*", "", rest)
    rest = re.sub(r"\s*(```\s*)?$", "", rest)
  else: name = head  # V3.1: name, then the JSON itself
  if not (name := name.strip()): raise ValueError("no function name")
  args, repaired = _args(rest)
  return ToolCall(name, args, repaired=repaired or not closed)

_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.S)

def _glm(body: str, closed: bool) -> ToolCall:
  name, _, rest = body.partition("<arg_key>")
  if not re.fullmatch(r"[A-Za-z_][\w.\-]*", name := name.strip()): raise ValueError("no function name")
  args, repaired = {}, not closed
  for am in _GLM_ARG.finditer("<arg_key>" + rest if rest else ""):
    key, value = am.group(1).strip(), am.group(2)
    if not am.group(0).endswith("</arg_value>"): repaired = True
    try: args[key] = json.loads(value)
    except ValueError: args[key] = value
  return ToolCall(name, args, repaired=repaired)

_PARAM = re.compile(rf'<{DSML}parameter\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>(.*?)(?:</{DSML}parameter>|$)', re.S)

def _dsml(body: str, closed: bool) -> ToolCall:
  m = re.match(r'\s*name="([^"]*)"\s*>', body)
  if not m or not m.group(1).strip(): raise ValueError("no function name")
  args, repaired = {}, not closed
  for pm in _PARAM.finditer(body, m.end()):
    name, is_str, value = pm.group(1), pm.group(2), pm.group(3)
    if not pm.group(0).endswith(f"</{DSML}parameter>"): repaired = True
    if is_str == "true": args[name] = value
    else:
      try: args[name] = json.loads(value)
      except ValueError: args[name], repaired = value, True
  return ToolCall(m.group(1).strip(), args, repaired=repaired)

def _segments(text: str, open_: str, close: str) -> list[tuple[int, int, str, bool]]:
  """(start, end, body, closed) of every open_...close span; an unclosed last one runs to the end of the text."""
  out, i = [], 0
  while (s := text.find(open_, i)) >= 0:
    e = text.find(close, s + len(open_))
    closed = e >= 0
    nxt = text.find(open_, s + len(open_))
    if not closed or (0 <= nxt < e): e, closed = (nxt if nxt >= 0 else len(text)), False  # a call left open before the next
    out.append((s, e + (len(close) if closed else 0), text[s + len(open_):e], closed))
    i = out[-1][1]
  return out

def parse(text: str) -> Parsed:
  """Calls of every supported family found in `text` (families are told apart by their markers)."""
  spans: list[tuple[int, int, ToolCall | None, str]] = []
  families = ((HERMES_OPEN, HERMES_CLOSE, _hermes), (DS_CALL_BEGIN, DS_CALL_END, _deepseek), (f"<{DSML}invoke", f"</{DSML}invoke>", _dsml))
  for open_, close, fn in families:
    for s, e, body, closed in _segments(text, open_, close):
      try: spans.append((s, e, fn(body, closed), ""))
      except ValueError as err: spans.append((s, e, None, f"unreadable tool call {text[s:e][:80]!r}: {err}"))
  spans.sort(key=lambda x: x[0])
  content, calls, errors, i = [], [], [], 0
  for s, e, call, err in spans:
    if s < i: continue  # nested inside a span already taken
    content.append(text[i:s])
    if call is not None: calls.append(call)
    else: errors.append(err); content.append(text[s:e])
    i = e
  content.append(text[i:])
  rest = "".join(content)
  if calls:  # the wrappers around the calls are markup, not content
    for marker in (DS_CALLS_BEGIN, DS_CALLS_END, DSML_CALLS_BEGIN, DSML_CALLS_END): rest = rest.replace(marker, "")
  return Parsed(rest.strip() if calls else rest, calls, errors)

def template_tool_calls(tool_calls: list[dict], arguments_as_object: bool = True) -> list[dict]:
  """OpenAI-style tool calls of an assistant message as chat templates expect them. Most templates `tojson` the
  arguments (an object, as transformers documents); DeepSeek V3's concatenates them as a string: callers try both."""
  out = []
  for tc in tool_calls:
    fn = dict(tc.get("function") or {})
    args = fn.get("arguments")
    if arguments_as_object and isinstance(args, str):
      try: fn["arguments"] = json.loads(args)
      except ValueError: pass
    elif not arguments_as_object and not isinstance(args, str): fn["arguments"] = json.dumps(args, ensure_ascii=False)
    out.append({"id": tc.get("id"), "type": "function", "function": fn})
  return out
