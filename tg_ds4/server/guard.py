"""Requests refused before any route runs: those a web page could make a user's browser send (cross-site request forgery,
DNS rebinding) and those whose framing two parsers could read differently.

- Host: must name this server: the bound address, or a loopback name when bound to loopback; bound to every interface
  (0.0.0.0 / ::), any IP literal too. A DNS-rebinding page reaches us under its own domain name, so other names need
  `--allow-host NAME` (`*` for any). 403 otherwise.
- Origin (browsers send it on cross-origin requests, the API clients never do): the server's own origin, or one given
  with `--allow-origin` (which also answers CORS preflights for it). 403 otherwise.
- POST bodies must say `Content-Type: application/json`: a cross-site form or `fetch` without a CORS preflight can only
  send text/plain, form-urlencoded or multipart, so this alone keeps a page from driving the model. 415 otherwise.
- `Transfer-Encoding` together with `Content-Length` (a request-smuggling vector): 400."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from tg_ds4.server.errors import ApiError, api_of

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS = frozenset({"0.0.0.0", "::", ""})

def _ip(name: str) -> bool:
  try: ipaddress.ip_address(name); return True
  except ValueError: return False

def host_name(host: str) -> str:
  """'[::1]:8000' -> '::1', 'Example.COM:80' -> 'example.com' (the name a Host header or an origin's netloc carries)."""
  try: name = urlsplit("//" + host).hostname
  except ValueError: return ""
  return (name or "").rstrip(".").lower()

@dataclass(frozen=True)
class Allowed:
  bind: str                                  # the address the server listens on
  hosts: frozenset[str] = frozenset()        # more Host names accepted ("*": any)
  origins: frozenset[str] = frozenset()      # more origins accepted ("*": any)

  def host(self, name: str) -> bool:
    if not name: return False
    bind = self.bind.strip("[]").lower()
    if "*" in self.hosts or name in self.hosts or name == bind: return True
    if bind in WILDCARDS: return _ip(name) or name == "localhost"
    return name in LOOPBACK_NAMES and (bind in LOOPBACK_NAMES or bind.startswith("127."))

  def origin(self, origin: str, host_header: str, scheme: str) -> bool:
    if "*" in self.origins or origin in self.origins: return True
    return origin == f"{scheme}://{host_header}".lower()  # a page this server itself served (it serves none today)

def _media_type(value: str) -> str: return value.split(";", 1)[0].strip().lower()

class Guard:
  """ASGI middleware: checks the head of each HTTP request, answers refusals in the path's API error shape."""
  def __init__(self, app, allowed: Allowed):
    self.app, self.allowed = app, allowed

  def refusal(self, scope) -> ApiError | None:
    h: dict[bytes, list[bytes]] = {}
    for k, v in scope["headers"]: h.setdefault(k, []).append(v)
    get = lambda k: b",".join(h.get(k, [])).decode("latin-1")
    host = get(b"host")
    if not self.allowed.host(host_name(host)):
      return ApiError(403, f"Host {host!r} is not this server's name; start serve with --allow-host NAME to accept it")
    if (origin := get(b"origin")) and not self.allowed.origin(origin.lower(), host.lower(), scope.get("scheme", "http")):
      return ApiError(403, f"requests from origin {origin!r} are not allowed; start serve with --allow-origin {origin} to accept them")
    if b"transfer-encoding" in h and b"content-length" in h:
      return ApiError(400, "a request may not carry both Transfer-Encoding and Content-Length", headers={"Connection": "close"})
    if scope["method"] == "POST" and _media_type(get(b"content-type")) != "application/json":
      return ApiError(415, f"Content-Type must be application/json, got {get(b'content-type') or 'none'!r}", headers={"Connection": "close"})
    return None

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http" and (err := self.refusal(scope)) is not None:
      return await err.response(api_of(scope["path"]))(scope, receive, send)
    return await self.app(scope, receive, send)
