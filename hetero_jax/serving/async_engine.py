"""asyncio front end: many coroutines submit requests; one background task batches them all.

`await engine.generate(prompt, params)` / `await engine.embed(x, params)` validate in the
caller's coroutine (a bad request raises there and nowhere else), then hand the request to
the stepper task. The stepper queues new requests and aborts between steps, runs each
`Engine.step()` in a worker thread (so the event loop stays free for retrieval and other
work), and resolves the futures of the requests that finished. Cancelling a coroutine aborts
its request and frees its pages. A request the engine fails alone raises in its own
coroutine; an error that belongs to no request fails every pending one; nothing is left
waiting. `close()` fails every pending request and frees what it held. An AsyncEngine serves
one event loop (another loop gets a RuntimeError), and `Engine.run` refuses to run while its
requests are in flight. It is a `rag.Front`: `tokenizer` and `max_model_len` are what the
retrieval pipeline reads.
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
        self._futures: dict = {}  # request id -> asyncio.Future, until it is resolved
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

    async def generate(self, prompt, params: SamplingParams | None = None):
        """-> RequestOutput."""
        return await self._submit(GenerateRequest(prompt, params or SamplingParams()))

    async def embed(self, x, params: PoolingParams | None = None) -> np.ndarray:
        """-> the embedding `[d]`."""
        out = await self._submit(EmbedRequest(x, params or PoolingParams()))
        return out.embedding

    async def _submit(self, request):
        self._bind(asyncio.get_running_loop())
        (req,) = self.engine.prepare([request])  # raises here, in the caller, on bad input
        future = self._loop.create_future()
        self._futures[req.request_id] = future
        self._pending.append(req)
        self._ensure_stepper()
        try:
            return await future
        except asyncio.CancelledError:
            if self._futures.pop(req.request_id, None) is not None:
                self._aborts.append(req.request_id)
                self._wake.set()
            raise

    def _bind(self, loop) -> None:
        if self._closed:
            raise RuntimeError("this AsyncEngine is closed; make a new one")
        if self._loop is not None and self._loop is not loop:
            if not self._loop.is_closed() or self._futures:
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
                finished = await self._loop.run_in_executor(self._thread, self.engine.step)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # belongs to no single request: fail them all, keep serving
                self._fail_all(e)
                continue
            for req in finished:
                self._resolve(req)

    def _apply_queued(self) -> None:
        for rid in self._aborts:
            self.engine.abort(rid)
        self._aborts.clear()
        pending, self._pending = self._pending, []
        self.engine.enqueue(pending)

    def _resolve(self, req) -> None:
        future = self._futures.pop(req.request_id, None)
        if future is None or future.done():
            return
        out = self.engine.output(req)  # never raises: a broken one comes back as an error
        if out.finish_reason == "error":
            future.set_exception(RuntimeError(out.error))
        else:
            future.set_result(out)

    def _fail_all(self, error: BaseException) -> None:
        """Every request in flight fails with `error`; the engine forgets them."""
        self._pending.clear()
        self._aborts.clear()
        for rid, future in list(self._futures.items()):
            self.engine.abort(rid)
            if not future.done():
                future.set_exception(error)
        self._futures.clear()

    async def close(self) -> None:
        """Stop the stepper; every request still in flight raises RuntimeError in its coroutine
        and is aborted in the engine (its pages and slots freed)."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._thread.shutdown(wait=True)  # a step still running in the thread ends first
        self._apply_queued()
        self._fail_all(RuntimeError("the AsyncEngine was closed before this request finished"))
