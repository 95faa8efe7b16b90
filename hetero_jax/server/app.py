"""The OpenAI-compatible HTTP routes, on FastAPI, over one `serving.client.EngineClient`.

In: HTTP requests on the event loop uvicorn runs. Every route reaches the engine only through
the client it was built with (`build_app(client, ServerConfig(...))`). A request goes through
`_serve`, the one gate: the bearer key (401), the body size (413), the JSON body against its
`protocol` model (400), the model name (404), the queue bound (503 with Retry-After), then its
handler. Any failure, there or in the handler, becomes its status and OpenAI error body in
`errors.as_api_error`, the one place that maps them. A streamed answer is server-sent events
(`data: {chunk}` ... `data: [DONE]`, chunks from `render.Render`, sent by `sse.SseResponse`,
the last event and `[DONE]` in one write); its first piece is awaited before the status is
sent, so a request the engine refuses still gets its 400. A client that disconnects aborts
its requests: a stream's task is cancelled by its `sse.Watch` and closes its choices, and a
plain request waits on its connection's disconnect message while it runs
(`_unless_disconnected`).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import uuid

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from hetero_jax.outputs import RequestError
from hetero_jax.requests import sample_seed
from hetero_jax.server import openai_format as fmt
from hetero_jax.server.chat import DEFAULT_TEMPLATE, ChatTemplate, special_tokens
from hetero_jax.server.errors import ApiError, as_api_error, error_body
from hetero_jax.server.generation import choice_pieces, merged
from hetero_jax.server.metrics import Counters, prometheus_text
from hetero_jax.server.protocol import ChatRequest, CompletionRequest, EmbeddingRequest
from hetero_jax.server.render import Render, sse_event
from hetero_jax.server.sse import SseResponse, Watch

@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model: str  # the name clients pass as `model`
    api_key: str | None = None  # None: no key needed
    max_queued: int = 1024  # waiting requests beyond which new ones get 503
    max_body_bytes: int = 4 << 20  # larger bodies get 413
    chat_template: str = DEFAULT_TEMPLATE
    retry_after_s: int = 1  # the Retry-After of a 503


@dataclasses.dataclass
class _State:
    client: object  # the EngineClient
    config: ServerConfig
    chat: ChatTemplate
    counters: Counters


def build_app(client, config: ServerConfig) -> FastAPI:
    """The server's routes over `client` (an EngineClient); uvicorn runs the returned app."""
    app = FastAPI(title="hetero-jax", docs_url=None, redoc_url=None, openapi_url=None)
    state = _State(client, config, ChatTemplate(config.chat_template,
                                                 **special_tokens(client.tokenizer)), Counters())
    app.state.server = state

    @app.exception_handler(HTTPException)
    async def no_route(request: Request, exc: HTTPException):  # unknown path or method
        error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        state.counters.count(request.url.path, error.status)
        return JSONResponse(error_body(error), error.status)

    def gated(model_cls, handler):
        async def endpoint(request: Request):
            return await _serve(state, request, model_cls, handler)
        return endpoint

    for path, method, model_cls, handler in _routes():
        app.router.add_route(path, gated(model_cls, handler), methods=[method])

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(state.client.stats, state.counters),
                                 media_type="text/plain; version=0.0.4")

    return app




async def _serve(state: _State, request: Request, model_cls, handler) -> Response:
    """The one gate of every /v1 route; see the module docstring."""
    route = request.url.path
    try:
        _check_key(state.config, request)
        req = None
        if model_cls is not None:
            req = model_cls.model_validate_json(await _body(request, state.config))
            if req.model != state.config.model:
                raise ApiError(404, f"model {req.model!r} does not exist; this server serves "
                                    f"{state.config.model!r}", "model", "model_not_found")
            _check_queue(state)
        response = await handler(state, request, req)
    except Exception as e:  # noqa: BLE001 - every failure is answered, in one place
        error = as_api_error(e)
        state.counters.count(route, error.status)
        return JSONResponse(error_body(error), error.status, headers=error.headers)
    state.counters.count(route, response.status_code)
    return response


def _check_key(config: ServerConfig, request: Request) -> None:
    if config.api_key is None:
        return
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.encode(),
                                                             config.api_key.encode()):
        raise ApiError(401, "a valid API key is needed: send 'Authorization: Bearer KEY'",
                       None, "invalid_api_key")


async def _body(request: Request, config: ServerConfig) -> bytes:
    limit = config.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body has {declared} bytes; the limit is {limit}",
                       None, "request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body exceeds the limit of {limit} bytes", None,
                           "request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _check_queue(state: _State) -> None:
    waiting = sum(state.client.stats.waiting.values())
    if waiting >= state.config.max_queued:
        raise ApiError(503, f"{waiting} requests are waiting, the bound is "
                            f"{state.config.max_queued}; retry later", None, "queue_full",
                       {"Retry-After": str(state.config.retry_after_s)})


async def _models(state: _State, request: Request, req) -> Response:
    card = {"id": state.config.model, "object": "model", "created": 0, "owned_by": "hetero-jax",
            "max_model_len": state.client.max_model_len}
    return JSONResponse({"object": "list", "data": [card]})


# -- the /v1 routes: (path, method, body model or None, handler) -----------------------------
def _routes() -> list:
    return [("/v1/completions", "POST", CompletionRequest, _completion),
            ("/v1/chat/completions", "POST", ChatRequest, _chat),
            ("/v1/embeddings", "POST", EmbeddingRequest, _embeddings),
            ("/v1/models", "GET", None, _models)]


# -- completions and chat --------------------------------------------------------------------
async def _completion(state: _State, request: Request, req: CompletionRequest) -> Response:
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError(400, f"best_of={req.best_of} must equal n={req.n} (no ranking here)",
                       "best_of", "unsupported")
    prompts = fmt.inputs_of(req.prompt, "prompt")
    max_tokens = req.max_tokens or fmt.COMPLETION_MAX_TOKENS
    choices = [(p, fmt.sampling_params(req, max_tokens, req.logprobs, sample_seed(req.seed, j)))
               for p in prompts for j in range(req.n)]
    return await _generate(state, request, req, "text_completion", f"cmpl-{_uid()}", choices)


async def _chat(state: _State, request: Request, req: ChatRequest) -> Response:
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs", "invalid_value")
    tokenizer = state.client.tokenizer
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer; chat needs one", "messages")
    messages = [{"role": m.role, "content": m.content if isinstance(m.content, str) else
                 "".join(part.text for part in m.content)} for m in req.messages]
    prompt = state.chat.render(messages, req.add_generation_prompt)
    max_tokens = req.max_completion_tokens or req.max_tokens or max(
        state.client.max_model_len - len(tokenizer.encode(prompt)), 1)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    choices = [(prompt, fmt.sampling_params(req, max_tokens, logprobs,
                                            sample_seed(req.seed, j))) for j in range(req.n)]
    return await _generate(state, request, req, "chat.completion", f"chatcmpl-{_uid()}",
                           choices)


def _uid() -> str:
    return uuid.uuid4().hex


async def _generate(state, request, req, kind: str, rid: str, choices: list) -> Response:
    """Run every choice; a whole body, or (`stream`) server-sent events of chunks."""
    streams = [choice_pieces(state.client, prompt, params, f"{rid}-{i}")
               for i, (prompt, params) in enumerate(choices)]
    pieces = merged(streams)
    try:
        first = await _unless_disconnected(state, request, anext(pieces, None))
    except BaseException:
        await pieces.aclose()
        raise
    render = Render(state.client.tokenizer, state.config.model, req, kind, rid, len(choices))
    if req.stream:
        return SseResponse(_events(state, render, first, pieces))
    return JSONResponse(await _unless_disconnected(state, request,
                                                   render.whole(first, pieces)))


async def _unless_disconnected(state: _State, request: Request, awaitable):
    """`awaitable`'s result, awaited in this task (no task of its own: fewer loop hops before
    the first chunk); if the client goes away first, this task is cancelled and `awaitable`
    with it (its requests aborted)."""
    watch = Watch(request.receive)
    try:
        return await awaitable
    except asyncio.CancelledError:
        if watch.fired:
            state.counters.disconnects += 1
        raise
    finally:
        watch.close()


async def _events(state: _State, render, first, pieces):
    """The SSE body as `(bytes, more to come)`; leaving early (the client went away) closes
    every choice. Once every choice has finished, its chunk waits for the end of `pieces`
    (at once for one choice) and goes out with the usage chunk and `[DONE]`, as the last."""
    finished, held = False, b""
    try:
        item = first
        while item is not None:
            event = render.event(*item)
            if render.all_finished():
                held += event
            else:
                yield event, True
            item = await anext(pieces, None)
        if render.include_usage:
            held += sse_event(render.usage_chunk())
        finished = True
        yield held + b"data: [DONE]\n\n", False
    except Exception as e:  # noqa: BLE001 - after the 200: the error goes in the stream
        finished = True
        yield held + sse_event(error_body(as_api_error(e))), False
    finally:
        if not finished:
            state.counters.disconnects += 1
        await pieces.aclose()


# -- embeddings ------------------------------------------------------------------------------
async def _embeddings(state: _State, request: Request, req: EmbeddingRequest) -> Response:
    inputs = fmt.inputs_of(req.input, "input")
    params = fmt.pooling_params(req)
    rid = f"embd-{_uid()}"

    async def one(i: int, x):
        try:
            return await state.client.embed(x, params, request_id=f"{rid}-{i}")
        except RequestError as e:
            raise RequestError(i, e.field, f"input {i}: {e.reason}") from e

    outs = await _unless_disconnected(state, request, _all([one(i, x)
                                                            for i, x in enumerate(inputs)]))
    dim = len(outs[0].embedding)
    if req.dimensions is not None and req.dimensions != dim:
        raise ApiError(400, f"dimensions={req.dimensions}: this model's embeddings have {dim}",
                       "dimensions", "invalid_value")
    return JSONResponse(fmt.embedding_body(outs, state.config.model, req.encoding_format))


async def _all(coros: list) -> list:
    """Every result in order; the first failure cancels the rest (their requests aborted)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
