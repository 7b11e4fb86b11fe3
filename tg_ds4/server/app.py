"""The ASGI app (Starlette, served by uvicorn) and `serve`: load the model, start the inference worker, listen.

Starlette rather than FastAPI: we need the raw body (size and depth limits before parsing) and errors in two different
API shapes with 400 (not FastAPI's 422 validation layer, which would have to be overridden everywhere); pydantic does the
field validation and the OpenAPI schema. uvicorn: the standard ASGI server, pure-Python install (h11)."""
from __future__ import annotations

import logging, pathlib, socket, time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.routing import Route

from tg_ds4.io.hf_folder import open_model
from tg_ds4.io.registry import registry, resolve
from tg_ds4.models.families import default_context
from tg_ds4.quant import activations, settings
from tg_ds4.runtime.runner import Runner
from tg_ds4.runtime.speculative import DraftModel, MTPDraft, mtp_source
from tg_ds4.server import anthropic_api, openai_api
from tg_ds4.server.body import BodyLimits, BodySlots
from tg_ds4.server.connections import BACKLOG, RateLimited, connection_cap, limited_protocol
from tg_ds4.server.errors import ApiError, api_of
from tg_ds4.server.guard import Allowed, Guard
from tg_ds4.server.kvstore import KVStore, model_fingerprint
from tg_ds4.server.schemas import openapi
from tg_ds4.server.served import Served
from tg_ds4.server.wire import JSON
from tg_ds4.server.worker import Worker
from tg_ds4.text.chat_template import Template
from tg_ds4.text.tokenizer import Tokenizer

log = logging.getLogger("tg_ds4.server")

def _guarded(fn):
  """Every endpoint answers in its API's error shape, and no exception escapes to take a connection (or more) down."""
  async def run(request: Request):
    try: return await fn(request)
    except ApiError as e: return e.response(api_of(request.url.path))
    except ClientDisconnect: return ApiError(400, "client disconnected").response(api_of(request.url.path))  # nobody reads it
    except Exception:
      log.exception("unexpected error in %s %s", request.method, request.url.path)
      return ApiError(500, "internal server error").response(api_of(request.url.path))
  return run

async def health(request: Request):
  s: Served = request.app.state.served
  st = s.worker.status()
  status = "ok" if st["ready"] else "warming up" if "warming_up" in st else "loading"
  return JSON({"status": status, "model": s.model_id, "context": s.max_ctx, **st}, 200 if st["ready"] else 503)

async def model_info(request: Request):
  s: Served = request.app.state.served
  s.check_model(request.path_params["model"])
  return JSON({"id": s.model_id, "object": "model", "type": "model", "created": s.created, "owned_by": "tg_ds4", "display_name": s.model_id})

async def openapi_json(request: Request): return JSON(request.app.state.openapi)

async def _http_error(request: Request, exc: HTTPException):
  return ApiError(exc.status_code, exc.detail or "error").response(api_of(request.url.path))

def build_app(served: Served, body: BodyLimits = BodyLimits(), allowed: Allowed = Allowed("127.0.0.1")) -> Starlette:
  routes = [Route("/v1/chat/completions", _guarded(openai_api.chat_completions), methods=["POST"]),
            Route("/v1/completions", _guarded(openai_api.completions), methods=["POST"]),
            Route("/v1/messages", _guarded(anthropic_api.messages), methods=["POST"]),
            Route("/v1/models", _guarded(openai_api.models), methods=["GET"]),
            Route("/v1/models/{model:path}", _guarded(model_info), methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/openapi.json", openapi_json, methods=["GET"])]
  cors = [Middleware(CORSMiddleware, allow_origins=sorted(allowed.origins), allow_methods=["GET", "POST"], allow_headers=["*"])]
  app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error},
                  middleware=[Middleware(Guard, allowed=allowed)] + (cors if allowed.origins else []))
  app.state.served, app.state.body_limits, app.state.body_slots = served, body, BodySlots(body)
  app.state.openapi = openapi(f"tg_ds4 serving {served.model_id}", "1")
  return app

def parse_size(text: str) -> int:
  """'2G', '512M', '100k' or plain bytes."""
  t = text.strip().upper().removesuffix("B")
  mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
  return int(float(t[:-1] if mult > 1 else t) * mult)

def served_model_id(model: str, path: pathlib.Path) -> str:
  """The id a model is served under by default: its short name when `-m` gave one, else the file's stem (a checkpoint
  folder's name): a clean token a client can be configured with, unlike general.name's free text."""
  return model if model in registry() else (path.stem if path.is_file() else path.name)

def load(model: str, max_context: int | None, kv_cache_dir: str | None = None, kv_cache_size: int = 2 << 30, kv_cache_min_tokens: int = 256,
         max_queue: int = 64, warmup: bool = True, quantize: str | None = None, parallel: int = 1,
         numerics: str = settings.DEFAULT_NUMERICS, served_name: str | None = None, strict_model_name: bool = False,
         draft: str | None = None, speculative: int = 0) -> Served:
  """Tokenizer and template here; model and KV store on the worker's thread (see Worker), with `parallel` cache slots
  (requests generated together). Returns once the model is loaded (a bad file raises here); the warm-up compile runs
  on while the server already answers /health. The model is served as `served_name` (default served_model_id). With
  `speculative` = k, greedy requests without logprobs decode speculatively (runtime/speculative.py) when they run
  alone, drafted by `draft` or, without one, by the file's multi-token-prediction block."""
  path = pathlib.Path(resolve(model))
  gf = open_model(path, quantize)
  tok, t0 = Tokenizer.from_gguf(gf), time.perf_counter()
  dgf = open_model(resolve(draft), quantize) if speculative and draft else None
  mtp = bool(speculative) and mtp_source(dgf)  # a multi-token-prediction block drafts (cli checked that it can)
  def load_runner():
    runner = Runner.load(gf, max_ctx=max_context or default_context(gf), parallel=parallel, numerics=numerics, mtp=mtp)
    if not kv_cache_dir: return runner, None
    fp = model_fingerprint(path, runner.cache_layout(), gf.identity() if hasattr(gf, "identity") else None,
                           activations.effective(numerics, runner.device))
    return runner, KVStore(kv_cache_dir, fp, kv_cache_size, kv_cache_min_tokens)
  def load_draft(runner: Runner):
    if mtp: return MTPDraft(runner)
    return DraftModel(Runner.load(dgf, max_ctx=max_context or default_context(gf), numerics=numerics))
  worker = Worker(load_runner, max_queue, warmup=warmup, draft=load_draft if speculative else None,
                  speculative=speculative).start().wait_loaded()
  model_id, max_ctx = served_name or served_model_id(model, path), worker.runner.model.max_ctx
  log.info("loaded %s (%s) in %.1fs; context %d, %d slot%s; serving it as %r%s", gf.get("general.name") or path.stem, path.name,
           time.perf_counter() - t0, max_ctx, parallel, "s" if parallel > 1 else "", model_id,
           "" if strict_model_name else " (requests naming any other model get it too)")
  aliases = frozenset({model, path.name, path.stem} | ({str(gf.get("general.name"))} if gf.get("general.name") else set()))
  return Served(model_id, aliases, tok, Template.from_gguf(gf), max_ctx, worker, strict=strict_model_name)

class BindError(OSError):
  """The address `serve` was told to listen on cannot be had (its message names it and why)."""

def bind(host: str, port: int) -> socket.socket:
  """A socket bound to host:port (not yet listening: connections are refused until the server runs), taken before
  the model loads so that a bad address or a port in use ends `serve` at once. The same options as uvicorn's own bind
  (SO_REUSEADDR; IPv6 for an address with a colon)."""
  if not 0 <= port <= 65535: raise BindError(f"--port {port}: a TCP port is 0..65535")
  sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
  try:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
  except OSError as e:
    sock.close()
    raise BindError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
  return sock

def run(app: Starlette, host: str, port: int, head_timeout: float = 10.0, max_connections: int = 256, sock: socket.socket | None = None) -> None:
  """uvicorn with the connection limits (`connections`), on `sock` when given (else it binds host:port itself); returns
  when the server is stopped."""
  import uvicorn
  logging.getLogger("asyncio").addFilter(RateLimited())  # should accept() still fail, one line per 10 s, not one per try
  http = limited_protocol(head_timeout, connection_cap(max_connections))
  uvicorn.Server(uvicorn.Config(app, host=host, port=port, http=http, backlog=BACKLOG, log_level="info", access_log=False,
                                timeout_graceful_shutdown=3)).run(sockets=[sock] if sock is not None else None)

def serve(args, sock: socket.socket | None = None) -> int:
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  served = load(args.model, args.max_context, args.kv_cache_dir, parse_size(args.kv_cache_size), args.kv_cache_min_tokens, args.max_queue,
                quantize=args.quantize, parallel=args.parallel, numerics=args.numerics, served_name=args.served_model_name,
                strict_model_name=args.strict_model_name, draft=args.draft, speculative=args.speculative)
  body = BodyLimits(args.max_body_bytes, args.max_json_depth, args.body_timeout, args.max_parsing)
  app = build_app(served, body, Allowed(args.host, frozenset(h.lower() for h in args.allow_host), frozenset(o.lower() for o in args.allow_origin)))
  run(app, args.host, args.port, args.head_timeout, args.max_connections, sock)
  if served.worker.kvstore: served.worker.kvstore.flush(10)
  return 0
