"""Dedicated mode: the paper's static split, one embedding engine and one generation engine.

In: the same requests as `Engine.run` (`GenerateRequest`s and `EmbedRequest`s). Out: the same
`RequestOutput`s / `EmbeddingOutput`s, in input order, with request ids and metrics as one
engine would number and time them (`arrival_time` is when `run` was called).

Each engine runs in its own worker process (multiprocessing, spawn) on disjoint devices: on a
CPU each worker is pinned to its own core (`os.sched_setaffinity`) and XLA gets one thread
(`XLA_FLAGS` is set in the worker before it imports jax; this module imports no jax at the
top, so the worker can). The parent talks to each worker through one duplex pipe:
`("run", requests) -> ("ok", (outputs, stats))`, `("refused", RequestError)` (named by its
index in that worker's share: the parent renames it, `RequestError.at`) or `("error", (type,
message, traceback))`;
`("warmup", None) -> ("ok", compiles)`; `("close", None)` ends it. `run` sends the embedding
requests to one worker and the generation requests to the other, then waits for both, so the
two kinds run at the same time on their own cores and never share a step.

Requests are checked by type here and by content in the workers (the shared
`input_processor`); `generate`/`embed` come from the shared `batch_api`.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
import weakref

from hetero_jax.config import EngineConfig, config_or_default
from hetero_jax.models.presets import preset_config
from hetero_jax.outputs import RequestError
from hetero_jax.requests import EmbedRequest
from hetero_jax.serving.batch_api import BatchAPI
from hetero_jax.serving.input_processor import check_request_type, default_seed, expand_samples
from hetero_jax.serving.output_processor import renumbered
from hetero_jax.serving.processes import (ModelSource, child_env, described_error, remote_error,
                                          stop_workers)

EMBED_ROLE, GEN_ROLE = "embed", "generate"


def _worker(role: str, core: int, source: ModelSource, config: EngineConfig, conn) -> None:
    """Worker process: pin to `core`, one XLA thread, build the engine, serve the pipe."""
    from hetero_jax.serving.engine import Engine  # imports jax: only inside a worker

    os.sched_setaffinity(0, {core})  # XLA_FLAGS came from the parent (`child_env`)
    try:
        engine = Engine.from_source(source, config)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", described_error(e)))
        return
    conn.send(("ok", (engine.config, engine.embedding_dim)))
    while True:
        cmd, arg = conn.recv()
        if cmd == "close":
            return
        try:
            if cmd == "run":
                result = (engine.run(arg, use_tqdm=False), engine.stats)
            elif cmd == "warmup":
                result = engine.warmup()
            elif cmd == "reset_prefix_cache":
                result = engine.reset_prefix_cache()
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except RequestError as e:  # refused by the checks: crosses the pipe as itself
            conn.send(("refused", e))
            continue
        except Exception as e:  # noqa: BLE001 - the engine stays usable; the parent raises
            conn.send(("error", described_error(e)))
            continue
        conn.send(("ok", result))


class DedicatedEngine(BatchAPI):
    """An embedding engine and a generation engine in two processes on disjoint cores."""

    def __init__(self, source: ModelSource, config: EngineConfig | None = None,
                 cores: tuple | None = None):
        """`cores`: (embedding core, generation core); None picks the first two allowed
        cores (both share one if only one is allowed). `config.scheduler` is ignored: each
        engine serves one kind of request, in arrival order."""
        config = config_or_default(config)
        self.config = dataclasses.replace(config, scheduler="fcfs")
        if cores is None:
            allowed = sorted(os.sched_getaffinity(0))
            cores = (allowed[0], allowed[1 % len(allowed)])
        self.cores = dict(zip((EMBED_ROLE, GEN_ROLE), cores))
        ctx = multiprocessing.get_context("spawn")
        self._conns, self._procs = {}, {}
        sources = {EMBED_ROLE: source, GEN_ROLE: source.generation_only()}
        for role in (EMBED_ROLE, GEN_ROLE):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, name=f"hetero-jax-{role}", daemon=True,
                               args=(role, self.cores[role], sources[role], self.config, child))
            with child_env():
                proc.start()
            child.close()
            self._conns[role], self._procs[role] = parent, proc
        self._finalizer = weakref.finalize(self, stop_workers, list(self._procs.values()),
                                           list(self._conns.values()))
        resolved = {role: self._receive(role) for role in self._conns}
        self.config = resolved[GEN_ROLE][0]  # max_model_len etc. resolved against the model
        self.embedding_dim = resolved[EMBED_ROLE][1]
        self.stats: dict = {}  # role -> the EngineStats of that worker after the last run
        self._next_id = 0

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, seed: int = 0, config: EngineConfig | None = None,
                    cores: tuple | None = None) -> "DedicatedEngine":
        preset_config(name)  # an unknown name fails here, before any process starts
        return cls(ModelSource(preset=name, seed=seed), config, cores)

    @classmethod
    def from_pretrained(cls, path: str, config: EngineConfig | None = None,
                        embed_model: str | None = None, embed_adapter: str | dict | None = None,
                        cores: tuple | None = None) -> "DedicatedEngine":
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model directory {path!r} does not exist")
        return cls(ModelSource(path=path, embed_model=embed_model, embed_adapter=embed_adapter),
                   config, cores)

    def close(self) -> None:
        """End both workers; the engine cannot run afterwards."""
        self._finalizer()

    def __enter__(self) -> "DedicatedEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def worker_stats(self) -> dict:
        """{role: EngineStats} of each worker after its last run (as every engine gives)."""
        return dict(self.stats)

    # -- serving -----------------------------------------------------------------------------
    def warmup(self) -> int:
        """Compile every step variant in both workers (at the same time); returns the total."""
        for conn in self._conns.values():
            conn.send(("warmup", None))
        return sum(self._receive(role) for role in self._conns)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix in both workers (as `Engine.reset_prefix_cache`)."""
        for conn in self._conns.values():
            conn.send(("reset_prefix_cache", None))
        for role in self._conns:
            self._receive(role)

    def run(self, requests: list, use_tqdm: bool = True) -> list:
        """Embedding requests to one worker, generation requests to the other, at once;
        outputs in input order. `use_tqdm` is accepted for API parity and ignored."""
        start = time.perf_counter()
        requests = expand_samples(list(requests))
        split = {EMBED_ROLE: [], GEN_ROLE: []}  # role -> [(index, request)]
        for i, r in enumerate(requests):
            check_request_type(i, r)
            role = EMBED_ROLE if isinstance(r, EmbedRequest) else GEN_ROLE
            split[role].append((i, r if role == EMBED_ROLE else self._seeded(i, r)))
        sent = [role for role, items in split.items() if items]
        for role in sent:
            self._conns[role].send(("run", [r for _, r in split[role]]))
        results, errors = {}, []
        for role in sent:  # wait for every worker, even after one failed
            try:
                results[role], self.stats[role] = self._receive(role)
            except RequestError as e:  # named by its index in the worker's share
                errors.append(e.at(split[role][e.index][0]))
            except (ValueError, TypeError) as e:
                errors.append(e)
        if errors:
            raise errors[0]
        outs = [None] * len(requests)
        for role in sent:
            for (i, _), out in zip(split[role], results[role]):
                outs[i] = renumbered(out, self._next_id + i, start)
        self._next_id += len(requests)
        return outs

    # -- helpers -----------------------------------------------------------------------------
    def _seeded(self, index: int, r):
        """The request with the seed `Engine` would give it (its default depends on the id)."""
        if r.params.seed is not None:
            return r
        seed = default_seed(self.config.seed, self._next_id + index)
        return dataclasses.replace(r, params=dataclasses.replace(r.params, seed=seed))

    def _receive(self, role: str):
        """The worker's answer; raises its error, or RuntimeError if the worker died."""
        conn, proc = self._conns[role], self._procs[role]
        while not conn.poll(1.0):
            if not proc.is_alive():
                raise RuntimeError(f"the {role} worker (pid {proc.pid}) died with exit code "
                                   f"{proc.exitcode}")
        status, payload = conn.recv()
        if status == "ok":
            return payload
        if status == "refused":
            raise payload
        raise remote_error(*payload[:2], f"the {role} worker failed", payload[2])

