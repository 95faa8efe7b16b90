"""The one synchronous drive of an engine: admit, step, drain (imports no jax).

In: (tag, request) pairs, a tag being whatever the caller knows the request by (a replica's
tag, a batch row's key). `admit` prepares each request alone (`Engine.prepare`, index 0: the
caller renames its error, `RequestError.at`) and queues those the checks let through; `step`
runs one engine step and drains the requests it finished. Out: (tag, `RequestResult`) pairs,
each tag exactly once: the output (`finish_reason="error"` when the engine failed it alone), or
the `RequestError` that refused it. A step that raises, with no request to blame, raises here;
the caller decides (`abort_all` hands back the tags still in flight, aborted). A request
admitted with `stream=True` also gets its per-step deltas: `step_with_deltas` gives
(tag, `GenerateDelta`) for each streamed generation a step gave tokens and that goes on, built
from the host-side request (`output_processor.delta`, no device read); the others cost nothing.

Who drives an engine through it: a replica's process (`replica_worker`), a Ray replica
(`ray_replicas.EngineActor`), the batch job's `EngineFront` and its Ray Data batcher. The
in-process front's thread (`stepper.Stepper`) also holds the caller's ids and the queue of
commands, so it drains on its own; `Engine.run` checks a whole list before it queues any, as a batch call must.
"""
from __future__ import annotations

from hetero_jax.outputs import RequestError, RequestResult
from hetero_jax.serving.output_processor import delta


class Drive:
    def __init__(self, engine):
        self.engine = engine
        self.tags: dict = {}  # engine request id -> the caller's tag, for those in flight
        self.streams: dict = {}  # tag -> [ids sent, text cursor], for the streamed ones

    def __len__(self) -> int:
        return len(self.tags)

    def admit(self, items, stream: bool = False) -> list:
        """Prepare and queue (tag, request) pairs -> [(tag, RequestResult)] of those the
        checks refused (a TypeError of theirs is a RequestError of field "params");
        `stream`: their generations' steps give deltas (`step_with_deltas`)."""
        refused, fresh = [], []
        for tag, request in items:
            try:
                (req,) = self.engine.prepare([request])
            except RequestError as e:
                refused.append((tag, RequestResult(error=e)))
                continue
            except TypeError as e:
                refused.append((tag, RequestResult(error=RequestError(0, "params", str(e)))))
                continue
            self.tags[req.request_id] = tag
            if stream and not req.is_embed:
                self.streams[tag] = [0, 0]
            fresh.append(req)
        self.engine.enqueue(fresh)
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
        result = self.engine.step()
        deltas = [d for d in map(self._delta, result.progressed) if d is not None]
        finished = [(self.tags.pop(r.request_id), RequestResult(self.engine.output(r)))
                    for r in result.finished if r.request_id in self.tags]
        for tag, _ in finished:
            self.streams.pop(tag, None)
        return deltas, finished

    def _delta(self, req):
        """(tag, the delta this step added) of a streamed request, else None. One whose text
        cannot be decoded streams no more: its output, when it ends, says what went wrong."""
        tag = self.tags.get(req.request_id)
        cursor = self.streams.get(tag)
        if cursor is None:
            return None
        try:
            d, cursor[1] = delta(req, cursor[0], cursor[1], self.engine.tokenizer, tag)
        except Exception:  # noqa: BLE001 - this request's data: its final output reports it
            del self.streams[tag]
            return None
        cursor[0] += len(d.token_ids)
        return tag, d

    def run(self, items) -> list:
        """Admit the items and step until every one finished -> [(tag, RequestResult)]."""
        results = self.admit(items)
        while self.tags:
            results += self.step()
        return results

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
