"""Replicas as Ray actors: `ReplicaSet`'s API over a Ray cluster (the optional `ray` extra).

In: requests through `run` (and `generate`/`embed`) or `submit`/`collect`/`abort` (what the
batch job's `ReplicaFront` drives). Out: what `ReplicaSet` gives: one engine's outputs,
numbered and seeded as one engine would, in input order.

Each replica is an `EngineActor` (one whole `Engine`, `num_cpus=1` and `num_gpus` per
replica, by default its `tensor_parallel` GPUs on a GPU cluster; on CPUs one XLA thread and
`tensor_parallel` host devices through the actor's `runtime_env`: `actor_resources`) built
from the same
`ModelSource`. The driver routes every request with `placement.Placement` (the router, the
loads, the engine's page digests), then sends each replica its share of a `submit` as one
actor call, `EngineActor.serve([(tag, request)])`, which drives its engine through a
`drive.Drive` (a refused request comes back as its `RequestError`) until all of them finished
and returns `([(tag, RequestResult)], failure, stats)` (`failure`: None, or the (tags, reason)
of a step that failed with no request to blame). Calls to one actor run in order; `collect`
waits on the calls in flight (`ray.wait`). A call whose actor died (`RayActorError`) fails its
requests with a RuntimeError naming the replica; the router sends nothing more there; the
others go on. `abort` drops a request's result (its call still runs to its end).
`ray.init(address)` joins a cluster, or with no address starts a local one; an address that
takes no TCP connection within `PROBE_S` is a ValueError naming it, before `ray.init` (which
would retry it for minutes). Imports no jax (the actors do).
"""
from __future__ import annotations

import os
import re
import socket

from hetero_jax.config import EngineConfig, config_or_default
from hetero_jax.models.presets import preset_config
from hetero_jax.sched.router import RouterConfig
from hetero_jax.serving.placement import router_policy
from hetero_jax.serving.processes import ModelSource, one_thread_flags
from hetero_jax.serving.drive import Drive
from hetero_jax.serving.replica_worker import engine_info
from hetero_jax.serving.routed import RoutedReplicas

PROBE_S = 5.0  # how long an address may take to accept a TCP connection


def require_ray():
    """The `ray` module, or a ValueError that says how to install it."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray / RayReplicaSet needs ray, which is not installed: pip install "
                         "'hetero-jax[ray]'") from None
    return ray


def join_cluster(ray, address: str | None) -> bool:
    """`ray.init(address)` unless this process is in a cluster already (None: start a local
    one); -> whether it started one. An address it cannot reach is a ValueError naming it."""
    if ray.is_initialized():
        return False
    if address is not None:
        probe_address(address)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise ValueError(f"cannot reach the Ray cluster at {address!r}: {e}") from None
    return True


def probe_address(address: str, timeout_s: float = PROBE_S) -> None:
    """A `host:port` (or `ray://host:port`) address that takes no TCP connection within
    `timeout_s` is a ValueError naming it (`ray.init` would retry it for minutes); other
    forms ('auto') are left to `ray.init`."""
    match = re.fullmatch(r"(?:ray://)?\[?([^\[\]]+?)\]?:(\d+)", address)
    if match is None:
        return
    try:
        socket.create_connection((match[1], int(match[2])), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(f"cannot reach the Ray cluster at {address!r}: "
                         f"{e.strerror or type(e).__name__} (no TCP connection within "
                         f"{timeout_s:g} s)") from None


def actor_resources(config: EngineConfig, gpus_each: float) -> tuple:
    """(num_gpus, runtime_env) of one engine actor: on a GPU cluster (`gpus_each` > 0) its
    `tensor_parallel` GPUs at least (Ray gives the actor those devices); else one CPU with one
    XLA thread, showing jax `tensor_parallel` host devices to shard over."""
    tp = config.tensor_parallel
    if gpus_each:
        return max(gpus_each, tp), None
    flags = one_thread_flags(os.environ.get("XLA_FLAGS", ""))
    if tp > 1:
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags).strip()
        # first: XLA's parser stops at the bare `intra_op_parallelism_threads=1` of the
        # one-thread flags, so a flag after it would be ignored
        flags = f"--xla_force_host_platform_device_count={tp} {flags}".strip()
    return 0, {"env_vars": {"XLA_FLAGS": flags}}


class EngineActor:
    """One engine in a Ray worker (made a Ray actor class by `RayReplicaSet`)."""

    def __init__(self, source: ModelSource, config: EngineConfig):
        from hetero_jax.serving.engine import Engine  # imports jax: only inside the actor

        self.engine = Engine.from_source(source, config)

    def info(self) -> dict:
        return engine_info(self.engine)

    def serve(self, items: list) -> tuple:
        """[(tag, request)] -> ([(tag, RequestResult)], failure, stats): every tag once,
        refused at once, finished by the engine, or in `failure` = (tags, reason) when a step
        failed with no request to blame (None otherwise)."""
        drive = Drive(self.engine)
        results = drive.admit(items)
        try:
            for finished in drive.steps():
                results += finished
        except Exception as e:  # noqa: BLE001 - no request to blame: fail this call's own
            why = f"a replica failed a step: {type(e).__name__}: {e}"
            return results, (drive.abort_all(), why), self.engine.stats
        return results, None, self.engine.stats


class RayReplicaSet(RoutedReplicas):
    """`num_replicas` engines as Ray actors behind a `Router` (module docstring)."""

    def __init__(self, spec: ModelSource, num_replicas: int, config: EngineConfig | None = None,
                 router: RouterConfig | str | None = None, address: str | None = None,
                 num_gpus: float | None = None):
        """`address`: a Ray cluster to join (None: start a local one, or use the one this
        process already started); `num_gpus`: per replica (None: `config.tensor_parallel`
        when the cluster has GPUs, else none)."""
        ray = self._ray = require_ray()
        config = config_or_default(config)
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or \
                num_replicas < 1:
            raise ValueError(f"replicas={num_replicas!r} must be an integer >= 1")
        router_policy(router, config)
        self.actors, self._owns_ray = [], join_cluster(ray, address)
        have = ray.cluster_resources()
        if num_gpus is None:
            num_gpus = config.tensor_parallel if have.get("GPU", 0) else 0
        gpus, env = actor_resources(config, num_gpus)
        for kind, each in (("CPU", 1), ("GPU", gpus)):
            if each and num_replicas * each > have.get(kind, 0):
                self.close()
                raise ValueError(f"replicas={num_replicas} needs {each:g} {kind} each; the Ray "
                                 f"cluster has {have.get(kind, 0):g}")
        actor = ray.remote(num_cpus=1, num_gpus=gpus)(EngineActor)
        self.actors = [actor.options(runtime_env=env).remote(spec, config)
                       for _ in range(num_replicas)]
        try:
            infos = ray.get([a.info.remote() for a in self.actors])
        except ray.exceptions.RayError as e:
            self.close()
            raise RuntimeError(f"a replica could not build its engine: {e}") from None
        self._calls: dict = {}  # ObjectRef of a `serve` call -> (replica, its tags)
        self._setup(spec, infos[0], num_replicas, router)

    @classmethod
    def from_preset(cls, name: str, num_replicas: int, seed: int = 0,
                    config: EngineConfig | None = None, **kw) -> "RayReplicaSet":
        preset_config(name)  # an unknown name fails here, before Ray starts
        return cls(ModelSource(preset=name, seed=seed), num_replicas, config, **kw)

    @classmethod
    def from_pretrained(cls, path: str, num_replicas: int, config: EngineConfig | None = None,
                        **kw) -> "RayReplicaSet":
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model directory {path!r} does not exist")
        return cls(ModelSource(path=path), num_replicas, config, **kw)

    def close(self) -> None:
        """End the actors (and the local Ray cluster this set started)."""
        for actor in self.actors:
            self._ray.kill(actor)
        self.actors = []
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()

    def __enter__(self) -> "RayReplicaSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def collect(self, timeout: float | None = None) -> list:
        """(tag, `RequestResult`) of every call that finished, waiting
        up to `timeout` seconds for the first; [] if none did."""
        ray = self._ray
        if not self._calls:
            return []
        ready, _ = ray.wait(list(self._calls), num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(list(self._calls), num_returns=len(self._calls), timeout=0)
        out = []
        for ref in ready:
            replica, tags = self._calls.pop(ref)
            try:
                results, failure, stats = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                with self._lock:
                    out += self._fail(replica, tags, lambda n: f"replica {replica} (a Ray "
                                      f"actor) died ({type(e).__name__}); its {n} requests "
                                      "in flight failed")
                continue
            with self._lock:
                self.replica_stats[replica] = stats
                out += [x for x in (self._finish(*r) for r in results) if x is not None]
                out += self._lost(*failure) if failure is not None else []
        return out

    def _dispatch(self, batches: dict, stream: bool) -> None:
        """One `serve` call per replica; `stream` is ignored: a call returns when all of its
        requests end, so a stream gets one delta, the finished one."""
        for replica, items in batches.items():
            ref = self.actors[replica].serve.remote(items)
            self._calls[ref] = (replica, [tag for tag, _ in items])

    def _drop(self, batches: dict) -> None:
        """Nothing to tell: a call runs to its end, and its dropped results are ignored."""
