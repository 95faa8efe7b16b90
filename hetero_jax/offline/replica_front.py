"""The batch job's `Front` over replicas (a `ReplicaSet` or `RayReplicaSet`: their
`offer`, `collect` and `abort`): rows to N engines, results as they finish.

In: (key, request) pairs, pulled as room frees up and offered together (`offer`: checked,
tokenized and routed in this thread; one the parent refuses comes back at once as (key, its
`RequestResult`)), with at most `max_in_flight` across all replicas. Out: lists of (key,
`RequestResult`) from `collect`, one list per wait: an output (with `finish_reason="error"`
when it failed running or its replica died), or the `RequestError` with which the checks
refused it. The rows in flight when the job stops are aborted on their replicas. Imports no
jax.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from hetero_jax.outputs import RequestResult

WAIT_S = 1.0  # one collect's wait: how often an idle front looks for its next results


class ReplicaFront:
    def __init__(self, replicas, max_in_flight: int):
        assert max_in_flight >= 1, f"{max_in_flight=} must be >= 1"
        self.replicas, self.max_in_flight = replicas, max_in_flight

    def serve(self, items: Iterable[tuple]) -> Iterator[list]:
        items, keys = iter(items), {}  # keys: tag -> key, for the requests in flight
        try:
            while True:
                refused, exhausted = self._admit(items, keys)
                done = [(keys.pop(tag), result)
                        for tag, result in (self.replicas.collect(WAIT_S) if keys else [])]
                if refused or done:
                    yield refused + done
                if exhausted and not keys:
                    return
        finally:
            self.replicas.abort(list(keys))

    def _admit(self, items: Iterator, keys: dict) -> tuple[list, bool]:
        """Submit requests until `max_in_flight` are out, in one call; -> (the refused ones
        as (key, error), whether `items` ran out)."""
        fresh, exhausted = [], False
        while len(keys) + len(fresh) < self.max_in_flight:
            item = next(items, None)
            if item is None:
                exhausted = True
                break
            fresh.append(item)
        if not fresh:
            return [], exhausted
        tags, refused = self.replicas.offer([request for _, request in fresh])
        for position, tag in tags.items():
            keys[tag] = fresh[position][0]
        return [(fresh[p][0], RequestResult(error=e)) for p, e in refused.items()], exhausted
