"""The OpenAI-compatible ASGI application: `build_app(llm, config)`.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET (and HEAD) /v1/models, /health,
/metrics. Errors of every kind (bad JSON, bad fields, unknown model or route, a wrong method (405 with
`Allow`), a body too large or too slow (`specmoe.serve.http.BodyGuard`), a full queue, a timeout, a
failed step) are answered in OpenAI's error body shape, and the server keeps serving. Parsing and
tokenizing a request run on a worker thread, so a large prompt does not hold up the event loop (the
other clients, /health); a prompt certainly too long for the context is refused on its character count
before it is tokenized.
"""
from __future__ import annotations

import asyncio
import hmac
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from specmoe.engine.core import Request
from specmoe.serve.chat import ChatTemplate
from specmoe.serve.config import ServeConfig, served_name
from specmoe.serve.engine import AsyncEngine, EngineUnavailable, QueueFull
from specmoe.serve.http import BodyGuard
from specmoe.serve.metrics import ServerMetrics
from specmoe.serve.protocol import OpenAIError, chat_request, completion_request, parse_json
from specmoe.serve.responses import DONE, ChoiceText, Responder, sse, usage

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks whether its client is still there


def build_app(llm, config: ServeConfig | None = None):
    """The ASGI application serving `llm` (a `specmoe.LLM`) with `config` (a `ServeConfig`; None: defaults).

    The app owns one `AsyncEngine` (an engine-loop thread holding the LLM for the app's lifetime). It starts
    in the app's lifespan startup (or at the first request, for hosts that skip lifespan events) and stops
    at lifespan shutdown, aborting what is in flight. The signature is the integration point for other
    hosts: run it with uvicorn (`specmoe serve`), or wrap it, e.g. in a Ray Serve deployment with
    `serve.ingress(build_app(llm, config))`. `app.state` holds `engine`, `metrics`, `llm` and `config`."""
    config = config or ServeConfig()
    served = served_name(llm, config)
    template = ChatTemplate.load(llm)
    metrics = ServerMetrics(llm)
    engine = AsyncEngine(llm, max_waiting=config.max_waiting, timeout_s=config.request_timeout_s, metrics=metrics)
    metrics.bind(engine)

    @asynccontextmanager
    async def lifespan(app):
        await run_in_threadpool(engine.start)
        yield
        await run_in_threadpool(engine.stop)

    app = FastAPI(title="specmoe", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.llm, app.state.config = engine, metrics, llm, config
    app.add_middleware(BodyGuard, max_body_bytes=config.max_body_bytes, body_timeout_s=config.body_timeout_s,
                       on_reject=metrics.rejected)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request, e: OpenAIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(OpenAIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                        code=code).body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _server_error(request, e: Exception):  # a bug: the body is still OpenAI's (uvicorn logs the trace)
        return JSONResponse(OpenAIError(500, f"internal error: {type(e).__name__}", type="server_error").body(),
                            status_code=500)

    def check_auth(request: HTTPRequest) -> None:
        if config.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {config.api_key}".encode()):
            raise OpenAIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                              type="authentication_error", code="invalid_api_key")

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        await run_in_threadpool(engine.start)  # no-op once started
        if not engine.alive:
            raise OpenAIError(503, engine.error or "the engine is not running", type="server_error")
        return {"status": "ok", "running": engine.running, "waiting": engine.waiting}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus():
        return Response(await run_in_threadpool(metrics.render), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: HTTPRequest):
        check_auth(request)
        return {"object": "list", "data": [{"id": served, "object": "model", "created": 0, "owned_by": "specmoe",
                                            "root": str(llm.path), "max_model_len": llm.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        check_auth(request)
        raw = await request.body()
        gen = await run_in_threadpool(lambda: completion_request(parse_json(raw), llm=llm, served=served,
                                                                 config=config))
        return await respond(request, gen)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        check_auth(request)
        raw = await request.body()
        gen = await run_in_threadpool(lambda: chat_request(parse_json(raw), llm=llm, served=served, config=config,
                                                           template=template))
        return await respond(request, gen)

    async def respond(request: HTTPRequest, gen):
        reqs = [Request(prompt_ids=ids, params=gen.choice_params(i, j), prompt=text, logprobs=gen.logprobs,
                        source_ids=gen.sources[i] if gen.sources is not None else None)
                for i, (text, ids) in enumerate(gen.prompts) for j in range(gen.n)]
        try:
            group = engine.submit(reqs)
        except QueueFull as e:
            metrics.rejected(429)
            raise OpenAIError(429, f"the server is busy: {e}; retry later", type="rate_limit_error",
                              code="queue_full", headers={"Retry-After": str(config.retry_after_s)}) from None
        except EngineUnavailable as e:
            metrics.rejected(503)
            raise OpenAIError(503, f"the engine is not available: {e}", type="server_error",
                              headers={"Retry-After": str(config.retry_after_s)}) from None
        responder = Responder(gen.kind, gen.model)
        choices = [ChoiceText(llm.decode) for _ in reqs]
        prompt_tokens = sum(len(ids) for _, ids in gen.prompts)
        logprobs = gen.logprobs is not None
        if gen.stream:
            return StreamingResponse(stream(group, responder, choices, prompt_tokens, logprobs, gen.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        done = asyncio.ensure_future(collect(group, choices))
        try:
            while not done.done():
                await asyncio.wait({done}, timeout=DISCONNECT_POLL_S)
                if not done.done() and await request.is_disconnected():
                    engine.abort(group)
            failure = done.result()
        finally:
            if not done.done():  # this handler was cancelled: the client is gone
                engine.abort(group)
        if failure is not None:
            raise failure
        return responder.full(choices, logprobs, prompt_tokens)

    async def collect(group, choices) -> OpenAIError | None:
        failure = None
        async for d in group.deltas():
            choices[d.index].advance(d)
            failure = failure or delta_error(d)
        return failure

    async def stream(group, responder, choices, prompt_tokens, logprobs, include_usage):
        complete = False
        try:
            if responder.kind == "chat":
                yield responder.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                        "finish_reason": None} for i in range(len(choices))], None, include_usage)
            failed = False
            async for d in group.deltas():
                c = choices[d.index]
                offset = len(c.sent)
                piece = c.advance(d)
                err = delta_error(d)
                if err is not None:
                    if not failed:
                        yield sse(err.body())
                    failed = True
                    continue
                if piece or d.finished or (logprobs and d.logprobs):
                    yield responder.chunk([responder.delta_choice(d.index, c, piece, d, logprobs, offset)], None,
                                          include_usage)
            if include_usage and not failed:
                yield responder.chunk([], usage(prompt_tokens, sum(len(c.ids) for c in choices)), True)
            yield DONE
            complete = True
        finally:
            if not complete:  # the client went away (or the response was cancelled): free the slots
                engine.abort(group)

    def delta_error(d) -> OpenAIError | None:
        if d.finish_reason != "abort":
            return None
        if d.abort_reason == "timeout":
            return OpenAIError(504, f"the request ran longer than request_timeout_s={config.request_timeout_s:g} s "
                                    "and was aborted", type="timeout_error", code="timeout")
        if d.abort_reason == "error":
            return OpenAIError(500, f"the engine failed while running this request: {d.error}",
                               type="server_error")
        return OpenAIError(503, f"the request was ended: {d.abort_reason}", type="server_error")

    return app
