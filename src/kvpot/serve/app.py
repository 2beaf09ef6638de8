"""The HTTP API: OpenAI's /v1/models, /v1/chat/completions, /v1/completions, plus kvpot's
/v1/documents, /health and /metrics (docs/serving.md).

Errors are OpenAI's error JSON with a status a client can act on (400 malformed, 401 key,
404 unknown, 413 too large, 429 busy with Retry-After); anything unexpected is a 500 with one
line, logged with its traceback on the server's side, and the server keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from kvpot.errors import Cancelled
from kvpot.serve.prompt import chat_prompt, completion_prompt
from kvpot.serve.protocol import ApiError, ChatRequest, CompletionRequest, DocumentRequest, parse
from kvpot.serve.service import Job, Outcome, Service

log = logging.getLogger("kvpot.serve")
_OPEN = ("/health",)  # reachable without the API key
_PROBES = ("/health", "/metrics")  # answered while shutting down; not counted as requests in flight
_LOOPBACK = ("localhost", "::1", "127.0.0.1")
_KEEPALIVE_SECONDS = 2.0


def create_app(engine, config) -> FastAPI:
    """The FastAPI app serving `engine` (its method is the default) with `config` (`ServeConfig`)."""
    service = Service(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await service.start()  # the method's slots are allocated before the first request
        yield
        await service.stop()

    app = FastAPI(title="kvpot", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.service = service

    app.add_middleware(_Guard, service=service)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return error_response(err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        message = {404: f"no route {request.method} {request.url.path}.",
                   405: f"{request.method} is not allowed on {request.url.path}."}.get(err.status_code, str(err.detail))
        return error_response(ApiError(err.status_code, message))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(_internal(err))

    # ---------------------------------------------------------------- plain routes
    @app.get("/health")
    async def health():
        used, slots = service.worker.slots()
        if service.worker.broken:  # the tensor-parallel ranks are gone: restart the server
            return JSONResponse({"status": "broken", "error": service.worker.broken}, status_code=503)
        if service.draining:  # a load balancer stops sending here
            return JSONResponse({"status": "draining", "running": service.worker.running}, status_code=503)
        return {"status": "ok", "model": service.model_name, "queue_depth": service.worker.waiting,
                "running": service.worker.running, "slots_used": used, "slots": slots,
                "pools": [pool.describe() for pool in list(service.worker.pools.values())]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(service.metrics.render(service.worker, service.store),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(service)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != service.model_name:
            raise ApiError(404, f"no model {name!r}; this server runs {service.model_name!r}.", code="model_not_found")
        return _model_card(service)

    # ---------------------------------------------------------------- documents
    @app.post("/v1/documents")
    async def create_document(request: Request):
        body = parse(await read_body(request, config), DocumentRequest)
        engine = service.engine_for(body.method)  # a bad method is a 400 before anything is queued
        service.check_chars(len(body.text))  # before tokenizing: its cost grows with the text
        ids, _ = await service.tokenize(engine.encode, body.text, None)
        service.check_length(len(ids))
        ticket = service.worker.admit_read()
        return await _until_done(request, service.read_document(ids, body.method, ticket), ticket)

    @app.get("/v1/documents")
    async def list_documents():
        return {"object": "list", "data": service.store.listing()}

    @app.get("/v1/documents/{document_id}")
    async def get_document(document_id: str):
        return _document(service, document_id).describe()

    @app.delete("/v1/documents/{document_id}")
    async def delete_document(document_id: str):
        entry = _document(service, document_id)
        await service.worker.command("delete", entry.key)  # on the generation thread: on every rank under --tp
        return {"id": entry.id, "object": "document", "deleted": True}

    # ---------------------------------------------------------------- completions
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = parse(await read_body(request, config), ChatRequest)
        job, engine = await _prepare(service, body, chat=True)
        return await _respond(request, service, body, job, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse(await read_body(request, config), CompletionRequest)
        job, engine = await _prepare(service, body, chat=False)
        return await _respond(request, service, body, job, chat=False)

    return app


# ---------------------------------------------------------------------------- helpers
class _Guard:
    """ASGI middleware: what is checked before a route runs, and request counts by route and status.

    - the API key (`Authorization: Bearer`, the scheme in any case, RFC 7235);
    - without a key, a `Host` naming a loopback address (or `--allowed-hosts`) and JSON bodies only: a web
      page can otherwise reach a local server (DNS rebinding, a cross-site form post);
    - the declared body size;
    - while shutting down, a 503 for every new request (`/health` says "draining").

    Plain ASGI rather than `@app.middleware`, so that streaming responses and the disconnect
    watch see the server's own `receive`.
    """

    def __init__(self, app, service: Service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        error = self.check(scope, headers)
        counted = scope["path"] not in _PROBES

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        if counted:
            self.service.inflight += 1
        try:
            if error is not None:
                await error_response(error)(scope, receive, sending)
            else:
                await self.app(scope, receive, sending)
        finally:
            if counted:
                self.service.inflight -= 1
            route = scope.get("route")
            self.service.metrics.request(scope.get("method", "?"), getattr(route, "path", "other"), status[0])

    def check(self, scope, headers: dict) -> ApiError | None:
        config, path = self.service.config, scope["path"]
        if config.api_key:
            if path not in _OPEN and not _bearer_matches(headers.get("authorization", ""), config.api_key):
                return ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'.",
                                code="invalid_api_key")
        elif path not in _OPEN:  # health checks come from load balancers under any name
            host = _host_name(headers.get("host", ""))
            if not (host in _LOOPBACK or host.startswith("127.") or host in config.allowed_hosts
                    or "*" in config.allowed_hosts):
                return ApiError(403, f"Host {host!r} is not served: without --api-key this server answers requests "
                                     "naming a loopback address only; name others with --allowed-hosts.",
                                code="host_not_allowed")
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if scope["method"] in ("POST", "PUT", "PATCH") and kind != "application/json":
                return ApiError(415, f"send the body as application/json (Content-Type was {kind or 'missing'!r}).",
                                code="unsupported_media_type")
        if self.service.draining and path not in _PROBES:
            return ApiError(503, "the server is shutting down; retry with another server or in a moment.",
                            code="shutting_down", headers={"Retry-After": "5"})
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > config.max_body_bytes:
            return ApiError(413, f"the body has {int(length):,} bytes; this server takes at most "
                                 f"{config.max_body_bytes:,} (--max-body-bytes).", code="body_too_large")
        return None


def _bearer_matches(given: str, key: str) -> bool:
    scheme, _, token = given.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def _host_name(host: str) -> str:
    """`Host` without its port, lower case (`[::1]:8000` -> `::1`)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _model_card(service: Service) -> dict:
    return {"id": service.model_name, "object": "model", "created": 0, "owned_by": "kvpot",
            "kvpot": {"method": service.default.method.config()}}


def _document(service: Service, document_id: str):
    key = document_id.removeprefix("doc-")
    entry = service.store.lookup(key) if document_id.startswith("doc-") else None
    if entry is None:
        raise ApiError(404, f"no document {document_id!r}.", param="document_id", code="document_not_found")
    return entry


def _internal(err: Exception) -> ApiError:
    """A 500 for an error nobody expected: its type only (its text may name the server's files); the log
    has the traceback."""
    return ApiError(500, f"internal error ({type(err).__name__}); the server's log has the details.")


async def read_body(request: Request, config) -> bytes:
    """The body, refused with 413 as soon as it passes the limit (chunked bodies included), and with 408 when
    it does not arrive within `--read-timeout` (a client that sends slowly holds a connection)."""
    chunks, size = [], 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > config.max_body_bytes:
                raise ApiError(413, f"the body is over {config.max_body_bytes:,} bytes (--max-body-bytes).",
                               code="body_too_large")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), config.read_timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the body did not arrive within {config.read_timeout:g} s (--read-timeout); "
                            f"{size:,} bytes came.", code="request_timeout") from None
    return b"".join(chunks)


async def _prepare(service: Service, body, chat: bool) -> tuple[Job, object]:
    """Validate a completion request and turn it into a `Job` (tokenizing off the event loop)."""
    if body.model != service.model_name:
        raise ApiError(404, f"no model {body.model!r}; this server runs {service.model_name!r} (GET /v1/models).",
                       param="model", code="model_not_found")
    body.check_supported()
    stops = body.stops()
    limit = body.limit(service.config.default_max_tokens)
    if limit > service.config.max_tokens_limit:
        raise ApiError(400, f"max_tokens is {limit}; this server generates at most {service.config.max_tokens_limit}.",
                       param="max_tokens")
    spec, entry = service.default_spec, None
    if body.document_id is not None:
        entry = _document(service, body.document_id)
        spec = entry.spec
    engine = service.engine_for(spec if spec != service.default_spec else None)
    if engine.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer; kvpot serve needs one.")
    document = entry is not None
    if chat:  # sizes first: tokenizing costs time and memory in proportion to the text
        service.check_chars(sum(len(m.text()) for m in body.messages))
        prompt = await service.tokenize(chat_prompt, engine, body.messages, document)
    else:
        value = body.prompt_value()
        if isinstance(value, list):
            service.check_length(len(value))
        else:
            service.check_chars(len(value))
        prompt = await service.tokenize(completion_prompt, engine, value, document)
    context_tokens = entry.context_tokens if document else len(prompt.context_ids)
    service.check_length(context_tokens + len(prompt.question_ids))
    key = entry.key if document else None
    if not document and len(prompt.context_ids) >= service.config.cache_min_tokens:
        key = service.key_for(engine, prompt.context_ids)
    job = Job(spec, prompt, limit, body.temperature, body.top_p, body.seed, stops, key, document, body.ignore_eos)
    return job, engine


async def _respond(request: Request, service: Service, body, job: Job, chat: bool):
    pool = await service.pool_for(job)
    ticket = service.worker.admit(pool)  # a 429 here, before any stream starts
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    if not body.stream:
        outcome = await _until_done(request, service.answer(job, ticket), ticket)
        choice = ({"index": 0, "message": {"role": "assistant", "content": outcome.text},
                   "finish_reason": outcome.finish_reason, "logprobs": None} if chat else
                  {"index": 0, "text": outcome.text, "finish_reason": outcome.finish_reason, "logprobs": None})
        return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": service.model_name, "choices": [choice], "usage": _usage(outcome),
                "kvpot": _extra(outcome, job)}
    queue: asyncio.Queue = asyncio.Queue()
    pending: list[str] = []  # text not yet sent; one ("text", None) in the queue stands for all of it

    def emit(piece: str) -> None:
        pending.append(piece)
        if len(pending) == 1:
            queue.put_nowait(("text", None))

    job.emit = emit

    async def run():
        try:
            queue.put_nowait(("done", await service.answer(job, ticket)))
        except Exception as err:  # noqa: BLE001 - handed to the stream, which reports it as an error event
            queue.put_nowait(("error", err))
        finally:
            ticket.release()

    task = asyncio.create_task(run())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, finish: str | None = None, role: bool = False) -> str:
        if chat:
            content = ({"role": "assistant", "content": ""} if role else {} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": content, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        return _sse({"id": ident, "object": kind, "created": created, "model": service.model_name,
                     "choices": [choice]})

    async def events():
        try:
            if chat:
                yield chunk(None, role=True)
            while True:
                try:
                    kind_, value = await asyncio.wait_for(queue.get(), _KEEPALIVE_SECONDS)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"  # a long prefill: keeps proxies (and disconnect detection) alive
                    continue
                if kind_ == "text":
                    value = "".join(pending)  # a stream that fell behind sends what came in one chunk
                    pending.clear()
                    yield chunk(value)
                elif kind_ == "error":
                    err = value if isinstance(value, ApiError) else (
                        ticket.cancelled_error() if isinstance(value, Cancelled) else _internal(value))
                    if err.status == 500 and not isinstance(value, ApiError):
                        log.error("internal error while streaming", exc_info=value)
                    yield _sse(err.body())
                    yield "data: [DONE]\n\n"  # OpenAI's streams end so, errors included
                    return
                else:
                    outcome: Outcome = value
                    yield chunk(None, finish=outcome.finish_reason)
                    if body.include_usage:
                        yield _sse({"id": ident, "object": kind, "created": created, "model": service.model_name,
                                    "choices": [], "usage": _usage(outcome)})
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not task.done():
                ticket.stop()  # the client left: its request ends at the next step and frees its slot

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _until_done(request: Request, work, ticket):
    """Await `work` (a coroutine); if the client disconnects meanwhile, stop it. Frees the ticket."""
    watcher = asyncio.create_task(_watch_disconnect(request, ticket))
    try:
        return await work
    except Cancelled:
        raise ticket.cancelled_error() from None
    finally:
        watcher.cancel()
        ticket.release()


async def _watch_disconnect(request: Request, ticket) -> None:
    """Wait for the client to go away (the body is read already, so the next message is that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            ticket.stop()
            return


def _usage(outcome: Outcome) -> dict:
    return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens}}


def _extra(outcome: Outcome, job: Job) -> dict:
    return {"document_id": f"doc-{job.key}" if job.key else None, "cached_tokens": outcome.cached_tokens,
            "time_to_first_token": outcome.ttft, "prefill_seconds": round(outcome.prefill_seconds, 4)}


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


__all__ = ["create_app", "error_response", "read_body"]
