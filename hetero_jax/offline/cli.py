"""`hetero-jax batch INPUT --output OUTPUT`: an offline batch job on one engine.

    hetero-jax batch INPUT --output OUTPUT [--errors PATH] [--preset mini | --model DIR]
                     [--replicas N] [--ray [ADDRESS]] [--ray-data] [--tensor-parallel N]
                     [--scheduler ibs] [--token-budget N] ...

In: argv. Every check runs before any model work, and before jax is imported but for
`--tensor-parallel N > 1`'s (against the model's heads and the devices jax sees, after the
file checks); each failure is a `parser.error` (exit status 2) naming the value: INPUT must
be a batch input (`rows.open_source`: a regular file, or a pipe, FIFO or `/dev/stdin`, read
once), OUTPUT and ERRORS regular files (or `-`: stdout, not resumable, and stderr) that can be
written, apart from each other and from INPUT, OUTPUT resumable (`OutputJournal.open` locks
it, reads the ids it holds and cuts a torn last line), ERRORS not another job's (locked). Then
`make_front` builds the engine and its front (the one place that knows what serves the rows:
one `Engine` stepped in this process, or with `--replicas N` a `ReplicaSet` of N engine
processes, one core each, behind the prefix-affinity router, or with `--ray` N Ray actors
(`RayReplicaSet`, a local cluster or the one at ADDRESS), both served by `ReplicaFront`),
`job.run_job` runs every row OUTPUT lacks under a tqdm bar on stderr, and a summary goes to
stdout. Exit status 0 when the job ran to its end, rows in ERRORS or not (the summary counts
them), unless every row it ran failed (none written: 1, with a line that says so); 1 when it
stopped early on an error, 130 on Ctrl-C (the rows written are kept: the same
command resumes). Where OUTPUT holds `query/<key>` embedding rows, the summary also gives
their retrieval recall@5 against the `passage/<key>` rows (`recall`).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import time

from hetero_jax.config import size_relation
from hetero_jax.models.presets import PRESETS, preset_config
from hetero_jax.offline.job import EngineFront, Tally, count_to_run, run_job
from hetero_jax.offline.journal import STDIO, ErrorLog, OutputError, OutputJournal
from hetero_jax.offline.recall import retrieval_recall
from hetero_jax.offline.ray_data import check_ray_data
from hetero_jax.offline.ray_data import make_front as ray_data_front
from hetero_jax.offline.replica_front import ReplicaFront
from hetero_jax.offline.rows import InputError, Source, open_source, read_rows
from hetero_jax.sched import POLICIES
from hetero_jax.serving.device_groups import visible_gpus
from hetero_jax.sim.options import DefaultsHelpFormatter, add_step_flags, compile_cache_dir, \
    int_range, output_file, output_problem

LIMITS = dict(token_budget=(1, 8192), chunk_size=(1, 8192), max_num_seqs=(1, 1024),
              max_in_flight=(1, 1_000_000), seed=(0, 2**32 - 1), replicas=(1, 1024),
              tensor_parallel=(1, 1024))
ERRORS_SUFFIX = ".errors.jsonl"


def model_dir(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return text


def journal_file(text: str) -> str:
    """An argparse type for --output and --errors: `-`, or a regular file that can be written
    (the job locks, scans and appends to it: a device, FIFO or socket cannot be resumed)."""
    if text == STDIO:
        return text
    output_file(text)
    if os.path.exists(text) and not os.path.isfile(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a regular file (a device, FIFO or socket cannot be locked and "
            "resumed); give a regular file, or - for stdout (--output, no resume) or stderr "
            "(--errors)")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetero-jax batch", formatter_class=DefaultsHelpFormatter,
                                description="Embed and generate for "
                                "every row of a JSONL (or Parquet) file on one engine; resumable.")
    ints = {name: int_range(*limits) for name, limits in LIMITS.items()}
    p.add_argument("input", metavar="INPUT", help="JSONL rows {id, embed | prompt, knobs...} "
                   "(Parquet with pyarrow installed); a pipe, FIFO or /dev/stdin is read once")
    p.add_argument("--output", type=journal_file, required=True, metavar="OUTPUT",
                   help="JSONL results (a regular file), one row per id, appended as rows "
                   "finish; a rerun skips the ids it holds. - for stdout (no resume; the "
                   "summary then goes to stderr)")
    p.add_argument("--errors", type=journal_file, default=None, metavar="PATH",
                   help=f"rows that failed, with line numbers (default: OUTPUT{ERRORS_SUFFIX}, "
                   "or stderr for --output -; rewritten by every run; - for stderr)")
    p.add_argument("--preset", default="mini", choices=list(PRESETS),
                   help="embedded model, no download (mini: trained; the others: random)")
    p.add_argument("--model", type=model_dir, default=None, metavar="DIR",
                   help="local Hugging Face directory (overrides --preset)")
    p.add_argument("--replicas", type=ints["replicas"], default=1,
                   help="engines in their own processes, one CPU core each, behind a router "
                   "(prefix affinity, bounded by load); at most the cores this process may use")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run the --replicas as Ray actors: on a local Ray cluster, or on the "
                   "cluster at ADDRESS (needs the ray extra)")
    p.add_argument("--ray-data", action="store_true",
                   help="run the job as a Ray Data pipeline: map_batches over a pool of "
                   "--replicas engine actors, on --ray's cluster (default: a local one)")
    p.add_argument("--tensor-parallel", type=ints["tensor_parallel"], default=1, metavar="N",
                   help="split each engine's decoder over N devices (Megatron layout, "
                   "EngineConfig(tensor_parallel=N)); N must divide the model's heads and "
                   "N x --replicas may not exceed the devices jax sees")
    p.add_argument("--scheduler", default="ibs", choices=list(POLICIES),
                   help="scheduling policy of the engine")
    p.add_argument("--max-in-flight", type=ints["max_in_flight"], default=None,
                   help="requests handed to the engines at a time; a killed run redoes at most "
                   "these (default: 4 x --max-num-seqs x --replicas)")
    add_step_flags(p, ints)
    p.add_argument("--seed", type=ints["seed"], default=0,
                   help="weights (preset) and the sampling seed of prompt rows without one")
    p.add_argument("--compile-cache", type=compile_cache_dir, default="auto", metavar="DIR",
                   help="persistent XLA compilation cache, shared with the bench: 'auto' "
                   "($XDG_CACHE_HOME or ~/.cache, /hetero-jax/xla), a directory, or 'none'")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


@dataclasses.dataclass
class Plan:
    """A checked job: its files opened, what it has to run."""

    journal: OutputJournal
    errors: ErrorLog
    source: Source
    rows: int | None  # rows this run hands to the engine (None: a stream, not counted)


def check(parser: argparse.ArgumentParser, args) -> Plan:
    """Every check before any model work, each failure a parser.error naming the value."""
    cores = len(os.sched_getaffinity(0))
    check_ray_data(parser, args)
    if args.ray is not None and importlib.util.find_spec("ray") is None:
        parser.error(f"argument --ray: --ray {args.ray} needs ray, which is not installed "
                     "(pip install 'hetero-jax[ray]')")
    if args.replicas > cores and args.ray in (None, "local"):
        parser.error(f"argument --replicas: {args.replicas} replicas need one CPU core each; "
                     f"this process may use {cores}")
    if args.errors is None:
        args.errors = STDIO if args.output == STDIO else args.output + ERRORS_SUFFIX
        problem = None if args.errors == STDIO else output_problem(args.errors)
        if problem:
            parser.error(f"argument --errors: cannot write {args.errors!r} (OUTPUT"
                         f"{ERRORS_SUFFIX}): {problem}")
    paths = {"INPUT": args.input, "--output": args.output, "--errors": args.errors}
    seen = {}
    for flag, path in paths.items():
        if path == STDIO:
            continue
        other = seen.setdefault(os.path.realpath(path), flag)
        if other != flag:
            parser.error(f"argument {flag}: {path!r} is {other} too; pick another path")
    check_tensor_parallel(parser, args)
    relation = size_relation(args.token_budget, args.chunk_size, args.max_num_seqs, 1)
    if relation:
        parser.error(f"argument --{relation[0].replace('_', '-')}: {relation[1]}")
    try:
        source = open_source(args.input)
    except InputError as e:
        parser.error(f"argument INPUT: {e}")
    try:
        journal = OutputJournal.open(args.output)
    except OutputError as e:
        parser.error(f"argument --output: {e}")
    try:
        rows = None if source.stream else count_to_run(read_rows(source, args.seed),
                                                       journal.done)
        errors = ErrorLog(args.errors)
    except (InputError, OutputError) as e:
        journal.close()
        parser.error(f"argument {'INPUT' if isinstance(e, InputError) else '--errors'}: {e}")
    return Plan(journal, errors, source, rows)


def check_tensor_parallel(parser: argparse.ArgumentParser, args) -> None:
    """--tensor-parallel against the model, and, on this host (no --ray / --ray-data, whose
    actors get their devices from the cluster), against --replicas and the devices jax sees
    (jax is imported only for N > 1), before any model work; a failure names the values."""
    n = args.tensor_parallel
    if n == 1:
        return
    from hetero_jax.models.formats.hf_llama import read_model_config
    from hetero_jax.runner.sharding import check_tensor_parallel as check_model

    try:  # the model first (as the Engine does), then the devices
        check_model(read_model_config(args.model) if args.model else preset_config(args.preset),
                    n, n)
    except (ValueError, OSError) as e:
        parser.error(f"argument --tensor-parallel: {e}")
    if args.ray is not None or args.ray_data:
        return
    gpus = visible_gpus() if args.replicas > 1 else []
    if gpus:  # counted without jax: a parent holding the GPUs would starve its replicas
        devices, seen = len(gpus), f"this host has {len(gpus)} GPU(s) ({','.join(gpus)})"
    else:
        import jax

        devices = len(jax.devices())
        seen = f"jax sees {devices} {jax.default_backend()} device(s)"
    if args.replicas * n > devices:
        need = (f"with --replicas {args.replicas} needs {args.replicas * n} devices ({n} per "
                "replica)" if args.replicas > 1 else f"needs {n} devices")
        parser.error(f"argument --tensor-parallel: --tensor-parallel {n} {need}; {seen}")


def make_front(args):
    """-> (the front the job runs on, its engine, a line describing it)."""
    from hetero_jax import EngineConfig, make_engine

    cfg = EngineConfig(token_budget=args.token_budget, chunk_size=args.chunk_size,
                       max_num_seqs=args.max_num_seqs, dtype=args.dtype,
                       scheduler=args.scheduler, seed=args.seed, compile_cache=args.compile_cache,
                       tensor_parallel=args.tensor_parallel)
    in_flight = args.max_in_flight or 4 * cfg.max_num_seqs * args.replicas
    if args.ray_data:
        front, where = ray_data_front(args, cfg, in_flight)
        return front, front, _describe(args, front, cfg, where, in_flight)
    if args.ray is not None:
        from hetero_jax.serving.ray_replicas import RayReplicaSet

        address = None if args.ray == "local" else args.ray
        engine = (RayReplicaSet.from_pretrained(args.model, args.replicas, cfg, address=address)
                  if args.model else RayReplicaSet.from_preset(args.preset, args.replicas,
                                                               args.seed, cfg, address=address))
        where = f"{args.replicas} Ray actors ({engine.router.config.policy} router)"
        line = _describe(args, engine, cfg, where, in_flight)
        return ReplicaFront(engine, in_flight), engine, line
    engine = make_engine(args.model or args.preset, cfg, args.seed, replicas=args.replicas)
    where = "one engine" if args.replicas == 1 else (
        f"{args.replicas} replicas (one process and core each, {engine.router.config.policy} "
        "router)")
    line = _describe(args, engine, cfg, where, in_flight)
    if args.replicas == 1:
        return EngineFront(engine, in_flight), engine, line
    return ReplicaFront(engine, in_flight), engine, line


def _describe(args, engine, cfg, where: str, in_flight: int) -> str:
    n, tp = args.tensor_parallel, ""
    if n > 1:
        tp = f", each split over {n} devices" if args.replicas > 1 else f" split over {n} devices"
    return (f"model: {args.model or args.preset} ({engine.model_cfg.num_params / 1e6:.1f}M "
            f"params, {args.dtype}) on {where}{tp}; scheduler {cfg.scheduler}, budget "
            f"{cfg.token_budget} tokens, chunk {cfg.chunk_size}, {cfg.max_num_seqs} sequences, "
            f"{in_flight} requests in flight")


def batch_main(argv=None) -> int:
    start = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(argv)
    plan = check(parser, args)
    try:
        return _run(parser, args, plan, start)
    finally:
        plan.journal.close()
        plan.errors.close()


def _run(parser, args, plan: Plan, start: float) -> int:
    done, say = len(plan.journal.done), info_stream(args)
    rows = (f"{plan.rows} rows to run" if plan.rows is not None else
            "a stream, read once: its rows are counted as they run")
    print(f"input: {args.input}; {rows}, {done} already in {args.output}"
          + (f" (a torn last line of {plan.journal.dropped_bytes} bytes, left by a killed "
             "run, was cut)" if plan.journal.dropped_bytes else ""), file=say, flush=True)
    try:
        front, engine, line = make_front(args)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"hetero-jax batch: error: {e}\n")
    print(line, file=say, flush=True)
    from tqdm.auto import tqdm

    from hetero_jax.runner.compile_progress import BarClock

    bar = tqdm(total=plan.rows, unit="row", desc="rows", disable=args.no_progress)
    clock = BarClock(bar, lambda: engine.stats.compile_s, time.perf_counter)

    def on_batch(n: int, tally: Tally) -> None:
        clock.update(n)  # the seconds spent compiling are no row's time
        bar.set_postfix(tok_s=f"{tally.gen_tokens / max(clock.serving_s(), 1e-9):.1f}",
                        refresh=False)

    try:
        tally = run_job(read_rows(plan.source, args.seed), front, plan.journal, plan.errors,
                        on_batch)
    except KeyboardInterrupt:
        print("\ninterrupted; the rows written are kept: rerun the same command to resume",
              file=sys.stderr)
        return 130
    except Exception:
        print("hetero-jax batch: the job stopped; the rows written are kept: rerun the same "
              "command to resume", file=sys.stderr)
        raise
    finally:
        bar.close()
        if args.replicas > 1 or args.ray is not None:
            engine.close()  # the replica processes or actors
    print_summary(args, tally, engine.stats, time.perf_counter() - start)
    if tally.errors and not tally.written:
        print(f"hetero-jax batch: every row failed: {tally.errors} rows went to {args.errors}, "
              f"none to {args.output}", file=sys.stderr)
        return 1
    return 0


def info_stream(args):
    """Where the command's own lines go: stdout, or stderr when the rows go to stdout."""
    return sys.stderr if args.output == STDIO else sys.stdout


def print_summary(args, t: Tally, stats, total_s: float) -> None:
    wall, say = max(t.wall_s, 1e-9), info_stream(args)
    print(f"{t.written} rows in {t.wall_s:.1f} s: {t.written / wall:.2f} rows/s ({t.embeds} "
          f"embeddings, {t.gens} generations); {t.gen_tokens} tokens generated "
          f"({t.gen_tokens / wall:.1f} tokens/s), {t.prompt_tokens} input tokens "
          f"({t.prompt_tokens / wall:.1f} tokens/s); {stats.compile_s:.1f} s of it compiling "
          f"{stats.compiles} step variants", file=say)
    print(f"{args.output}: {t.written} rows written, {t.skipped} already there; {args.errors}: "
          f"{t.errors} rows ({t.bad_rows} bad rows, {t.refused} refused by the engine, "
          f"{t.failed} failed running); {total_s:.1f} s in all", file=say)
    found = retrieval_recall(args.output) if args.output != STDIO else None
    if found is not None:
        print(f"retrieval: recall@{found.k} {found.value:.3f} of {found.queries} query/<key> "
              f"rows against {found.passages} passage/<key> rows (cosine)", file=say)
