"""JSON and server-sent events as they go on the wire. UTF-8 when possible, ASCII escapes when a string holds a lone
surrogate (JSON input may carry one, and so may arguments the model wrote as `\\ud800`): encoding never fails."""
from __future__ import annotations

import json

from starlette.responses import JSONResponse


def dumps(obj) -> bytes:
  try: return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
  except UnicodeEncodeError: return json.dumps(obj, separators=(",", ":")).encode()

class JSON(JSONResponse):
  def render(self, content) -> bytes: return dumps(content)

def sse(data: dict | str, event: str | None = None) -> bytes:
  body = data.encode() if isinstance(data, str) else dumps(data)
  return (f"event: {event}\n".encode() if event else b"") + b"data: " + body + b"\n\n"
