"""asyncio front end: many coroutines submit requests; one background task batches them all.

`await engine.generate(prompt, params)` / `await engine.embed(x, params)` validate in the
caller's coroutine (a bad request raises there and nowhere else), then hand the request to
the stepper task. The stepper queues new requests and aborts between steps, runs each
`Engine.step()` in a worker thread (so the event loop stays free for retrieval and other
work), and resolves the futures of the requests that finished. Cancelling a coroutine aborts
its request and frees its pages. It is a `rag.Front`: `tokenizer` and `max_model_len` are
what the retrieval pipeline reads.
"""
from __future__ import annotations

import asyncio
import concurrent.futures

import numpy as np

from hetero_jax.requests import EmbedRequest, GenerateRequest, PoolingParams, SamplingParams
from hetero_jax.serving.engine import Engine


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._pending: list = []  # prepared Request handles to enqueue before the next step
        self._aborts: list = []  # request ids to abort before the next step
        self._futures: dict = {}  # request id -> (Request, asyncio.Future)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "hetero-jax-step")

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    async def generate(self, prompt, params: SamplingParams | None = None):
        """-> RequestOutput."""
        return await self._submit(GenerateRequest(prompt, params or SamplingParams()))

    async def embed(self, x, params: PoolingParams | None = None) -> np.ndarray:
        """-> the embedding `[d]`."""
        out = await self._submit(EmbedRequest(x, params or PoolingParams()))
        return out.embedding

    async def _submit(self, request):
        (req,) = self.engine.prepare([request])  # raises here, in the caller, on bad input
        future = asyncio.get_running_loop().create_future()
        self._futures[req.request_id] = (req, future)
        self._pending.append(req)
        self._ensure_stepper()
        try:
            return await future
        except asyncio.CancelledError:
            self._aborts.append(req.request_id)
            self._futures.pop(req.request_id, None)
            self._wake.set()
            raise

    def _ensure_stepper(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._stepper())
        self._wake.set()

    async def _stepper(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            for rid in self._aborts:
                self.engine.abort(rid)
            self._aborts.clear()
            self.engine.enqueue(self._pending)
            self._pending = []
            if not self.engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                finished = await loop.run_in_executor(self._thread, self.engine.step)
            except Exception as e:  # a broken step fails the requests in flight, not the loop
                self._fail_all(e)
                continue
            for req in finished:
                entry = self._futures.pop(req.request_id, None)
                if entry and not entry[1].done():
                    entry[1].set_result(self.engine.output(req))

    def _fail_all(self, error: Exception) -> None:
        for rid, (_, future) in list(self._futures.items()):
            self.engine.abort(rid)
            if not future.done():
                future.set_exception(error)
        self._futures.clear()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._thread.shutdown(wait=True)
