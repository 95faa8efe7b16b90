"""The `EngineClient` over engines in other processes: replicas (`AsyncReplicas`) and
dedicated mode's two workers (`AsyncDedicated`); both are the one front (`front.Front`).

`ReplicaCore` serves a `ReplicaSet` or `RayReplicaSet`: `submit` checks, tokenizes and routes
in the caller's coroutine (a request of the wrong type, or whose input cannot be tokenized,
raises `RequestError` there), then the request is on its replica. One collector thread waits
for the set's finished requests (`collect`, whose `RequestResult`s carry an output or the
`RequestError` with which the replica's checks refused the request) and delivers them: a
request that failed running or whose replica died raises `RequestFailed` (the others go on).
Generations are submitted with `stream=True`, so a `ReplicaSet`'s worker sends each step's
delta (built there from the host-side request by the same `drive.Drive` loop as the
in-process stepper's) and the collector hands it on as an `"out"` event, renamed with the
caller's id (`front.Flights`); the finished output's last delta is what it holds beyond the
ids and text already sent. (`RayReplicaSet` reports a request when it ends: its stream has
one delta, the finished one.) Aborting a request aborts it on its replica. `stats` sums
the replicas' counters; its step times and running requests are what the replicas last
reported with a finished request (`RoutedReplicas.load`; a Ray set reports none), its
`waiting` the others in flight, by kind. `close()` fails and aborts every request still in
flight; the replica processes stay up (close the set for that).

`DedicatedCore` serves a `DedicatedEngine`, whose only serving call is a batch `run()`: per
worker (embedding, generation) one `run()` at a time in its own thread; requests that arrive
while a worker's batch runs wait and the next batch takes all of them (a batch that raises
fails all of its requests with that error). Both workers run at once; `abort` only stops the
caller waiting, since a worker's batch runs whole. Imports no jax.
"""
from __future__ import annotations

import collections
import itertools
import threading

from hetero_jax.outputs import sum_stats
from hetero_jax.requests import EmbedRequest
from hetero_jax.serving.client import FrontStats, StepTimes
from hetero_jax.serving.front import Flights, Front, finished_event

POLL_S = 0.2  # how long one collect waits, so a stopped core's thread ends soon
EMBED, GEN = "embed", "generate"


def _kind(request) -> str:
    return EMBED if type(request) is EmbedRequest else GEN


class ReplicaCore:
    """A `front.Front`'s core over a replica set (module docstring)."""

    def __init__(self, replicas):
        self.replicas = replicas
        self._deliver = None
        self._flights = Flights()  # until delivered
        self._lock = threading.Lock()  # a tag is in `_flights` before the collector sees it
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def tokenizer(self):
        return self.replicas.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.replicas.max_model_len

    def open(self, deliver) -> None:
        self._deliver = deliver

    def submit(self, request, request_id) -> tuple:
        with self._lock:
            kind = _kind(request)
            (tag,) = self.replicas.submit([request], stream=kind == GEN)  # raises here
            rid = tag if request_id is None else request_id
            self._flights.add(tag, kind, rid)
        if self._thread is None:
            self._thread = threading.Thread(target=self._collect, daemon=True,
                                            name="hetero-jax-collect")
            self._thread.start()
        self._wake.set()
        return tag, rid

    def abort(self, tag) -> None:
        self._flights.pop(tag)
        self.replicas.abort([tag])

    def stats(self) -> FrontStats:
        """Running: as the replicas last reported; waiting: the rest of those in flight."""
        steps, running = self.replicas.load
        waiting = {kind: max(n - running.get(kind, 0), 0)
                   for kind, n in self._flights.kinds().items()}
        return FrontStats(self.replicas.stats, waiting, running, steps)

    def stop(self) -> None:
        """End the collector thread; abort every request still in flight."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self.replicas.abort(self._flights.tags())
        self._flights = Flights()

    def _collect(self) -> None:
        while not self._stopping:
            if not self._flights:  # idle until a request (or `stop`) sets it
                self._wake.wait()
                self._wake.clear()
                continue
            results = self.replicas.collect(POLL_S)
            with self._lock:
                events = [e for e in (self._flights.event(*r) for r in results) if e]
            if events:
                self._deliver(events)


class AsyncReplicas(Front):
    """The `EngineClient` of a `ReplicaSet` or `RayReplicaSet` (module docstring)."""

    def __init__(self, replicas):
        super().__init__(ReplicaCore(replicas))
        self.replicas = replicas


class DedicatedCore:
    """A `front.Front`'s core over a `DedicatedEngine` (module docstring)."""

    def __init__(self, dengine, tokenizer):
        self.dengine, self.tokenizer = dengine, tokenizer
        self.max_model_len = dengine.config.max_model_len
        self.batch_sizes: dict = {EMBED: [], GEN: []}  # per worker, each batch's requests
        self._deliver = None
        self._ids = itertools.count()
        self._queues = {k: collections.deque() for k in (EMBED, GEN)}  # (id, caller id, req)
        self._wake = {k: threading.Event() for k in self._queues}
        self._stopping = False
        self._threads: dict = {}

    def open(self, deliver) -> None:
        self._deliver = deliver

    def submit(self, request, request_id) -> tuple:
        cid = next(self._ids)
        rid = cid if request_id is None else request_id
        kind = _kind(request)
        self._queues[kind].append((cid, rid, request))
        if kind not in self._threads:
            self._threads[kind] = threading.Thread(target=self._serve, args=(kind,),
                                                   daemon=True, name=f"dedicated-{kind}")
            self._threads[kind].start()
        self._wake[kind].set()
        return cid, rid

    def abort(self, cid) -> None:
        """Nothing to do: a dedicated worker's batch runs whole."""

    def stats(self) -> FrontStats:
        return FrontStats(sum_stats(list(self.dengine.stats.values())), {}, {}, StepTimes())

    def stop(self) -> None:
        self._stopping = True
        for kind, thread in self._threads.items():
            self._wake[kind].set()
            thread.join()

    def _serve(self, kind: str) -> None:
        """One worker's batches, each `run` whole, until stopped."""
        queue = self._queues[kind]
        while not self._stopping:
            self._wake[kind].wait()
            self._wake[kind].clear()
            while queue and not self._stopping:
                batch = [queue.popleft() for _ in range(len(queue))]
                self.batch_sizes[kind].append(len(batch))
                try:
                    outs = self.dengine.run([r for _, _, r in batch], False)
                except Exception as e:  # noqa: BLE001 - the batch's callers get the error
                    self._deliver([(cid, "error", e) for cid, _, _ in batch])
                    continue
                self._deliver([finished_event(cid, kind, rid, out)
                               for (cid, rid, _), out in zip(batch, outs)])


class AsyncDedicated(Front):
    """The `EngineClient` of a `DedicatedEngine` (module docstring); `batch_sizes` holds
    each worker's batch sizes."""

    def __init__(self, dengine, tokenizer):
        super().__init__(DedicatedCore(dengine, tokenizer))
        self.dengine = dengine
        self.batch_sizes = self.core.batch_sizes
