"""What every set of replicas behind the router shares (imports no jax).

`RoutedReplicas` is the engine-shaped half of `ReplicaSet` (processes) and `RayReplicaSet`
(Ray actors): `submit` checks, tokenizes, routes (`placement.Placement`) and seeds requests
and hands each replica its share (`_dispatch`, the subclass's transport); `collect` (the
subclass's) turns what comes back into (tag, result) through `_finish`, or `_fail` for the
requests of a replica that died; `abort` forgets requests (`_drop` tells the replicas);
`run` (and through `batch_api` `generate`/`embed`) is submit + collect until all are back.
A tag is the request id one engine would have given the request; outputs keep it, and times
count from `submit`. One lock guards the flights, so an asyncio front may `submit` on its
event loop while a thread waits in `collect`.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time

from hetero_jax.outputs import EngineStats, sum_stats
from hetero_jax.serving.batch_api import BatchAPI
from hetero_jax.serving.dedicated import DedicatedEngine
from hetero_jax.serving.input_processor import check_request_type, expand_samples
from hetero_jax.serving.placement import Placement, error_output, renumber_error
from hetero_jax.serving.replica_worker import ERRORS


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
        self._flights: dict = {}  # tag -> Flight, for the requests in flight
        self._tags = itertools.count()
        self._lock = threading.Lock()

    def _dispatch(self, batches: dict) -> None:
        """Send each replica its [(tag, request)] ({replica: items})."""
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
                    if isinstance(result, Exception):
                        raise result
                    results[tag] = result
        finally:
            self.abort([t for t in tags if t not in results])
        return [results[t] for t in tags]

    def submit(self, requests: list, refuse: bool = False) -> list:
        """Check, route and send requests; -> their tags (= request ids), in order. A request
        of the wrong type or whose input cannot be tokenized raises before any is sent, naming
        its index; with `refuse` it takes its place in the list as that error instead (the
        others are sent), and every error names its request as index 0, as alone."""
        names = [0] * len(requests) if refuse else range(len(requests))  # as errors name them
        keyed = []
        for i, r in zip(names, requests):
            try:
                check_request_type(i, r)
                keyed.append(self.placement.key(i, r))
            except (ValueError, TypeError) as e:
                if not refuse:
                    raise
                keyed.append(e)
        live = [k for k in range(self.num_replicas) if self.alive[k] and self._running(k)]
        if not live:
            raise RuntimeError(f"every one of the {self.num_replicas} replicas is down")
        batches, out = {}, []  # replica -> [(tag, request)]
        with self._lock:
            start = time.perf_counter()
            for i, r, key in zip(names, requests, keyed):
                if isinstance(key, Exception):
                    out.append(key)
                    continue
                tag = next(self._tags)
                replica = self.placement.place(*key, live)
                r = self.placement.seeded(tag, r)
                self._flights[tag] = Flight(replica, key[1], r, i, start)
                batches.setdefault(replica, []).append((tag, r))
                out.append(tag)
        self._dispatch(batches)
        return out

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

    def _finish(self, result: tuple):
        """A replica's (tag, output, error) -> (tag, result), or None for a dropped tag."""
        tag, out, error = result
        flight = self._flights.pop(tag, None)
        if flight is None:
            return None
        self.placement.release(flight.replica, flight.cost)
        if error is not None:
            name, message = error
            if name in ERRORS:
                return tag, ERRORS[name](renumber_error(message, flight.index))
            return tag, error_output(tag, flight.request, flight.start, message)
        return tag, DedicatedEngine._renumber(out, tag, flight.start)

    def _fail(self, replica: int, tags, why) -> list:
        """`replica` is gone: these of its requests fail with `why(count)`; the router sends
        nothing more there."""
        if self.alive[replica]:
            self.alive[replica] = False
            self.placement.forget(replica)
        lost = [(tag, self._flights.pop(tag)) for tag in tags if tag in self._flights]
        message = why(len(lost))
        return [(tag, error_output(tag, f.request, f.start, message)) for tag, f in lost]
