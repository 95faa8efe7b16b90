"""The in-process `EngineClient`: many coroutines, one engine, one stepping thread.

`AsyncEngine(engine)` is the one front (`front.Front`) over an `EngineCore`: its
`generate(prompt, params, request_id=None)` returns a `client.GenerateStream`; its first
iteration (or `await`) validates the request in the caller's coroutine (`Engine.prepare`: a
bad one raises `RequestError` there and nowhere else) and hands it to the `stepper.Stepper`
thread, and then it yields a `GenerateDelta` for every step that gave the request a token,
the last one finished (deltas that queued up while the caller was busy come joined, as one).
`await engine.embed(x, params)` -> `EmbeddingOutput`. The stepper thread runs the one
`drive.Drive` loop: it queues new requests and aborts between steps, steps, and builds each
step's deltas from the host-side requests (no extra device read); `front.Flights` turns them
into events as it does a replica set's, and the front hands them to the event loop in one
`call_soon_threadsafe` per step, so stepping never waits for a loop busy with HTTP or
retrieval. Leaving a stream early, cancelling a coroutine or `abort(request_id)` aborts its
request and frees its pages. A request the engine fails alone raises `RequestFailed` in its
own coroutine; an error that belongs to no request fails every one in flight; nothing is left
waiting. `close()` fails every pending request and frees what it held. An AsyncEngine serves
one event loop (another loop gets a RuntimeError), and `Engine.run` refuses to run while its
requests are in flight.
"""
from __future__ import annotations

import threading

from hetero_jax.serving.client import FrontStats, StepTimes
from hetero_jax.serving.front import Flights, Front, failed_events
from hetero_jax.serving.stepper import Stepper


class EngineCore:
    """A `front.Front`'s core over one `Engine` in this process: a delta per step."""

    def __init__(self, engine):
        self.engine = engine
        self._deliver = None
        self._flights = Flights()  # by engine id, until delivered
        self._lock = threading.Lock()  # a request is in `_flights` before the stepper has it
        self._stepper: Stepper | None = None  # started by the first request

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    def open(self, deliver) -> None:
        self._deliver = deliver

    def submit(self, request, request_id) -> tuple:
        """Check and tokenize (raises here), then hand to the stepper -> (engine id, the
        caller's id: the engine's when it named none)."""
        (req,) = self.engine.prepare([request])
        rid = req.request_id if request_id is None else request_id
        with self._lock:
            self._flights.add(req.request_id, req.kind, rid)
            if self._stepper is None:
                self._stepper = Stepper(self.engine, self._report)
        self._stepper.add(req.request_id, req)
        return req.request_id, rid

    def abort(self, engine_id) -> None:
        with self._lock:
            self._flights.pop(engine_id)
        self._stepper.abort(engine_id)

    def stats(self) -> FrontStats:
        waiting, running = self.engine.queue_counts()
        if self._stepper is None:
            return FrontStats(self.engine.stats, waiting, running, StepTimes())
        for kind, n in self._stepper.num_queued().items():
            waiting[kind] = waiting.get(kind, 0) + n
        return FrontStats(self.engine.stats, waiting, running, self._stepper.steps)

    def stop(self) -> None:
        """End the stepping thread; abort what it held (blocks until its step ends)."""
        if self._stepper is not None:
            self._stepper.stop()

    def _report(self, results: list, failure) -> None:
        """The stepper's news (its thread) -> the front's events, in one delivery."""
        with self._lock:
            events = [e for e in (self._flights.event(*r) for r in results) if e]
            if failure is not None:
                for tag in failure[0]:
                    self._flights.pop(tag)
                events += failed_events(*failure)
        if events:
            self._deliver(events)


class AsyncEngine(Front):
    """The `EngineClient` of one `Engine` in this process (module docstring)."""

    def __init__(self, engine):
        super().__init__(EngineCore(engine))
        self.engine = engine
