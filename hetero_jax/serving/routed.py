"""What every set of replicas behind the router shares (imports no jax).

`RoutedReplicas` is the engine-shaped half of `ReplicaSet` (processes) and `RayReplicaSet`
(Ray actors): `submit` checks, tokenizes, routes (`placement.Placement`) and seeds requests
and hands each replica its share (`_dispatch`, the subclass's transport); `offer` does the
same but hands back the refused ones instead of raising; `collect` (the subclass's) turns what
comes back into (tag, `RequestResult`) through `_finish`, `_lost` for the requests of a
replica that failed a step, or `_fail` for those of a replica that died; `abort` forgets
requests (`_drop` tells the replicas); `run` (and through `batch_api` `generate`/`embed`) is
submit + collect until all are back. A refused request's `RequestError` names it by its
index in its caller's list (`RequestError.at`), never by editing a message.
A tag is the request id one engine would have given the request; outputs keep it, and times
count from `submit`. One lock guards the flights, so an asyncio front may `submit` on its
event loop while a thread waits in `collect`.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time

from hetero_jax.outputs import EngineStats, RequestError, RequestResult, sum_stats
from hetero_jax.serving.batch_api import BatchAPI
from hetero_jax.serving.client import StepTimes
from hetero_jax.serving.input_processor import check_request_type, expand_samples
from hetero_jax.serving.output_processor import renumbered
from hetero_jax.serving.placement import Placement, error_output


@dataclasses.dataclass
class Flight:
    replica: int
    cost: int  # tokens counted against the replica's load
    request: object
    index: int  # how errors name the request (its index in its caller's list, or 0)
    start: float  # perf_counter at submit


class RoutedReplicas(BatchAPI):
    def _setup(self, spec, info: dict, num_replicas: int, router) -> None:
        """State from a replica's `engine_info`, once every replica is up."""
        self.num_replicas, self.config = num_replicas, info["config"]
        self.model_cfg, self.embedding_dim = info["model_cfg"], info["embedding_dim"]
        self.placement = Placement(spec, info, num_replicas, router)
        self.router, self.tokenizer = self.placement.router, self.placement.tokenizer
        self.alive = [True] * num_replicas
        self.replica_stats = [EngineStats() for _ in range(num_replicas)]
        # per replica (its steps' StepTimes, its running requests by kind), as it last said
        self.replica_load = [(StepTimes(), {}) for _ in range(num_replicas)]
        self._flights: dict = {}  # tag -> Flight, for the requests in flight
        self._tags = itertools.count()
        self._lock = threading.Lock()

    def _dispatch(self, batches: dict, stream: bool) -> None:
        """Send each replica its [(tag, request)] ({replica: items}); `stream`: ask for
        their per-step deltas (a transport that cannot stream reports them at the end)."""
        raise NotImplementedError

    def _drop(self, batches: dict) -> None:
        """Tell the replicas to drop these tags ({replica: tags})."""
        raise NotImplementedError

    def collect(self, timeout: float | None = None) -> list:
        raise NotImplementedError

    def _running(self, replica: int) -> bool:
        """Whether the replica's process is still there, asked before routing to it (its
        requests in flight fail when `collect` hears of its end, as before)."""
        return True

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def in_flight(self) -> int:
        return len(self._flights)

    @property
    def stats(self) -> EngineStats:
        """Every replica's `EngineStats`, its counts summed (per replica: `replica_stats`)."""
        return sum_stats(self.replica_stats)

    @property
    def load(self) -> tuple:
        """(the replicas' step times as one `StepTimes`, their running requests by kind), as
        they last reported them (a transport that does not: empty)."""
        running: dict = {}
        for _, counts in self.replica_load:
            for kind, n in counts.items():
                running[kind] = running.get(kind, 0) + n
        return StepTimes.merged(steps for steps, _ in self.replica_load), running

    @property
    def worker_stats(self) -> dict:
        """{"replica i": EngineStats} (as every engine gives them)."""
        return {f"replica {i}": s for i, s in enumerate(self.replica_stats)}

    def run(self, requests: list, use_tqdm: bool = True) -> list:
        """Serve the requests on the replicas; outputs in input order (`n` in a row for
        `SamplingParams(n=...)`). A request the checks refuse raises, naming its index (the
        others are aborted); one that fails running, or whose replica dies, comes back with
        `finish_reason="error"`. `use_tqdm` is accepted for API parity and ignored."""
        if self._flights:
            raise RuntimeError(f"the replicas are serving {len(self._flights)} other requests "
                               "(an AsyncReplicas' or a front's): use that front, or wait")
        tags = self.submit(expand_samples(list(requests)))  # n samples: n requests
        results: dict = {}
        try:
            while len(results) < len(tags):
                for tag, result in self.collect(timeout=1.0):
                    if result.error is not None:
                        raise result.error
                    results[tag] = result.output
        finally:
            self.abort([t for t in tags if t not in results])
        return [results[t] for t in tags]

    def submit(self, requests: list, stream: bool = False) -> list:
        """Check, route and send requests; -> their tags (= request ids), in order. A request
        of the wrong type or whose input cannot be tokenized raises before any is sent,
        naming its index. `stream`: `collect` also gives each generation's per-step deltas
        (on replicas that stream: `ReplicaSet`'s processes, not Ray's actors)."""
        keys = [self._key(i, r) for i, r in enumerate(requests)]
        return self._route(list(enumerate(requests)), keys, stream)

    def offer(self, requests: list) -> tuple[dict, dict]:
        """As `submit`, but a request the checks refuse is not sent and raises nothing: ->
        ({position: tag} of those sent, {position: RequestError} of those refused), every
        request named as index 0, as alone (a TypeError is a RequestError of "params")."""
        keys, refused = {}, {}
        for i, r in enumerate(requests):
            try:
                keys[i] = self._key(0, r)
            except RequestError as e:
                refused[i] = e
            except TypeError as e:
                refused[i] = RequestError(0, "params", str(e))
        tags = self._route([(0, requests[i]) for i in keys], list(keys.values()))
        return dict(zip(keys, tags)), refused

    def _key(self, index: int, r) -> tuple:
        check_request_type(index, r)
        return self.placement.key(index, r)

    def _route(self, named: list, keys: list, stream: bool = False) -> list:
        """Route and send [(index errors name it by, request)] with their placement keys ->
        their tags."""
        live = [k for k in range(self.num_replicas) if self.alive[k] and self._running(k)]
        if not live:
            raise RuntimeError(f"every one of the {self.num_replicas} replicas is down")
        batches, tags = {}, []  # replica -> [(tag, request)]
        with self._lock:
            start = time.perf_counter()
            for (i, r), key in zip(named, keys):
                tag = next(self._tags)
                replica = self.placement.place(*key, live)
                r = self.placement.seeded(tag, r)
                self._flights[tag] = Flight(replica, key[1], r, i, start)
                batches.setdefault(replica, []).append((tag, r))
                tags.append(tag)
        self._dispatch(batches, stream)
        return tags

    def abort(self, tags) -> None:
        """Drop requests wherever they are (unknown or finished tags are ignored)."""
        batches: dict = {}
        with self._lock:
            for tag in tags:
                flight = self._flights.pop(tag, None)
                if flight is not None:
                    self.placement.release(flight.replica, flight.cost)
                    batches.setdefault(flight.replica, []).append(tag)
        self._drop(batches)

    def _finish(self, tag, result: RequestResult):
        """A replica's (tag, RequestResult) -> (tag, the caller's RequestResult), or None for
        a dropped tag: the output numbered and timed as one engine's, the error naming the
        request by its index in its caller's list."""
        flight = self._flights.pop(tag, None)
        if flight is None:
            return None
        self.placement.release(flight.replica, flight.cost)
        if result.error is not None:
            return tag, RequestResult(error=result.error.at(flight.index))
        return tag, RequestResult(renumbered(result.output, tag, flight.start))

    def _lost(self, tags, why: str) -> list:
        """These requests failed with no output of their own (`why`) -> (tag, RequestResult)."""
        lost = [(tag, self._flights.pop(tag)) for tag in tags if tag in self._flights]
        for _, f in lost:
            self.placement.release(f.replica, f.cost)
        return [(tag, RequestResult(error_output(tag, f.request, f.start, why)))
                for tag, f in lost]

    def _fail(self, replica: int, tags, why) -> list:
        """`replica` is gone: these of its requests fail with `why(count)`; the router sends
        nothing more there."""
        lost = self._lost(tags, why(sum(1 for tag in tags if tag in self._flights)))
        if self.alive[replica]:
            self.alive[replica] = False
            self.placement.forget(replica)
        return lost
