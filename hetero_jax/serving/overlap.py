"""The engine's step, with the host's work overlapped with the device's (async scheduling).

In: the engine's `Scheduler`, decoder runner and separate encoder (if any). Out: one
`StepOutput` per `step()` call: the requests a device step finished, failed or gave a token.
One thread (the engine's lock held). With `overlap` off the step runs in sequence: schedule,
pack, dispatch, wait for the sampled tokens, update. With it on, as vLLM's async scheduling:

1. step N was dispatched by the previous call (jax dispatch returns before the device is done);
2. `Scheduler.advance` moves N's requests on (placeholder output tokens, `sched/advance.py`),
   and step N+1 is scheduled and packed on the host while N runs; each placeholder token is
   linked to the row of N that samples it (`runner.batch.link_tokens`), and N+1 is dispatched
   at once: the device queues it behind N and reads those tokens from N's output there, so
   it starts as N ends, without a round trip through the host;
3. the call blocks on N's results;
4. `Scheduler.settle` writes N's results in (stop tokens, embeddings), stop strings are
   scanned and N's output returned while N+1 runs.

A request that N finished (a stop token or string, a NaN output) still has a row in N+1: a dead
row whose outputs nothing reads (`advance` skips it). Its pages go back to the pool at once,
which is safe: the device runs steps in dispatch order, so a later step that reuses them runs
after N+1. A step in flight with a live row keeps `has_work` true (the row's request is running),
so callers that loop on it drain the last one; one whose rows all died (aborted between
calls) is dropped unread by the next call. Failures: an item whose own data cannot be packed
fails alone (`finish_reason="error"`), the others run next step; an error of no single request
is raised (in overlap, one met while preparing N+1 is raised by the next call, after N's
outputs are returned).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from hetero_jax.models import detokenize
from hetero_jax.runner.batch import link_tokens, pack_batch
from hetero_jax.sched import RunnerOutput, SchedulerOutput
from hetero_jax.sched.advance import PLACEHOLDER, Ahead


@dataclasses.dataclass
class StepOutput:
    """What one `Engine.step` did, as `sched.Request` handles (read them between steps)."""

    finished: list  # finished, failed or aborted in this step
    progressed: list  # sampled a token in this step and go on


@dataclasses.dataclass
class _Flight:
    """A step dispatched (the decoder's part runs on the device) whose results are unread."""

    out: SchedulerOutput
    encoded: RunnerOutput  # the separate encoder's results (it runs at dispatch)
    launched: object  # runner.decoder.Launched, None without decoder items


@dataclasses.dataclass
class _Next:
    """Step N+1, scheduled and packed while N runs (`error`: packing it failed)."""

    out: SchedulerOutput
    packed: tuple | None  # (variant key, StepBatch) of its decoder items
    error: Exception | None = None


class StepPipeline:
    def __init__(self, engine):
        """Steps `engine`: its scheduler (read each step: a caller may replace it between
        runs), runners, tokenizer, and its stats (`record_step(out, runner_out)`)."""
        self.engine = engine
        self.overlap = engine.config.async_scheduling
        self.flight: _Flight | None = None
        self.error: Exception | None = None  # met preparing the next step: raised next call

    @property
    def scheduler(self):
        return self.engine.scheduler

    @property
    def runner(self):
        return self.engine.runner

    def has_work(self) -> bool:
        """Requests queued or running (a step in flight with a live row holds one), or an
        error to raise. A flight left with dead rows only is collected by the next step."""
        return self.scheduler.has_work() or self.error is not None

    def step(self, drain: bool = False) -> StepOutput:
        """One device step's outputs (see the module docstring); `drain`: schedule no next
        step, so none is in flight when the call returns."""
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        if self.flight is not None and not self._is_live(self.flight):
            self.flight = None  # every row's request ended meanwhile: nothing to read
        if self.flight is None:
            out = self.scheduler.schedule()
            assert out.items or out.encoder_items, "an empty step while requests are pending"
            try:
                self.flight = self._launch(out, self._pack(out))
            except Exception as error:
                return StepOutput(self._fail_culprits(out, error), [])
        flight, self.flight = self.flight, None
        ahead = self.scheduler.advance(flight.out)
        nxt = self._schedule_next(flight) if self.overlap and not drain else None
        if nxt is not None:
            self._launch_next(nxt)
        runner_out = self._collect(flight)
        failed = self._fail_non_finite(runner_out, ahead)
        finished = self.scheduler.settle(ahead, runner_out, time.perf_counter())
        self.engine.record_step(flight.out, runner_out)
        if nxt is not None and nxt.error is not None:
            failed += self._fail_next(nxt)
        live = self.scheduler.requests
        return self._stop_strings(failed + finished,
                                  [live[rid] for rid in runner_out.sampled if rid in live])

    # -- dispatch and collect -------------------------------------------------------------
    def _is_live(self, flight: _Flight) -> bool:
        """Whether a request of the flight's step is still queued or running."""
        live = self.scheduler.requests
        return any(it.request_id in live for it in flight.out.items + flight.out.encoder_items)

    def _pack(self, out: SchedulerOutput) -> tuple | None:
        """(variant key, StepBatch) of `out`'s decoder items; None when it has none."""
        return self.runner.pack(out) if out.items else None

    def _launch(self, out: SchedulerOutput, packed: tuple | None) -> _Flight:
        encoded = (self.engine.encoder.runner.execute(out.encoder_items) if out.encoder_items
                   else RunnerOutput())
        launched = self.runner.launch(out.items, *packed) if packed else None
        return _Flight(out, encoded, launched)

    def _collect(self, flight: _Flight) -> RunnerOutput:
        if flight.launched is None:
            return flight.encoded
        return flight.encoded.merge(self.runner.collect(flight.launched))

    def _schedule_next(self, flight: _Flight) -> _Next | None:
        """Step N+1 scheduled and packed while N (`flight`) runs, its placeholder ids linked to
        the rows of N that sample them; None: nothing to run."""
        if not self.scheduler.has_work():
            return None
        out = self.scheduler.schedule()
        if not (out.items or out.encoder_items):
            return None
        rows = {it.request_id: i for i, it in enumerate(flight.out.items) if it.samples}
        try:
            packed = self._pack(out)
            return _Next(out, packed and (packed[0], link_tokens(
                packed[1], out.items, rows, PLACEHOLDER)))
        except Exception as error:  # noqa: BLE001 - failed after N's outputs (_fail_next)
            return _Next(out, None, error)

    def _launch_next(self, nxt: _Next) -> None:
        """Dispatch N+1 behind N (an error: kept in `nxt.error`, failed after N's outputs)."""
        if nxt.error is not None:
            return
        try:
            self.flight = self._launch(nxt.out, nxt.packed)
        except Exception as error:  # noqa: BLE001 - failed after N's outputs (_fail_next)
            nxt.error = error

    # -- failures -------------------------------------------------------------------------
    def _fail_next(self, nxt: _Next) -> list:
        """N+1 could not be dispatched: fail its culprits (others run next step), or keep
        the error for the next call when no item is to blame."""
        try:
            return self._fail_culprits(nxt.out, nxt.error)
        except Exception as error:  # noqa: BLE001 - raised by the next call
            self.error = error
            return []

    def _fail_culprits(self, out: SchedulerOutput, error: Exception) -> list:
        """Fail the live decoder items that cannot be packed even alone; re-raise `error`
        if no item is to blame."""
        culprits = []
        for item in out.items:
            try:
                pack_batch([item], self.engine.config)
            except Exception as e:  # noqa: BLE001 - this item's own data is broken
                culprits.append((item.request_id, e))
        if not culprits:
            raise error
        live = self.scheduler.requests
        return [self.fail(live[rid], e) for rid, e in culprits if rid in live]

    def _fail_non_finite(self, runner_out: RunnerOutput, ahead: Ahead) -> list:
        """Fail the requests whose sampled token (its log-probability) or embedding came back
        NaN or Inf: what the model made of their inputs overflowed. The step's others go on."""
        bad = [(rid, "sampled token's log-probability") for rid, t in runner_out.sampled.items()
               if not np.isfinite(t.logprob)]
        bad += [(rid, "embedding") for rid, v in runner_out.embeddings.items()
                if not np.isfinite(v).all()]
        return [self.fail(ahead.request(rid), FloatingPointError(
            f"the model's output for it is not finite (NaN or Inf in its {what}): the weights "
            "or its activations overflowed")) for rid, what in bad
            if ahead.request(rid) is not None]  # else aborted while its step ran

    def fail(self, req, error: Exception):
        """Abort a request (its pages and slot freed, if it still holds them) as failed with
        `error`; -> its handle."""
        self.scheduler.abort(req.request_id)
        req.finish_reason, req.error, req.finish_time = "error", error, time.perf_counter()
        return req

    def _stop_strings(self, finished: list, progressed: list) -> StepOutput:
        """The step's output after its requests' stop strings (`detokenize.scan`): one whose
        text now holds one ends here, `finish_reason="stop"`; a finished one keeps its
        reason unless its last token completed a stop string."""
        for req in finished:
            if req.error is None and detokenize.scan(req, self.engine.tokenizer):
                req.finish_reason = "stop"
        going = []
        for req in progressed:
            if detokenize.scan(req, self.engine.tokenizer):
                self.scheduler.abort(req.request_id, "stop")
                req.finish_time = time.perf_counter()
                finished.append(req)
            else:
                going.append(req)
        return StepOutput(finished, going)
