"""Replicas: N engines in N worker processes behind the router, with one engine's API.

In: `GenerateRequest`s / `EmbedRequest`s, through `run` (and `generate`/`embed`, `batch_api`)
or, request by request, `submit` and `collect` (what `AsyncReplicas` and the batch job's
`ReplicaFront` drive). Out: the same `RequestOutput`s / `EmbeddingOutput`s one `Engine` gives
for the same requests, numbered and seeded as one engine would (request ids in submission
order; a prompt without a seed samples with the seed its id gives it), times from `submit`.

Processes and threads. Each replica is a whole `Engine` in a spawned process pinned to its
own core with one XLA thread (`processes.child_env`; this module imports no jax). On a host with
GPUs each replica also gets its own `tensor_parallel` of them, replica i the parent's GPUs
[i * tp, (i + 1) * tp), through the child's CUDA_VISIBLE_DEVICES (`device_groups`; more
replicas than the GPUs serve is refused before any process starts). The parent
talks to it through one duplex pipe: `("add", [(tag, request)])` (`("stream", ...)` for requests
submitted with `stream=True`), `("abort", [tag])`, `("warmup", None)`, `("close", None)`. The
worker steps while it has work and reads the pipe between steps; after each step it sends
`("deltas", [(tag, GenerateDelta)])` for the streamed generations that step gave tokens (which
`collect` hands on as `RequestResult(delta=...)`), then `("done", ([(tag, RequestResult)],
stats, load))` for the requests that finished, and at once the `RequestError`s of those its checks
refused. A step
that fails with no request to blame sends `("failed", (tags, reason))`: every request of that
replica fails (`finish_reason="error"`), and the replica goes on serving. One reader thread
per replica moves its messages, and `("dead", exit code)` when its pipe closes, onto one queue that
`collect` drains in the caller's thread, so a worker never blocks on a full pipe.

Routing (`placement.Placement` over `sched.router`): the parent tokenizes each request with
the model's tokenizer, counts its tokens (input, plus `max_tokens` for a prompt) as its
replica's load until it finishes, and with prefix caching hashes its prompt's full pages
under the chain seed the engine would give them, so the router sees the digests each
replica's cache holds (`routed.RoutedReplicas` holds what this and `RayReplicaSet` share). A
replica whose process dies fails its requests in flight with a RuntimeError naming it, its
exit code and their count; the router sends nothing more there (`submit` asks whether each
process is alive before it routes, so a replica that died idle gets no work either); the
others go on.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import queue
import threading
import weakref

from hetero_jax.config import EngineConfig, config_or_default
from hetero_jax.models.presets import preset_config
from hetero_jax.outputs import RequestResult
from hetero_jax.sched.router import RouterConfig
from hetero_jax.serving.device_groups import device_groups, visible_gpus
from hetero_jax.serving.placement import router_policy
from hetero_jax.serving.processes import ModelSource, child_env, remote_error, stop_workers
from hetero_jax.serving.replica_worker import reader, worker
from hetero_jax.serving.routed import RoutedReplicas


class ReplicaSet(RoutedReplicas):
    """`num_replicas` engines in their own processes, one core (and, on a GPU host, one
    group of `tensor_parallel` GPUs: `self.gpus`) each, behind a `Router`."""

    def __init__(self, spec: ModelSource, num_replicas: int, config: EngineConfig | None = None,
                 router: RouterConfig | str | None = None, cores: tuple | None = None):
        """`router`: "least-tokens", "prefix-affinity" or a `RouterConfig` (default:
        prefix-affinity when `config.prefix_caching`, else least-tokens; its LRU then holds
        each replica's KV pool). `cores`: one per replica (default: the first allowed)."""
        config = config_or_default(config)
        allowed = sorted(os.sched_getaffinity(0))
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or \
                num_replicas < 1:
            raise ValueError(f"replicas={num_replicas!r} must be an integer >= 1")
        cores = tuple(cores) if cores is not None else tuple(allowed[:num_replicas])
        if num_replicas > len(allowed) or len(cores) != num_replicas:
            raise ValueError(f"replicas={num_replicas} needs one CPU core each; this process "
                             f"may use {len(allowed)} ({', '.join(map(str, allowed))})")
        if config.scheduler == "dedicated":
            raise ValueError("scheduler='dedicated' is an engine of its own; replicas run one "
                             "Engine each: pick ibs, fcfs or homogeneous")
        router_policy(router, config)  # a bad router fails here, before any process starts
        self.gpus = device_groups(num_replicas, config.tensor_parallel, visible_gpus())
        self.cores, self.num_replicas = cores, num_replicas
        self._events: queue.Queue = queue.Queue()
        self._conns, self._procs = self._start(spec, config)
        self._finalizer = weakref.finalize(self, stop_workers, list(self._procs), list(self._conns))
        self._setup(spec, self._wait_ready(), num_replicas, router)

    @classmethod
    def from_preset(cls, name: str, num_replicas: int, seed: int = 0,
                    config: EngineConfig | None = None, **kw) -> "ReplicaSet":
        preset_config(name)  # an unknown name fails here, before any process starts
        return cls(ModelSource(preset=name, seed=seed), num_replicas, config, **kw)

    @classmethod
    def from_pretrained(cls, path: str, num_replicas: int, config: EngineConfig | None = None,
                        embed_model: str | None = None, embed_adapter: str | dict | None = None,
                        **kw) -> "ReplicaSet":
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model directory {path!r} does not exist")
        spec = ModelSource(path=path, embed_model=embed_model, embed_adapter=embed_adapter)
        return cls(spec, num_replicas, config, **kw)

    def _start(self, spec: ModelSource, config: EngineConfig) -> tuple:
        ctx = multiprocessing.get_context("spawn")
        conns, procs = [], []
        for i, core in enumerate(self.cores):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker, name=f"hetero-jax-replica-{i}", daemon=True,
                               args=(i, core, spec, config, child))
            gpus = {} if self.gpus is None else {"CUDA_VISIBLE_DEVICES": self.gpus[i]}
            with child_env(**gpus):
                proc.start()
            child.close()
            conns.append(parent)
            procs.append(proc)
            threading.Thread(target=reader, args=(i, parent, proc, self._events),
                             name=f"hetero-jax-replica-{i}-reader", daemon=True).start()
        return conns, procs

    def _wait_ready(self) -> dict:
        """Every replica's ready message; a replica that cannot build its engine raises."""
        infos = {}
        while len(infos) < self.num_replicas:
            index, kind, payload = self._events.get()
            if kind == "ready":
                infos[index] = payload
                continue
            self.close()
            if kind == "dead":
                raise RuntimeError(f"replica {index} died while starting (exit code {payload})")
            raise remote_error(*payload[:2], f"replica {index} could not build its engine",
                               payload[2])
        return infos[0]

    def close(self) -> None:
        """End every replica process; the set cannot serve afterwards."""
        self._finalizer()

    def __enter__(self) -> "ReplicaSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- serving -----------------------------------------------------------------------------
    def warmup(self) -> int:
        """Compile every step variant in every replica (at the same time); the total."""
        if self._flights:
            raise RuntimeError(f"warmup with {len(self._flights)} requests in flight")
        live = [i for i in range(self.num_replicas) if self.alive[i]]
        for i in live:
            self._send(i, ("warmup", None))
        total, warmed = 0, set()
        while warmed != set(live):
            index, kind, payload = self._events.get()
            if kind == "dead":
                self._dead(index, payload)
                raise RuntimeError(f"replica {index} died during warmup (exit code {payload})")
            if kind == "warmed":
                total += payload
                warmed.add(index)
        return total

    def collect(self, timeout: float | None = None) -> list:
        """(tag, `RequestResult`) for requests that finished, and, before a streamed one's
        end, one with its `delta` for each step that gave it tokens; waits up to `timeout`
        seconds for the first; [] if none came."""
        try:
            events = [self._events.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                break
        out = []
        with self._lock:
            for index, kind, payload in events:
                if kind == "dead":
                    out += self._dead(index, payload)
                elif kind == "done":
                    results, self.replica_stats[index], load = payload
                    if load is not None:  # None: a refusal, sent between steps
                        self.replica_load[index] = load
                    out += [x for x in (self._finish(*r) for r in results) if x is not None]
                elif kind == "deltas":
                    out += [(tag, RequestResult(delta=d)) for tag, d in payload
                            if tag in self._flights]
                elif kind == "failed":
                    out += self._lost(*payload)
        return out

    # -- transport -----------------------------------------------------------------------
    def _running(self, replica: int) -> bool:
        # the sentinel closes when the process ends; is_alive() can say True for a dead one
        # while its reader thread is reaping it (two waitpid calls race)
        return not multiprocessing.connection.wait([self._procs[replica].sentinel], 0)

    def _dispatch(self, batches: dict, stream: bool) -> None:
        for replica, items in batches.items():
            self._send(replica, ("stream" if stream else "add", items))

    def _drop(self, batches: dict) -> None:
        for replica, tags in batches.items():
            self._send(replica, ("abort", tags))

    def _send(self, replica: int, message) -> None:
        """A message to a replica; a closed pipe means it died (its reader reports that)."""
        if self.alive[replica]:
            try:
                self._conns[replica].send(message)
            except (OSError, ValueError):
                pass

    def _dead(self, index: int, exitcode) -> list:
        """A replica's process ended: its requests in flight fail."""
        if not self.alive[index]:
            return []
        pid = self._procs[index].pid
        return self._fail(index, [t for t, f in self._flights.items() if f.replica == index],
                          lambda n: f"replica {index} (pid {pid}) died with exit code "
                          f"{exitcode}; its {n} requests in flight failed")
