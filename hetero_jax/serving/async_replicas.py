"""The `EngineClient` over a `ReplicaSet` (or `RayReplicaSet`): N engines, one collector.

`generate(prompt, params)` / `await embed(x, params)` check, tokenize and route in the
caller's coroutine (a request of the wrong type, or whose input cannot be tokenized, raises
`RequestError` there), then the request is on its replica. One collector task waits in a
worker thread for the set's finished requests (`ReplicaSet.collect`) and resolves their
futures on the event loop: an output, or the `RequestError` with which the replica's checks
refused the request, or `RequestFailed` for one that failed running or whose replica died (the
others go on). A replica reports a request when it finishes, so a generation's stream has one
delta, the finished one. Cancelling a coroutine, leaving a stream or `abort(request_id)`
aborts its request on its replica. `stats` sums the replicas' counters; its `waiting` counts
the requests in flight by kind (the replicas do not report their queues). `close()` fails and
aborts every request still in flight; the replica processes stay up (close the set for that).
One event loop per front, as `AsyncEngine`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures

from hetero_jax.outputs import EmbeddingOutput, RequestFailed
from hetero_jax.requests import EmbedRequest, GenerateRequest, PoolingParams, SamplingParams
from hetero_jax.serving.client import (FrontStats, GenerateStream, StepTimes, admitted,
                                       finished_only, succeeded)
from hetero_jax.serving.replicas import ReplicaSet

POLL_S = 0.2  # how long one collect waits, so a closed front's thread ends soon
KINDS = {GenerateRequest: "generate", EmbedRequest: "embed"}
FIELDS = {"generate": "prompt", "embed": "input"}  # how errors name a kind's input


class AsyncReplicas:
    def __init__(self, replicas: ReplicaSet):
        self.replicas = replicas
        self._futures: dict = {}  # tag -> asyncio.Future, until resolved
        self._kinds: dict = {}  # tag -> "generate" | "embed", until resolved
        self._tags: dict = {}  # the caller's request id -> tag, until resolved
        self._ids: dict = {}  # tag -> the caller's request id, until resolved
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "hetero-jax-collect")
        self._closed = False

    @property
    def tokenizer(self):
        return self.replicas.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.replicas.max_model_len

    @property
    def stats(self) -> FrontStats:
        waiting = {}
        for kind in list(self._kinds.values()):
            waiting[kind] = waiting.get(kind, 0) + 1
        return FrontStats(self.replicas.stats, waiting, {}, StepTimes())

    def generate(self, prompt, params: SamplingParams | None = None,
                 request_id=None) -> GenerateStream:
        request = GenerateRequest(prompt, params or SamplingParams())
        return GenerateStream(finished_only(self._submit(request, request_id), request_id))

    async def embed(self, x, params: PoolingParams | None = None,
                    request_id=None) -> EmbeddingOutput:
        out = await self._submit(EmbedRequest(x, params or PoolingParams()), request_id)
        return succeeded(out, out.request_id if request_id is None else request_id)

    def abort(self, request_id) -> None:
        """End a request by the caller's id (unknown or finished ids are ignored)."""
        tag = self._tags.get(request_id)
        future = self._resolve(tag)
        if future is not None:
            self.replicas.abort([tag])
            future.set_exception(RequestFailed(request_id, f"request {request_id!r} was "
                                                           "aborted"))

    async def _submit(self, request, request_id):
        loop = asyncio.get_running_loop()
        if self._closed:
            raise RuntimeError("this AsyncReplicas is closed; make a new one")
        if self._loop is not None and self._loop is not loop:
            if self._futures:
                raise RuntimeError(f"this AsyncReplicas serves event loop {id(self._loop):#x} "
                                   f"and was called from loop {id(loop):#x}; make one per "
                                   "event loop")
            self._task = None  # the old loop's collector went with it
        self._loop = loop
        (tag,) = admitted(lambda: self.replicas.submit([request]), FIELDS[KINDS[type(request)]],
                          request_id, self._tags)  # raises here, in the caller
        future = loop.create_future()
        self._futures[tag], self._kinds[tag] = future, KINDS[type(request)]
        self._ids[tag] = tag if request_id is None else request_id
        self._tags[self._ids[tag]] = tag
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._collector())
        try:
            return await future
        except BaseException:
            if self._resolve(tag) is not None:  # cancelled, or the stream was left
                self.replicas.abort([tag])
            raise

    def _resolve(self, tag):
        """Forget `tag`; -> its future if it was still in flight (None otherwise)."""
        self._kinds.pop(tag, None)
        self._tags.pop(self._ids.pop(tag, None), None)
        return self._futures.pop(tag, None)

    async def _collector(self) -> None:
        """Resolve futures until none is left (a new request starts a new collector)."""
        while self._futures:
            finished = await self._loop.run_in_executor(self._thread, self.replicas.collect,
                                                        POLL_S)
            for tag, result in finished:
                future = self._resolve(tag)
                if future is None or future.done():
                    continue
                if result.error is not None:  # the replica's checks refused it
                    future.set_exception(result.error)
                else:
                    future.set_result(result.output)

    async def close(self) -> None:
        """Stop collecting; every request in flight raises RequestFailed and is aborted."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._thread.shutdown(wait=True)
        futures, self._futures = self._futures, {}
        self._kinds.clear()
        self._tags.clear()
        self._ids.clear()
        self.replicas.abort(list(futures))
        for future in futures.values():
            if not future.done():
                future.set_exception(RequestFailed(None, "the AsyncReplicas was closed before "
                                                         "this request finished"))
