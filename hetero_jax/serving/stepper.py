"""The stepping thread of a front: admit, step, drain, without waiting on any event loop.

In: commands from any thread, `add(handle, caller_id)` (a prepared `sched.Request`) and
`abort(engine_id)`, kept in a deque until the thread applies them between steps. Out: after
each step, one call of `deliver(events)` from this thread with `(engine id, kind, value)`
events: `"out"` a `GenerateDelta` of a request that goes on, `"end"` the last delta of a
generation or an `EmbeddingOutput`, `"error"` the `RequestError` / `RequestFailed` that ends a
request. The engine belongs to this thread while it runs: it queues, steps, builds the deltas
from the host-side requests (`output_processor.delta`, no device read) and aborts, so the step
loop never waits for an event loop busy with HTTP. A step that raises with no request to blame
fails every request in the engine and the thread goes on; `stop()` ends the thread after its
step and returns what was still in flight.
"""
from __future__ import annotations

import collections
import threading
import time

from hetero_jax.outputs import RequestError, RequestFailed
from hetero_jax.serving.client import StepTimes
from hetero_jax.serving.output_processor import delta, final_delta


class _Sent:
    """How much of a request went out: ids, text, the ids that text covers (`read`), and the
    caller's id for it."""

    def __init__(self, caller_id):
        self.caller_id, self.num_sent, self.text, self.read = caller_id, 0, "", 0


class Stepper:
    def __init__(self, engine, deliver):
        self.engine, self.deliver = engine, deliver
        self.steps = StepTimes()
        self._inbox: collections.deque = collections.deque()  # ("add", req, id) / ("abort", rid)
        self._sent: dict = {}  # engine id -> _Sent, for the requests this thread holds
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="hetero-jax-step", daemon=True)
        self._thread.start()

    def add(self, req, caller_id) -> None:
        self._inbox.append(("add", req, caller_id))
        self._wake.set()

    def abort(self, rid) -> None:
        self._inbox.append(("abort", rid, None))
        self._wake.set()

    def num_queued(self) -> dict:
        """Requests added but not yet applied, by kind."""
        out: dict = {}
        for cmd, req, _ in list(self._inbox):
            if cmd == "add":
                out[req.kind] = out.get(req.kind, 0) + 1
        return out

    def stop(self) -> None:
        """End the thread after its current step; abort what it held."""
        self._stopping = True
        self._wake.set()
        self._thread.join()
        for rid in self._sent:
            self.engine.abort(rid)
        self._sent.clear()
        self._inbox.clear()

    def _run(self) -> None:
        while not self._stopping:
            events = self._apply_inbox()
            if not self.engine.has_work():
                if events:
                    self.deliver(events)
                self._wake.wait()
                self._wake.clear()
                continue
            start = time.perf_counter()
            try:
                result = self.engine.step()
            except Exception as e:  # noqa: BLE001 - belongs to no single request: fail them all
                events += self._fail_all(e)
            else:
                self.steps.observe(time.perf_counter() - start)
                events += self._drain(result)
            if events:
                self.deliver(events)

    def _apply_inbox(self) -> list:
        events = []
        while self._inbox:
            cmd, req, caller_id = self._inbox.popleft()
            if cmd == "abort":
                if self._sent.pop(req, None) is not None:
                    self.engine.abort(req)
                continue
            try:
                self.engine.enqueue([req])
            except ValueError as e:  # the scheduler's own limits: this request alone
                field = "input" if req.is_embed else "prompt"
                events.append((req.request_id, "error", RequestError(0, field, str(e))))
                continue
            self._sent[req.request_id] = _Sent(caller_id)
        return events

    def _drain(self, result) -> list:
        """A step's `StepOutput` -> events."""
        events, tokenizer = [], self.engine.tokenizer
        for req in result.progressed:
            sent = self._sent.get(req.request_id)
            if sent is None:
                continue
            try:
                d, sent.read = delta(req, sent.num_sent, sent.read, tokenizer, sent.caller_id)
            except Exception as e:  # noqa: BLE001 - this request's data: fail it alone
                self.engine.abort(req.request_id)
                del self._sent[req.request_id]
                events.append((req.request_id, "error", RequestFailed(
                    sent.caller_id, f"request {req.request_id}: {type(e).__name__}: {e}")))
                continue
            sent.num_sent, sent.text = sent.num_sent + len(d.token_ids), sent.text + d.text
            events.append((req.request_id, "out", d))
        for req in result.finished:
            sent = self._sent.pop(req.request_id, None)
            if sent is None:
                continue
            out = self.engine.output(req)  # never raises: a broken one comes back as an error
            if out.finish_reason == "error":
                events.append((req.request_id, "error", RequestFailed(sent.caller_id,
                                                                      out.error)))
            elif req.is_embed:
                events.append((req.request_id, "end", out))
            else:
                events.append((req.request_id, "end", final_delta(
                    out, sent.num_sent, sent.text, sent.caller_id)))
        return events

    def _fail_all(self, error: Exception) -> list:
        failure = RequestFailed(None, str(error))
        failure.__cause__ = error
        for rid in self._sent:
            self.engine.abort(rid)
        events = [(rid, "error", failure) for rid in self._sent]
        self._sent.clear()
        return events
