"""The batch job as a Ray Data pipeline (`hetero-jax batch --ray-data`; the `ray` extra).

In: the (row, request) pairs the job's `Feed` yields: the driver reads the input itself (not
`ray.data.read_json`), so the ids OUTPUT holds are skipped and the bad rows go to ERRORS with
their line numbers before the pipeline starts. `RayDataFront.serve` numbers the pairs and
makes one dataset row of each, `{"i": its number, "request": the request, pickled}`
(`ray.data.from_items`, in blocks of at most `batch_size` rows, a block a batch), and maps
them with `map_batches(EngineBatcher, compute=ActorPoolStrategy(size=N), num_cpus=1,
num_gpus=g)`: an actor pool of N engines (one GPU each when the cluster has GPUs, else one
XLA thread each), one batch in flight per actor, so at most `max_in_flight` rows run at a
time. An `EngineBatcher` drives its engine through a `drive.Drive` until every request of its
batch finished (one the engine's checks refuse comes back at once as its `RequestError`) and
returns `{"i", "result": its `RequestResult`, pickled, "stats": its EngineStats, pickled, in
the first row}` (as a generator yielding each step's results it
gained nothing: Ray Data merged the yields into one block).

Out: the driver iterates the mapped dataset (`iter_batches`, a block as each batch finishes)
and hands each back to `offline.job.run_job` as a list of (row, result), which writes it
through the same `OutputJournal` and `ErrorLog` as every other front: resume, the errors file
and the tally are the job's, not Ray's. A step that fails, with no one request to blame,
fails the pipeline and so the job, as `EngineFront` does (the rows written are kept; a rerun
resumes). The front is also the job's "engine" for the CLI: `model_cfg`, `stats` (every
actor's latest, summed) and `close` (shuts down the local Ray cluster it started). Imports no
jax (the actors do).
"""
from __future__ import annotations

import importlib.util
import math
import pickle
import uuid
from collections.abc import Iterable, Iterator

from hetero_jax.config import EngineConfig
from hetero_jax.models.presets import preset_config
from hetero_jax.outputs import EngineStats, sum_stats
from hetero_jax.serving.processes import ModelSource
from hetero_jax.serving.ray_replicas import actor_resources, join_cluster, require_ray
from hetero_jax.serving.drive import Drive


def require_data():
    """The `ray` module with `ray.data` imported, or a ValueError that says how to install
    it."""
    ray = require_ray()
    try:
        import ray.data  # noqa: F401 - pyarrow and pandas, from ray's `data` extra
    except ImportError as e:
        raise ValueError(f"--ray-data needs Ray Data, which does not import ({e}): pip "
                         "install 'ray[data]'") from None
    return ray


class EngineBatcher:
    """One engine in a Ray Data actor: a callable class for `map_batches`."""

    def __init__(self, source: ModelSource, config: EngineConfig):
        from hetero_jax.serving.engine import Engine  # imports jax: only inside the actor

        self.engine = Engine.from_source(source, config)
        self.name = uuid.uuid4().hex  # tells this actor's stats from the others'

    def __call__(self, batch: dict) -> dict:
        """{"i": [B], "request": [B] pickled} -> {"i", "result", "stats"}: every i once with
        its `RequestResult`, refused at once or finished by the engine."""
        results = Drive(self.engine).run([(int(i), pickle.loads(blob))
                                          for i, blob in zip(batch["i"], batch["request"])])
        # a step that raises here fails the pipeline, and the job
        stats = [pickle.dumps((self.name, self.engine.stats))] + [b""] * (len(results) - 1)
        return {"i": [i for i, _ in results], "result": [pickle.dumps(r) for _, r in results],
                "stats": stats}


class RayDataFront:
    """The batch job's `Front` over a Ray Data actor pool of `num_replicas` engines (module
    docstring); `max_in_flight` across all of them sets the rows of a batch."""

    def __init__(self, spec: ModelSource, model_cfg, num_replicas: int, config: EngineConfig,
                 max_in_flight: int, address: str | None = None, num_gpus: float | None = None):
        """`address`: a Ray cluster to join (None: start a local one, or use the one this
        process already started); `num_gpus` per engine (None: 1 if the cluster has GPUs)."""
        assert num_replicas >= 1 and max_in_flight >= 1, f"{num_replicas=} {max_in_flight=}"
        self._ray = ray = require_data()
        self.spec, self.model_cfg, self.config = spec, model_cfg, config
        self.num_replicas, self.max_in_flight = num_replicas, max_in_flight
        self._owns_ray = join_cluster(ray, address)
        have = ray.cluster_resources()
        tp = config.tensor_parallel  # GPUs per engine (None: its TP degree if there are GPUs)
        self.num_gpus = (tp if have.get("GPU", 0) else 0) if num_gpus is None else num_gpus
        for kind, each in (("CPU", 1), ("GPU", self.num_gpus)):
            if each and num_replicas * each > have.get(kind, 0):
                self.close()
                raise ValueError(f"replicas={num_replicas} needs {each:g} {kind} each; the Ray "
                                 f"cluster has {have.get(kind, 0):g}")
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False  # the job has its own bar
        context.print_on_execution_start = False
        self._stats: dict = {}  # actor name -> its latest EngineStats

    def batch_size(self, rows: int) -> int:
        """Rows per batch: each engine's share of `max_in_flight`, and no more than an even
        split of `rows`, so a short job still spreads over every engine."""
        per_engine = math.ceil(self.max_in_flight / self.num_replicas)
        return max(1, min(per_engine, math.ceil(rows / self.num_replicas)))

    def serve(self, items: Iterable[tuple]) -> Iterator[list]:
        keys, records = [], []
        for key, request in items:
            records.append({"i": len(keys), "request": pickle.dumps(request)})
            keys.append(key)
        if not records:
            return
        for block in self._pipeline(records).iter_batches(batch_size=None,
                                                          batch_format="numpy"):
            for blob in block["stats"][:1]:  # the batch's engine stats, in its first row
                name, stats = pickle.loads(blob)
                self._stats[name] = stats
            yield [(keys[i], pickle.loads(r)) for i, r in zip(block["i"], block["result"])]

    def _pipeline(self, records: list):
        """The dataset of `records` mapped by the actor pool of engines (not yet run)."""
        ray, size = self._ray, self.batch_size(len(records))
        gpus, env = actor_resources(self.config, self.num_gpus)  # as the replicas' actors
        pool = ray.data.ActorPoolStrategy(size=self.num_replicas, max_tasks_in_flight_per_actor=1)
        # batch_size=None: a block is one batch, so it comes back as soon as it is done (a
        # batch_size would bundle blocks until they hold that many rows, and hold both back)
        data = ray.data.from_items(records, override_num_blocks=math.ceil(len(records) / size))
        return data.map_batches(EngineBatcher, fn_constructor_args=(self.spec, self.config),
                                batch_size=None, batch_format="numpy", compute=pool, num_cpus=1,
                                num_gpus=gpus or None, runtime_env=env)

    @property
    def stats(self) -> EngineStats:
        """Every actor's latest `EngineStats`, its counts summed."""
        return sum_stats(list(self._stats.values()))

    def close(self) -> None:
        """Shut down the local Ray cluster this front started (the pool's actors end with
        the pipeline)."""
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()


def check_ray_data(parser, args) -> None:
    """`--ray-data` needs ray with its `data` extra (the error names the flag and what is
    missing); it runs on `--ray`'s cluster, a local one unless `--ray ADDRESS`."""
    if not args.ray_data:
        return
    missing = [name for name in ("ray", "pyarrow", "pandas") if importlib.util.find_spec(name)
               is None]
    if missing:
        parser.error(f"argument --ray-data: needs ray with Ray Data, and {', '.join(missing)} "
                     f"{'is' if len(missing) == 1 else 'are'} not installed (pip install "
                     "'hetero-jax[ray]')")
    if args.ray is None:
        args.ray = "local"


def make_front(args, config: EngineConfig, in_flight: int) -> tuple:
    """`offline.cli.make_front` for `--ray-data`: -> (the front, which is also the job's
    engine, where it runs in words). One GPU per engine when the cluster has GPUs."""
    if args.model:
        from hetero_jax.models.formats.hf_llama import read_model_config

        spec, model_cfg = ModelSource(path=args.model), read_model_config(args.model)
    else:
        spec, model_cfg = ModelSource(preset=args.preset, seed=args.seed), \
            preset_config(args.preset)
    address = None if args.ray in (None, "local") else args.ray
    front = RayDataFront(spec, model_cfg, args.replicas, config, in_flight, address)
    where = (f"a Ray Data pipeline (map_batches over a pool of {args.replicas} engine actors, "
             f"{front.num_gpus or 'no'} GPU each)")
    return front, where
