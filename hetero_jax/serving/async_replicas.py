"""asyncio front end over a `ReplicaSet`: many coroutines, N engine processes, one collector.

`await front.generate(prompt, params)` / `await front.embed(x, params)` check, tokenize and
route in the caller's coroutine (a request of the wrong type, or whose input cannot be
tokenized, raises there), then the request is on its replica. One collector task waits in a
worker thread for the set's finished requests (`ReplicaSet.collect`) and resolves their
futures on the event loop: an output, or the ValueError with which the replica's checks
refused the request, or a RuntimeError for one that failed running or whose replica died
(the others go on). Cancelling a coroutine aborts its request on its replica. `close()`
fails and aborts every request still in flight; the replica processes stay up (close the
set for that). One event loop per front, as `AsyncEngine`. It is a `rag.Front`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures

import numpy as np

from hetero_jax.requests import EmbedRequest, GenerateRequest, PoolingParams, SamplingParams
from hetero_jax.serving.replicas import ReplicaSet

POLL_S = 0.2  # how long one collect waits, so a closed front's thread ends soon


class AsyncReplicas:
    def __init__(self, replicas: ReplicaSet):
        self.replicas = replicas
        self._futures: dict = {}  # tag -> asyncio.Future, until resolved
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

    async def generate(self, prompt, params: SamplingParams | None = None):
        """-> RequestOutput."""
        return await self._submit(GenerateRequest(prompt, params or SamplingParams()))

    async def embed(self, x, params: PoolingParams | None = None) -> np.ndarray:
        """-> the embedding `[d]`."""
        out = await self._submit(EmbedRequest(x, params or PoolingParams()))
        return out.embedding

    async def _submit(self, request):
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
        (tag,) = self.replicas.submit([request])  # raises here, in the caller
        future = loop.create_future()
        self._futures[tag] = future
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._collector())
        try:
            return await future
        except asyncio.CancelledError:
            if self._futures.pop(tag, None) is not None:
                self.replicas.abort([tag])
            raise

    async def _collector(self) -> None:
        """Resolve futures until none is left (a new request starts a new collector)."""
        while self._futures:
            finished = await self._loop.run_in_executor(self._thread, self.replicas.collect,
                                                        POLL_S)
            for tag, result in finished:
                future = self._futures.pop(tag, None)
                if future is None or future.done():
                    continue
                if isinstance(result, Exception):
                    future.set_exception(result)
                elif result.finish_reason == "error":
                    future.set_exception(RuntimeError(result.error))
                else:
                    future.set_result(result)

    async def close(self) -> None:
        """Stop collecting; every request in flight raises RuntimeError and is aborted."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._thread.shutdown(wait=True)
        futures, self._futures = self._futures, {}
        self.replicas.abort(list(futures))
        for future in futures.values():
            if not future.done():
                future.set_exception(RuntimeError("the AsyncReplicas was closed before this "
                                                  "request finished"))
