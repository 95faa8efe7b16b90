"""The one `EngineClient` implementation: many coroutines, one core that serves them from
its own thread(s).

In: `generate` / `embed` / `abort` from the coroutines of one event loop. A `Core` is what
serves the requests: `submit(request, request_id) -> (core id, caller id)` checks and hands a
request over in the caller's coroutine (a bad one raises there, turned into `RequestError`
by `client.admitted`), `abort(core id)`, `stats()`, `stop()`, and `open(deliver)`, through
which its thread hands back `(core id, kind, value)` events: `"out"` a `GenerateDelta` of a
request that goes on, `"end"` the last delta of a generation or an `EmbeddingOutput`,
`"error"` the `RequestError` / `RequestFailed` that ends a request. The front hands each
list of events to the event loop in one `call_soon_threadsafe`, so the core never waits for
a loop busy with HTTP or retrieval, and routes them to the request's queue.

Cores: `async_engine.EngineCore` (one `Engine` in this process, stepped by a
`stepper.Stepper`: a delta per step), `async_replicas.ReplicaCore` (a `ReplicaSet`: a
delta per step, sent by its workers; a `RayReplicaSet`: one delta, the finished one) and
`async_replicas.DedicatedCore` (a `DedicatedEngine`: one batch per worker at a time). The
first two keep their requests in a `Flights`, which turns each (tag, `RequestResult`) that
comes back into its event, so both stream alike. Leaving a stream early, cancelling a
coroutine or `abort(request_id)` aborts its request; `close()` stops the core and fails every
request still in flight with `RequestFailed`. A front serves one event loop (another loop
gets a RuntimeError while the first is open or requests are in flight).
"""
from __future__ import annotations

import asyncio
import dataclasses

from hetero_jax.outputs import EmbeddingOutput, RequestFailed
from hetero_jax.requests import EmbedRequest, GenerateRequest, PoolingParams, SamplingParams
from hetero_jax.serving.client import FrontStats, GenerateStream, admitted
from hetero_jax.serving.output_processor import final_delta, merge_deltas


class Flights:
    """A core's requests in flight by their tag: each one's kind ("embed", "generate"), the
    caller's id and what of it went out. `event` turns what a drive or a replica set hands
    back about a request, a (tag, `RequestResult`), into its event for the front; a finished
    generation's last delta holds what its output has beyond the ids and text streamed."""

    def __init__(self):
        self._by_tag: dict = {}  # tag -> [kind, the caller's id, ids sent, text sent]

    def __len__(self) -> int:
        return len(self._by_tag)

    def add(self, tag, kind: str, request_id) -> None:
        self._by_tag[tag] = [kind, request_id, 0, ""]

    def pop(self, tag) -> None:
        self._by_tag.pop(tag, None)

    def tags(self) -> list:
        return list(self._by_tag)

    def kinds(self) -> dict:
        """kind -> requests in flight."""
        out: dict = {}
        for kind, *_ in list(self._by_tag.values()):
            out[kind] = out.get(kind, 0) + 1
        return out

    def event(self, tag, result):
        """(tag, RequestResult) -> its event, or None for a request no longer in flight."""
        flight = self._by_tag.get(tag) if result.delta is not None else \
            self._by_tag.pop(tag, None)
        if flight is None:
            return None
        kind, rid, num_sent, sent = flight
        if result.delta is not None:  # a step of a stream that goes on
            flight[2:] = num_sent + len(result.delta.token_ids), sent + result.delta.text
            return tag, "out", dataclasses.replace(result.delta, request_id=rid)
        if result.error is not None:  # the checks refused it
            return tag, "error", result.error
        return finished_event(tag, kind, rid, result.output, num_sent, sent)


def finished_event(cid, kind: str, rid, out, num_sent: int = 0, sent: str = "") -> tuple:
    """The event of a finished request: its output (a generation's as its final delta,
    beyond the `num_sent` ids and text `sent` already streamed), or RequestFailed when the
    engine failed it."""
    if out.finish_reason == "error":
        return cid, "error", RequestFailed(rid, out.error)
    return cid, "end", out if kind == "embed" else final_delta(out, num_sent, sent, rid)


def failed_events(tags, error: Exception) -> list:
    """The events of the requests `tags` when an error that belongs to none of them (a step
    that raised) ended them all: one RequestFailed, caused by `error`."""
    failure = RequestFailed(None, str(error))
    failure.__cause__ = error
    return [(tag, "error", failure) for tag in tags]


class _Flow:
    """One request in flight: where its events go."""

    def __init__(self, request_id):
        self.request_id = request_id  # the caller's id (the core's, when it named none)
        self.queue: asyncio.Queue = asyncio.Queue()  # outputs; None: raise `error`
        self.error: Exception | None = None

    def fail(self, error: Exception) -> None:
        self.error = error
        self.queue.put_nowait(None)


class Front:
    def __init__(self, core):
        self.core = core
        core.open(self._from_thread)
        self._flows: dict = {}  # core id -> _Flow, until it is resolved
        self._ids: dict = {}  # the caller's request id -> the core's
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def stats(self) -> FrontStats:
        return self.core.stats()

    def generate(self, prompt, params: SamplingParams | None = None,
                 request_id=None) -> GenerateStream:
        request = GenerateRequest(prompt, params or SamplingParams())
        return GenerateStream(self._deltas(request, request_id))

    async def embed(self, x, params: PoolingParams | None = None,
                    request_id=None) -> EmbeddingOutput:
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
        cid, rid = admitted(lambda: self.core.submit(request, request_id), field, request_id,
                            self._ids)
        flow = self._flows[cid] = _Flow(rid)
        self._ids[rid] = cid
        return flow

    def _forget(self, flow: _Flow) -> None:
        """The caller is done with `flow`: a request still in flight is aborted."""
        cid = self._ids.pop(flow.request_id, None)
        if self._flows.pop(cid, None) is not None:
            self.core.abort(cid)

    def _bind(self, loop) -> None:
        name = type(self).__name__
        if self._closed:
            raise RuntimeError(f"this {name} is closed; make a new one")
        if self._loop is not None and self._loop is not loop:
            if not self._loop.is_closed() or self._flows:
                raise RuntimeError(f"this {name} serves event loop {id(self._loop):#x} and was "
                                   f"called from loop {id(loop):#x}; make one {name} per "
                                   "event loop")
        self._loop = loop

    def _from_thread(self, events: list) -> None:
        """The core's events, handed to the event loop (dropped if it is gone)."""
        try:
            self._loop.call_soon_threadsafe(self._deliver, events)
        except RuntimeError:  # the loop closed: nobody waits for these any more
            pass

    def _deliver(self, events: list) -> None:
        for cid, kind, value in events:
            flow = self._flows.get(cid)
            if flow is None:
                continue
            if kind == "out":
                flow.queue.put_nowait(value)
                continue
            del self._flows[cid]
            self._ids.pop(flow.request_id, None)
            if kind == "end":
                flow.queue.put_nowait(value)
            else:
                flow.fail(value)

    async def close(self) -> None:
        """Stop the core; every request still in flight raises RequestFailed in its
        coroutine and is aborted (its pages and slots freed)."""
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(None, self.core.stop)
        flows, self._flows = self._flows, {}
        self._ids.clear()
        for flow in flows.values():
            flow.fail(RequestFailed(flow.request_id, f"the {type(self).__name__} was closed "
                                                     "before this request finished"))
