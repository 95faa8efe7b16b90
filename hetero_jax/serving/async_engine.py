"""The in-process `EngineClient`: many coroutines, one engine, one stepping thread.

`engine.generate(prompt, params, request_id=None)` returns a `client.GenerateStream`; its
first iteration (or `await`) validates the request in the caller's coroutine (a bad one
raises `RequestError` there and nowhere else) and hands it to the `stepper.Stepper` thread,
and then it yields a `GenerateDelta` for every step that gave the request a token, the last
one finished (deltas that queued up while the caller was busy come joined, as one).
`await engine.embed(x, params)` -> `EmbeddingOutput`. The stepper thread queues
new requests and aborts between steps, steps, and builds each step's deltas from the
host-side requests (no extra device read); it hands them to the event loop in one
`call_soon_threadsafe` per step, so stepping never waits for a loop busy with HTTP or
retrieval. Leaving a stream early, cancelling a coroutine or `abort(request_id)` aborts its
request and frees its pages. A request the engine fails alone raises `RequestFailed` in its
own coroutine; an error that belongs to no request fails every one in flight; nothing is left
waiting. `close()` fails every pending request and frees what it held. An AsyncEngine serves
one event loop (another loop gets a RuntimeError), and `Engine.run` refuses to run while its
requests are in flight.
"""
from __future__ import annotations

import asyncio

from hetero_jax.outputs import RequestFailed
from hetero_jax.requests import EmbedRequest, GenerateRequest, PoolingParams, SamplingParams
from hetero_jax.serving.client import FrontStats, GenerateStream, StepTimes, admitted
from hetero_jax.serving.engine import Engine
from hetero_jax.serving.output_processor import merge_deltas
from hetero_jax.serving.stepper import Stepper


class _Flow:
    """One request in flight: where its outputs go."""

    def __init__(self, request_id):
        self.request_id = request_id  # the caller's id (the engine's, when it named none)
        self.queue: asyncio.Queue = asyncio.Queue()  # outputs; None: raise `error`
        self.error: Exception | None = None

    def fail(self, error: Exception) -> None:
        self.error = error
        self.queue.put_nowait(None)


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._flows: dict = {}  # engine request id -> _Flow, until it is resolved
        self._ids: dict = {}  # the caller's request id -> the engine's
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stepper: Stepper | None = None  # started by the first request
        self._closed = False

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def stats(self) -> FrontStats:
        waiting, running = self.engine.queue_counts()
        if self._stepper is None:
            return FrontStats(self.engine.stats, waiting, running, StepTimes())
        for kind, n in self._stepper.num_queued().items():
            waiting[kind] = waiting.get(kind, 0) + n
        return FrontStats(self.engine.stats, waiting, running, self._stepper.steps)

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
        flow = self._flows.get(self._ids.get(request_id))
        if flow is not None:
            self._forget(flow)
            flow.fail(RequestFailed(request_id, f"request {request_id!r} was aborted"))

    async def _deltas(self, request, request_id):
        flow = self._submit(request, request_id, "prompt")
        try:
            while True:
                out = await self._next(flow)
                while not out.finished and flow.error is None and not flow.queue.empty():
                    out = merge_deltas(out, flow.queue.get_nowait())  # the caller fell behind
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
        (req,) = admitted(lambda: self.engine.prepare([request]), field, request_id, self._ids)
        rid = req.request_id if request_id is None else request_id
        flow = self._flows[req.request_id] = _Flow(rid)
        self._ids[rid] = req.request_id
        if self._stepper is None:
            self._stepper = Stepper(self.engine, self._from_thread)
        self._stepper.add(req, rid)
        return flow

    def _forget(self, flow: _Flow) -> None:
        """The caller is done with `flow`: a request still in flight is aborted."""
        rid = self._ids.pop(flow.request_id, None)
        if self._flows.pop(rid, None) is not None:
            self._stepper.abort(rid)

    def _bind(self, loop) -> None:
        if self._closed:
            raise RuntimeError("this AsyncEngine is closed; make a new one")
        if self._loop is not None and self._loop is not loop:
            if not self._loop.is_closed() or self._flows:
                raise RuntimeError(f"this AsyncEngine serves event loop {id(self._loop):#x} and "
                                   f"was called from loop {id(loop):#x}; make one AsyncEngine "
                                   "per event loop")
        self._loop = loop

    def _from_thread(self, events: list) -> None:
        """The stepper's events, handed to the event loop (dropped if it is gone)."""
        try:
            self._loop.call_soon_threadsafe(self._deliver, events)
        except RuntimeError:  # the loop closed: nobody waits for these any more
            pass

    def _deliver(self, events: list) -> None:
        for rid, kind, value in events:
            flow = self._flows.get(rid)
            if flow is None:
                continue
            if kind == "out":
                flow.queue.put_nowait(value)
                continue
            del self._flows[rid]
            self._ids.pop(flow.request_id, None)
            if kind == "end":
                flow.queue.put_nowait(value)
            else:
                flow.fail(value)

    async def close(self) -> None:
        """Stop the stepper; every request still in flight raises RequestFailed in its
        coroutine and is aborted in the engine (its pages and slots freed)."""
        self._closed = True
        if self._stepper is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._stepper.stop)
        flows, self._flows = self._flows, {}
        self._ids.clear()
        for flow in flows.values():
            flow.fail(RequestFailed(flow.request_id, "the AsyncEngine was closed before this "
                                                     "request finished"))
