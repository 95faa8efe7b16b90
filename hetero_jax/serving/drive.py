"""The one drive of an engine: admit, step, drain; and the one loop that owns it (imports
no jax, nor any other part of `serving`).

In: (tag, request) pairs, a tag being whatever the caller knows the request by (a replica's
tag, a batch row's key, the front's engine id). `admit` prepares each request alone
(`Engine.prepare`, index 0: the caller renames its error, `RequestError.at`) and `queue`s
those the checks let through (`queue` alone takes handles prepared already, as `Engine.run`
and the in-process front prepare theirs in the caller's thread); `step` runs one engine step
and drains the requests it finished. Out: (tag, `RequestResult`) pairs, each tag exactly once:
the output (`finish_reason="error"` when the engine failed it alone), or the `RequestError`
that refused it. A step that raises, with no request to blame, raises here; the caller
decides (`abort_all` hands back the tags still in flight, aborted). A request queued with
`stream=True` also gets its per-step deltas: `step_with_deltas` gives (tag, `GenerateDelta`)
for each streamed generation a step gave tokens and that goes on, built from the host-side
request (`Engine.delta`, no device read; one whose delta cannot be built fails alone at
once); the others cost nothing. The loop is written against `has_work` / `step`
and `StepOutput`, so an engine whose step hands back an earlier step's requests drives alike.

Who drives an engine through it. The batch callers step until their requests are done
(`steps`): `Engine.run` (its progress bar), a Ray replica (`ray_replicas.EngineActor`), the
Ray Data batcher (`run`) and the job's `EngineFront`. The owner of a long-lived engine runs
`serve`, the loop that applies commands between steps, blocks while the engine is idle and
reports each step: a replica's process (`replica_worker`, commands from its pipe) and the
in-process front's thread (`stepper.Stepper`, commands from a deque).
"""
from __future__ import annotations

import time

from hetero_jax.outputs import RequestError, RequestResult


class Drive:
    def __init__(self, engine):
        self.engine = engine
        self.tags: dict = {}  # engine request id -> the caller's tag, for those in flight
        self.streams: dict = {}  # tag -> [ids sent, text cursor], for the streamed ones
        self.step_s = 0.0  # the last step's seconds

    def __len__(self) -> int:
        return len(self.tags)

    def admit(self, items, stream: bool = False) -> list:
        """Prepare and queue (tag, request) pairs -> [(tag, RequestResult)] of those the
        checks refused (a TypeError of theirs is a RequestError of field "params");
        `stream`: their generations' steps give deltas (`step_with_deltas`)."""
        refused, ready = [], []
        for tag, request in items:
            try:
                (req,) = self.engine.prepare([request])
            except RequestError as e:
                refused.append((tag, RequestResult(error=e)))
                continue
            except TypeError as e:
                refused.append((tag, RequestResult(error=RequestError(0, "params", str(e)))))
                continue
            ready.append((tag, req))
        return refused + self.queue(ready, stream)

    def queue(self, handles, stream: bool = False) -> list:
        """Queue prepared (tag, `sched.Request`) pairs -> [(tag, RequestResult)] of those the
        scheduler's own limits refused (a RequestError of field "input" or "prompt")."""
        refused = []
        for tag, req in handles:
            try:
                self.engine.enqueue([req])
            except ValueError as e:
                field = "input" if req.is_embed else "prompt"
                refused.append((tag, RequestResult(error=RequestError(0, field, str(e)))))
                continue
            self.tags[req.request_id] = tag
            if stream and not req.is_embed:
                self.streams[tag] = [0, 0]
        return refused

    def step(self) -> list:
        """One engine step (none when idle) -> [(tag, RequestResult)] of those it finished."""
        return self.step_with_deltas()[1]

    def step_with_deltas(self) -> tuple:
        """One engine step (none when idle) -> ([(tag, GenerateDelta)] of the streamed
        requests it gave tokens that go on, [(tag, RequestResult)] of those it finished)."""
        if not self.engine.has_work():
            assert not self.tags, f"{len(self.tags)} requests in flight, the engine idle"
            return [], []
        start = time.perf_counter()
        result = self.engine.step()
        self.step_s = time.perf_counter() - start
        deltas, broken = [], []
        for req in result.progressed:
            d = self._delta(req)
            if isinstance(d, Exception):
                self.engine.fail(req.request_id, d)
                broken.append(req)
            elif d is not None:
                deltas.append(d)
        finished = [(self.tags.pop(r.request_id), RequestResult(self.engine.output(r)))
                    for r in result.finished + broken if r.request_id in self.tags]
        for tag, _ in finished:
            self.streams.pop(tag, None)
        return deltas, finished

    def _delta(self, req):
        """(tag, the delta this step added) of a streamed request, None for one not
        streamed, or the error that building its delta raised (its own data is at fault)."""
        tag = self.tags.get(req.request_id)
        cursor = self.streams.get(tag)
        if cursor is None:
            return None
        try:
            d, cursor[1] = self.engine.delta(req, cursor[0], cursor[1], tag)
        except Exception as e:  # noqa: BLE001 - this request's data: it fails alone
            return e
        cursor[0] += len(d.token_ids)
        return tag, d

    def steps(self):
        """Step until every request in flight finished, yielding each step's
        [(tag, RequestResult)] of those it finished (a step that raises raises here)."""
        while self.tags:
            yield self.step()

    def run(self, items) -> list:
        """Admit the items and step until every one finished -> [(tag, RequestResult)]."""
        results = self.admit(items)
        for finished in self.steps():
            results += finished
        return results

    def serve(self, take, handle, report) -> None:
        """The loop of the thread or process that owns the engine. Between steps it applies
        every command waiting: `take(wait)` -> the next one, or None when none is waiting
        (`wait`: the engine is idle, so block until one comes); `handle(command)` applies it
        (False: end the loop). Then one step, and `report(deltas, finished, failure)`: the
        lists of `step_with_deltas`, or, when the step raised with no request to blame,
        `failure` = (the tags that were in flight, now aborted, the error)."""
        while True:
            command = take(not self.engine.has_work())
            if command is not None:
                if handle(command) is False:
                    return
                continue
            try:
                deltas, finished = self.step_with_deltas()
            except Exception as e:  # noqa: BLE001 - no request to blame: the owner fails all
                report([], [], (self.abort_all(), e))
                continue
            report(deltas, finished, None)

    def abort(self, tags) -> None:
        """Drop these tags' requests (unknown or finished ones are ignored)."""
        drop = set(tags)
        for request_id in [rid for rid, tag in self.tags.items() if tag in drop]:
            self.engine.abort(request_id)
            self.streams.pop(self.tags.pop(request_id), None)

    def abort_all(self) -> list:
        """Abort every request in flight -> their tags."""
        tags = list(self.tags.values())
        for request_id in self.tags:
            self.engine.abort(request_id)
        self.tags.clear()
        self.streams.clear()
        return tags
