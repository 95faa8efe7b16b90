"""The stepping thread of the in-process front: a `drive.Drive`'s `serve` loop on a thread.

In: commands from any thread, `add(tag, req)` (a `sched.Request` prepared in the caller's
thread) and `abort(tag)`, kept in a deque until the thread applies them between steps; the
engine belongs to this thread while it runs (it queues, steps, builds the streamed deltas
from the host-side requests and aborts), so the step loop never waits for an event loop busy
with HTTP. Out: `report(results, failure)` from this thread whenever there is news, once
per step at most plus once per refused request: `results` are (tag, `RequestResult`), a
`delta` for each step of a streamed generation that goes on, then the `output` of each
request that ended (or the `RequestError` of the scheduler's own limits); `failure` is
(tags, error) when a step raised with no request to blame (those requests are aborted and
the thread goes on). `stop()` ends the thread after its step and aborts what was in flight.
"""
from __future__ import annotations

import collections
import threading

from hetero_jax.outputs import RequestResult
from hetero_jax.serving.client import StepTimes
from hetero_jax.serving.drive import Drive


class Stepper:
    def __init__(self, engine, report):
        self.drive, self.report = Drive(engine), report
        self.steps = StepTimes()
        self._inbox: collections.deque = collections.deque()  # ("add", tag, req) / ("abort", tag)
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self.drive.serve, name="hetero-jax-step",
                                        args=(self._take, self._handle, self._report),
                                        daemon=True)
        self._thread.start()

    def add(self, tag, req) -> None:
        self._inbox.append(("add", tag, req))
        self._wake.set()

    def abort(self, tag) -> None:
        self._inbox.append(("abort", tag, None))
        self._wake.set()

    def num_queued(self) -> dict:
        """Requests added but not yet applied, by kind."""
        out: dict = {}
        for cmd, _, req in list(self._inbox):
            if cmd == "add":
                out[req.kind] = out.get(req.kind, 0) + 1
        return out

    def stop(self) -> None:
        """End the thread after its current step; abort what it held."""
        self._stopping = True
        self._wake.set()
        self._thread.join()
        self.drive.abort_all()
        self._inbox.clear()

    def _take(self, wait: bool):
        """The next command (("stop",) once stopped), or None: none waiting and not `wait`."""
        while not self._stopping:
            if self._inbox:
                return self._inbox.popleft()
            if not wait:
                return None
            self._wake.wait()
            self._wake.clear()
        return ("stop",)

    def _handle(self, command) -> bool:
        if command[0] == "stop":
            return False
        cmd, tag, req = command
        if cmd == "abort":
            self.drive.abort([tag])
            return True
        refused = self.drive.queue([(tag, req)], stream=True)
        if refused:
            self.report(refused, None)
        return True

    def _report(self, deltas, finished, failure) -> None:
        if failure is None:
            self.steps.observe(self.drive.step_s)
        if deltas or finished or failure:
            self.report([(tag, RequestResult(delta=d)) for tag, d in deltas] + finished, failure)
