"""Errors as each API shapes them: OpenAI `{"error": {message, type, param, code}}`, Anthropic `{"type": "error", "error":
{type, message}}`. Handlers raise ApiError; the app renders it for the API the path belongs to. A 500 says only that it
happened (and, for a generation, the job id the server log names): internal exception types and messages stay in the log."""
from __future__ import annotations

from tg_ds4.server.wire import JSON

_OPENAI_TYPE = {400: "invalid_request_error", 403: "permission_error", 404: "invalid_request_error", 408: "invalid_request_error",
                413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}
_ANTHROPIC_TYPE = {400: "invalid_request_error", 403: "permission_error", 404: "not_found_error", 408: "invalid_request_error",
                   413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}

class ApiError(Exception):
  def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}

  def body(self, api: str) -> dict:
    if api == "anthropic": return {"type": "error", "error": {"type": _ANTHROPIC_TYPE.get(self.status, "api_error"), "message": self.message}}
    kind = _OPENAI_TYPE.get(self.status, "invalid_request_error")
    return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

  def response(self, api: str) -> JSON: return JSON(self.body(api), self.status, headers=self.headers)

def api_of(path: str) -> str: return "anthropic" if path.startswith("/v1/messages") else "openai"
