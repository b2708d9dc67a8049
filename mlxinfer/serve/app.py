"""The HTTP side: Starlette routes speaking OpenAI's API over the engine (``scheduler.Engine``).

POST /v1/chat/completions, POST /v1/completions (JSON or SSE streams), GET /v1/models, GET /health, GET /metrics.
Every error is OpenAI's JSON shape with its status code. The API key (when set) is required on every route but
/health.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import schemas as s
from .guard import BODY_TIMEOUT
from .metrics import Metrics
from .scheduler import Engine
from .sequence import Ticket, token_text


@dataclass
class ServeOptions:
    api_key: str | None = None
    max_body: int = 1 << 20
    parallel: int = 8
    queue_size: int = 32
    timeout: float | None = 600.0
    prefix_cache_bytes: int = 512 << 20
    prefill_chunk: int = 256
    batch_from: int = 2
    allow_origins: list[str] = field(default_factory=list)  # CORS: web pages that may call the API from a browser
    bind_host: str | None = None  # the --host value: on a loopback address without a key, Host must be this machine
    flags: dict[str, Any] = field(default_factory=dict)  # sampling values from the command line (highest rank)
    engine_class: type = Engine  # under mlx.launch: distributed.serve.LeaderEngine (broadcasts its decisions)
    on_warning: Callable[[str], None] | None = None  # the engine's one-line warnings (the CLI prints them)


class Api:
    def __init__(self, loaded, opts: ServeOptions):
        self.loaded, self.opts = loaded, opts
        self.metrics = Metrics()
        self.engine = opts.engine_class(loaded, self.metrics, parallel=opts.parallel, queue_size=opts.queue_size,
                                            prefix_cache_bytes=opts.prefix_cache_bytes,
                                            prefill_chunk=opts.prefill_chunk, timeout=opts.timeout,
                                            batch_from=opts.batch_from, on_warning=opts.on_warning)
        spec = loaded.spec
        self.model_id = loaded.name
        self.names = {n for n in (loaded.name, spec.name, spec.alias, spec.repo) if n}
        self.created = int(time.time())

    # ---- plumbing -----------------------------------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        key = self.opts.api_key
        if not key:
            return
        given = request.headers.get("authorization", "")
        token = given[7:].strip() if given[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise s.ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key")

    async def _body(self, request: Request) -> bytes:
        limit = self.opts.max_body
        too_big = s.ApiError(413, f"the request body is larger than {limit} bytes (the server's --max-body)",
                             code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), BODY_TIMEOUT)
        except asyncio.TimeoutError:
            raise s.ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT:g} s",
                             code="request_timeout") from None
        except ClientDisconnect:
            raise s.ApiError(499, "the client closed the connection while sending the request") from None
        return b"".join(chunks)

    def _error(self, route: str, e: s.ApiError) -> JSONResponse:
        self.metrics.requests.labels(route, str(e.status)).inc()
        headers = {"Retry-After": "1"} if e.status in (429, 503) else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    # ---- simple routes ------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.model_id, **self.engine.snapshot()})

    def _model_object(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "mlxinfer",
                "context_length": self.loaded.context_length}

    async def models(self, request: Request) -> Response:
        try:
            self._auth(request)
            name = request.path_params.get("model")
            if name is None:
                self.metrics.requests.labels("/v1/models", "200").inc()
                return JSONResponse({"object": "list", "data": [self._model_object()]})
            if name not in self.names:
                raise s.ApiError(404, f"the model '{name[:100]}' does not exist here; this server runs "
                                 f"'{self.model_id}'", param="model", code="model_not_found")
            self.metrics.requests.labels("/v1/models", "200").inc()
            return JSONResponse(self._model_object())
        except s.ApiError as e:
            return self._error("/v1/models", e)

    async def metrics_route(self, request: Request) -> Response:
        try:
            self._auth(request)
        except s.ApiError as e:
            return self._error("/metrics", e)
        self.metrics.requests.labels("/metrics", "200").inc()  # counted before rendering: the reply includes it
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    # ---- generation ---------------------------------------------------------------------------------------
    def _job(self, data: dict, kind: str) -> s.Job:
        """Validate and tokenize (runs in a worker thread: templates and tokenizers take a while on long input)."""
        from ..engine.prompts import chat_prompt, encode_prompt
        from ..engine.settings import bad_token, vocab_size
        from ..errors import MlxinferError

        loaded = self.loaded
        if kind == "chat":
            messages = s.chat_messages(data)
        else:
            prompt = s.completion_prompt(data)
        model = data.get("model")
        if model and model not in self.names:
            raise s.ApiError(404, f"the model '{model}' does not exist here; this server runs '{self.model_id}' "
                             "(GET /v1/models)", param="model", code="model_not_found")
        params = s.resolve_params(data, loaded, self.opts.flags, loaded.spec.defaults)
        stop = s._stop(data)
        logprobs = s.logprobs_setting(data, kind)
        stream, include_usage = s.stream_settings(data)
        try:
            if kind == "chat":
                system = loaded.spec.defaults.get("system")
                if system and not any(m["role"] == "system" for m in messages):
                    messages = [{"role": "system", "content": system}] + messages
                tokens = chat_prompt(loaded, messages)
            elif isinstance(prompt, str):
                tokens = encode_prompt(loaded, prompt)
            else:
                tokens = prompt
                vocab = vocab_size(loaded)
                bad = bad_token(tokens, vocab)  # (schemas checked they are ints; negative or too large here)
                if bad is not None:
                    raise s.bad(f"token id {bad} is outside the vocabulary (size {vocab})", param="prompt")
        except (MlxinferError, ValueError, TypeError) as e:
            raise s.bad(f"cannot build the prompt: {e}", param="messages" if kind == "chat" else "prompt") from None
        if not tokens:
            raise s.bad("the prompt is empty", param="prompt")
        budget = s.max_tokens(data, kind, len(tokens), loaded.context_length, params.max_tokens)
        cap = self.opts.flags.get("max_tokens", -1)
        budget = min(budget, cap) if cap > 0 else budget  # the server's --max-tokens caps every request
        return s.Job(kind, tokens, params, budget, stop, logprobs, stream, include_usage)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat", "/v1/chat/completions")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion", "/v1/completions")

    async def _generate(self, request: Request, kind: str, route: str) -> Response:
        try:
            self._auth(request)
            data = s.parse_json(await self._body(request))
            job = await run_in_threadpool(self._job, data, kind)
            ticket = Ticket(job, asyncio.get_running_loop(), asyncio.Queue())
            self.engine.submit(ticket)
        except s.ApiError as e:
            return self._error(route, e)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        fmt = Formatter(kind, rid, self.model_id, job)
        if job.stream:
            return StreamingResponse(self._stream(ticket, fmt, route), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._collect(request, ticket, fmt, route)

    async def _events(self, ticket: Ticket) -> AsyncIterator[tuple]:
        while True:
            event = await ticket.queue.get()
            yield event
            if event[0] != "text":
                return

    async def _collect(self, request: Request, ticket: Ticket, fmt: "Formatter", route: str) -> Response:
        async def watch() -> None:
            # The body has been read: the next message is the client hanging up (uvicorn keeps reading for it).
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.engine.cancel(ticket)
            ticket.push(("gone",))

        watcher = asyncio.create_task(watch())
        pieces, entries = [], []
        try:
            while True:
                event = await ticket.queue.get()
                if event[0] == "gone":
                    self.metrics.requests.labels(route, "499").inc()
                    return Response(status_code=499)
                if event[0] == "text":
                    pieces.append(event[1])
                    entries += event[2]
                elif event[0] == "error":
                    return self._error(route, event[1])
                else:
                    self.metrics.requests.labels(route, "200").inc()
                    return JSONResponse(fmt.whole("".join(pieces), entries, event[1], event[2]))
        except asyncio.CancelledError:
            self.engine.cancel(ticket)
            raise
        finally:
            watcher.cancel()

    async def _stream(self, ticket: Ticket, fmt: "Formatter", route: str) -> AsyncIterator[str]:
        status = "499"  # until the stream ends on its own, the client went away
        try:
            if fmt.kind == "chat":
                yield _sse(fmt.chunk({"role": "assistant", "content": ""}, None))
            async for event in self._events(ticket):
                if event[0] == "text":
                    if event[1] or event[2]:
                        yield _sse(fmt.piece(event[1], event[2]))
                elif event[0] == "error":
                    status = str(event[1].status)
                    yield _sse(event[1].body())
                    return
                else:
                    yield _sse(fmt.last(event[1], event[2]))
                    if fmt.job.include_usage:
                        yield _sse(fmt.usage_chunk(event[2]))
                    yield "data: [DONE]\n\n"
                    status = "200"
        finally:
            if status == "499":
                self.engine.cancel(ticket)
            self.metrics.requests.labels(route, status).inc()


ROUTES = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions")


def route_label(path: str) -> str:
    """The metrics label for a path: one of ROUTES, else "other" (a label per unknown path would let any client
    grow the metrics without bound)."""
    if path.startswith("/v1/models/"):
        return "/v1/models"
    return path if path in ROUTES else "other"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Formatter:
    """OpenAI's response objects for one request (chat.completion / text_completion, whole or as chunks)."""

    def __init__(self, kind: str, rid: str, model: str, job: s.Job):
        self.kind, self.rid, self.model, self.job = kind, rid, model, job
        self.created = int(time.time())
        self.reply_bytes = b""  # the tokens' bytes so far: text_offset for completion logprobs

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    @staticmethod
    def usage(u: dict) -> dict:
        return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                "total_tokens": u["total_tokens"], "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}

    def logprobs(self, entries: list[dict], text: str = "") -> dict | None:
        if self.job.logprobs is None:
            return None
        if self.kind == "chat":
            item = lambda raw, lp: {"token": token_text(raw), "logprob": lp, "bytes": list(raw)}  # noqa: E731
            return {"content": [{**item(e["bytes"], e["logprob"]),
                                 "top_logprobs": [item(t, v) for _, t, v in e["top"]]} for e in entries]}
        offsets = []
        for e in entries:  # characters of the text before each token (a partial character counts once whole)
            offsets.append(len(self.reply_bytes.decode("utf-8", "ignore")))
            self.reply_bytes += e["bytes"]
        return {"tokens": [token_text(e["bytes"]) for e in entries],
                "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{token_text(t): v for _, t, v in e["top"]} for e in entries], "text_offset": offsets}

    def whole(self, text: str, entries: list[dict], finish: str, usage: dict) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": self.logprobs(entries), "finish_reason": finish}
            return {**self._head("chat.completion"), "choices": [choice], "usage": self.usage(usage)}
        choice = {"index": 0, "text": text, "logprobs": self.logprobs(entries), "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice], "usage": self.usage(usage)}

    def chunk(self, delta: dict, finish: str | None, entries: list[dict] | None = None) -> dict:
        lp = self.logprobs(entries) if entries else None
        if self.kind == "chat":
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": delta.get("content", ""), "logprobs": lp, "finish_reason": finish}
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.job.include_usage:
            out["usage"] = None
        return out

    def piece(self, text: str, entries: list[dict]) -> dict:
        return self.chunk({"content": text}, None, entries)

    def last(self, finish: str, _usage: dict) -> dict:
        return self.chunk({}, finish)

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage(usage)}


def create_app(loaded, opts: ServeOptions) -> Starlette:
    api = Api(loaded, opts)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        api.engine.start()
        try:
            yield
        finally:
            api.engine.stop()

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = f"{request.method} {request.url.path[:200]}: {exc.detail}"
        if request.url.path != "/health":
            api.metrics.requests.labels(route_label(request.url.path), str(exc.status_code)).inc()
        return JSONResponse(s.ApiError(exc.status_code, msg, code=code).body(), status_code=exc.status_code,
                            headers=exc.headers)

    async def server_error(request: Request, exc: Exception) -> Response:
        # A bug: OpenAI's shape and a count here; Starlette re-raises it afterwards, so uvicorn logs the traceback.
        api.metrics.requests.labels(route_label(request.url.path), "500").inc()
        err = s.ApiError(500, f"internal error: {type(exc).__name__} (the server's log has the details)",
                         code="internal_error")
        return JSONResponse(err.body(), status_code=500)

    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics_route, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.models, methods=["GET"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
    ]
    from starlette.middleware import Middleware

    from .guard import BrowserGuard, is_loopback_name

    def refused(path: str, status: int) -> None:
        api.metrics.requests.labels(route_label(path), str(status)).inc()

    check_host = opts.bind_host is not None and is_loopback_name(opts.bind_host) and not opts.api_key
    middleware = [Middleware(BrowserGuard, allow_origins=opts.allow_origins, bind_host=opts.bind_host,
                             check_host=check_host, refused=refused)]
    if opts.allow_origins:
        from starlette.middleware.cors import CORSMiddleware

        middleware.append(Middleware(CORSMiddleware, allow_origins=opts.allow_origins, allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type"]))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.api = api
    return app
