"""The one synchronous drive of an engine: admit, step, drain (imports no jax).

In: (tag, request) pairs, a tag being whatever the caller knows the request by (a replica's
tag, a batch row's key). `admit` prepares each request alone (`Engine.prepare`, index 0: the
caller renames its error, `RequestError.at`) and queues those the checks let through; `step`
runs one engine step and drains the requests it finished. Out: (tag, `RequestResult`) pairs,
each tag exactly once: the output (`finish_reason="error"` when the engine failed it alone), or
the `RequestError` that refused it. A step that raises, with no request to blame, raises here;
the caller decides (`abort_all` hands back the tags still in flight, aborted).

Who drives an engine through it: a replica's process (`replica_worker`), a Ray replica
(`ray_replicas.EngineActor`), the batch job's `EngineFront` and its Ray Data batcher. The
streaming front's thread (`stepper.Stepper`) also sends per-step deltas, so it drains on its
own; `Engine.run` checks a whole list before it queues any, as a batch call must.
"""
from __future__ import annotations

from hetero_jax.outputs import RequestError, RequestResult


class Drive:
    def __init__(self, engine):
        self.engine = engine
        self.tags: dict = {}  # engine request id -> the caller's tag, for those in flight

    def __len__(self) -> int:
        return len(self.tags)

    def admit(self, items) -> list:
        """Prepare and queue (tag, request) pairs -> [(tag, RequestResult)] of those the
        checks refused (a TypeError of theirs is a RequestError of field "params")."""
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
            fresh.append(req)
        self.engine.enqueue(fresh)
        return refused

    def step(self) -> list:
        """One engine step (none when idle) -> [(tag, RequestResult)] of those it finished."""
        if not self.engine.has_work():
            assert not self.tags, f"{len(self.tags)} requests in flight, the engine idle"
            return []
        finished = self.engine.step().finished
        return [(self.tags.pop(r.request_id), RequestResult(self.engine.output(r)))
                for r in finished if r.request_id in self.tags]

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
            del self.tags[request_id]

    def abort_all(self) -> list:
        """Abort every request in flight -> their tags."""
        tags = list(self.tags.values())
        for request_id in self.tags:
            self.engine.abort(request_id)
        self.tags.clear()
        return tags
