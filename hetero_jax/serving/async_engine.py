"""The in-process `EngineClient`: many coroutines, one engine, one stepper task.

`engine.generate(prompt, params, request_id=None)` returns a `client.GenerateStream`; its
first iteration (or `await`) validates the request in the caller's coroutine (a bad one
raises `RequestError` there and nowhere else) and hands it to the stepper task, and then it
yields a `GenerateDelta` for every step that gave the request a token, the last one finished.
`await engine.embed(x, params)` -> `EmbeddingOutput`. The stepper queues new requests and
aborts between steps, runs each `Engine.step()` in a worker thread (so the event loop stays
free for retrieval, HTTP and other work), and turns the step's `StepOutput` into deltas from
the host-side requests (no extra device read). Leaving a stream early, cancelling a
coroutine or `abort(request_id)` aborts its request and frees its pages. A request the engine
fails alone raises `RequestFailed` in its own coroutine; an error that belongs to no request
fails every pending one; nothing is left waiting. `close()` fails every pending request and
frees what it held. An AsyncEngine serves one event loop (another loop gets a RuntimeError),
and `Engine.run` refuses to run while its requests are in flight.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import time

from hetero_jax.outputs import RequestError, RequestFailed
from hetero_jax.requests import EmbedRequest, GenerateRequest, PoolingParams, SamplingParams
from hetero_jax.serving.client import FrontStats, GenerateStream, StepTimes
from hetero_jax.serving.engine import Engine
from hetero_jax.serving.output_processor import delta, final_delta


class _Flow:
    """One request in flight: where its outputs go and how much of it was sent."""

    def __init__(self, request_id, field: str):
        self.request_id = request_id  # the caller's id (the engine's, when it named none)
        self.field = field  # "prompt" or "input": how its errors name it
        self.queue: asyncio.Queue = asyncio.Queue()  # outputs; None: raise `error`
        self.error: Exception | None = None
        self.num_sent, self.text = 0, ""

    def fail(self, error: Exception) -> None:
        self.error = error
        self.queue.put_nowait(None)


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._pending: list = []  # prepared Request handles to enqueue before the next step
        self._aborts: list = []  # engine request ids to abort before the next step
        self._flows: dict = {}  # engine request id -> _Flow, until it is resolved
        self._ids: dict = {}  # the caller's request id -> the engine's
        self._steps = StepTimes()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "hetero-jax-step")
        self._closed = False

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def stats(self) -> FrontStats:
        waiting, running = self.engine.load()
        for req in list(self._pending):
            waiting[req.kind] = waiting.get(req.kind, 0) + 1
        return FrontStats(self.engine.stats, waiting, running, self._steps)

    def generate(self, prompt, params: SamplingParams | None = None,
                 request_id=None) -> GenerateStream:
        request = GenerateRequest(prompt, params or SamplingParams())
        return GenerateStream(self._deltas(request, request_id))

    async def embed(self, x, params: PoolingParams | None = None, request_id=None):
        """-> EmbeddingOutput (its `embedding` `[d]`, its `prompt_token_ids`)."""
        flow = self._submit(EmbedRequest(x, params or PoolingParams()), request_id, "input")
        try:
            return await self._next(flow)
        finally:
            self._forget(flow)

    def abort(self, request_id) -> None:
        """End a request by the caller's id (unknown or finished ids are ignored); its
        coroutine raises RequestFailed."""
        rid = self._ids.get(request_id)
        flow = self._flows.get(rid)
        if flow is not None:
            self._forget(flow)
            flow.fail(RequestFailed(request_id, f"request {request_id!r} was aborted"))

    async def _deltas(self, request, request_id):
        flow = self._submit(request, request_id, "prompt")
        try:
            while True:
                out = await self._next(flow)
                yield out
                if out.finished:
                    return
        finally:
            self._forget(flow)

    @staticmethod
    async def _next(flow: _Flow):
        out = await flow.queue.get()
        if out is None:
            raise flow.error
        return out

    def _submit(self, request, request_id, field: str) -> _Flow:
        self._bind(asyncio.get_running_loop())
        if request_id is not None and request_id in self._ids:
            raise RequestError(0, "request_id", f"request_id={request_id!r} is in flight")
        try:
            (req,) = self.engine.prepare([request])  # raises here, in the caller
        except TypeError as e:
            raise RequestError(0, "params", str(e)) from e
        except ValueError as e:
            raise RequestError(0, field, str(e)) from e
        rid = req.request_id if request_id is None else request_id
        flow = self._flows[req.request_id] = _Flow(rid, field)
        self._ids[rid] = req.request_id
        self._pending.append(req)
        self._ensure_stepper()
        return flow

    def _forget(self, flow: _Flow) -> None:
        """The caller is done with `flow`: a request still in flight is aborted."""
        rid = self._ids.pop(flow.request_id, None)
        if self._flows.pop(rid, None) is not None:
            self._aborts.append(rid)
            self._wake.set()

    def _bind(self, loop) -> None:
        if self._closed:
            raise RuntimeError("this AsyncEngine is closed; make a new one")
        if self._loop is not None and self._loop is not loop:
            if not self._loop.is_closed() or self._flows:
                raise RuntimeError(f"this AsyncEngine serves event loop {id(self._loop):#x} and "
                                   f"was called from loop {id(loop):#x}; make one AsyncEngine "
                                   "per event loop")
            self._task = None  # the old loop is gone, and its stepper with it
        self._loop = loop

    def _ensure_stepper(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = self._loop.create_task(self._stepper())
        self._wake.set()

    async def _stepper(self) -> None:
        while True:
            try:
                self._apply_queued()
                if not self.engine.has_work():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                start = time.perf_counter()
                result = await self._loop.run_in_executor(self._thread, self.engine.step)
                self._steps.observe(time.perf_counter() - start)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # belongs to no single request: fail them all, keep serving
                failure = RequestFailed(None, str(e))
                failure.__cause__ = e
                self._fail_all(failure)
                continue
            self._publish(result)

    def _apply_queued(self) -> None:
        for rid in self._aborts:
            self.engine.abort(rid)
        self._aborts.clear()
        pending, self._pending = self._pending, []
        for req in pending:
            try:
                self.engine.enqueue([req])
            except ValueError as e:  # the scheduler's own limits: this request alone
                flow = self._flows.pop(req.request_id, None)
                if flow is not None:
                    self._ids.pop(flow.request_id, None)
                    flow.fail(RequestError(0, flow.field, str(e)))

    def _publish(self, result) -> None:
        """A step's `StepOutput` -> each flow's delta, or its final output."""
        for req in result.progressed:
            flow = self._flows.get(req.request_id)
            if flow is None:
                continue
            try:
                d = delta(req, flow.num_sent, flow.text, self.engine.tokenizer, flow.request_id)
            except Exception as e:  # noqa: BLE001 - this request's data: fail it alone
                self._forget(flow)
                flow.fail(RequestFailed(flow.request_id, f"request {req.request_id}: "
                                                         f"{type(e).__name__}: {e}"))
                continue
            flow.num_sent, flow.text = flow.num_sent + len(d.token_ids), flow.text + d.text
            flow.queue.put_nowait(d)
        for req in result.finished:
            flow = self._flows.pop(req.request_id, None)
            if flow is None:
                continue
            self._ids.pop(flow.request_id, None)
            out = self.engine.output(req)  # never raises: a broken one comes back as an error
            if out.finish_reason == "error":
                flow.fail(RequestFailed(flow.request_id, out.error))
            elif req.is_embed:
                flow.queue.put_nowait(out)
            else:
                flow.queue.put_nowait(final_delta(out, flow.num_sent, flow.text, flow.request_id))

    def _fail_all(self, error: Exception) -> None:
        """Every request in flight fails with `error`; the engine forgets them."""
        self._pending.clear()
        self._aborts.clear()
        flows, self._flows = self._flows, {}
        self._ids.clear()
        for rid, flow in flows.items():
            self.engine.abort(rid)
            flow.fail(error)

    async def close(self) -> None:
        """Stop the stepper; every request still in flight raises RequestFailed in its
        coroutine and is aborted in the engine (its pages and slots freed)."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._thread.shutdown(wait=True)  # a step still running in the thread ends first
        self._apply_queued()
        self._fail_all(RequestFailed(None, "the AsyncEngine was closed before this request "
                                           "finished"))
