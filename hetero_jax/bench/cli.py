"""`hetero-jax bench`: every scheduler on the same closed-loop workload, side by side.

    hetero-jax bench [--preset small | --model DIR] [--ratios 9:1,5:5,1:9]
                     [--schedulers ibs,fcfs,homogeneous,dedicated] [--clients N] [--requests N]
                     [--json PATH] [--plot PATH] [--baseline hf]
                     [--workload mixed|iter-retgen|shared-prefix] [--prefix-caching on,off]

In: argv, resolved once into a frozen `BenchConfig` (`bench.config`) that every part reads.
Out: a table on stdout (one row per scheduler x ratio), and optionally JSON
(`{"config": {...}, "results": [row, ...]}`) and a PNG plot. A tqdm bar (stderr) counts
finished requests over the whole run, its times without the seconds spent compiling (each
new step variant says so on stderr: `runner.compile_progress`).

Every scheduler gets its own engine with the same weights and `EngineConfig` (one `Engine`
per policy, driven by `AsyncEngine`; `dedicated` is a `DedicatedEngine`, two processes on
their own cores, driven by `serving.async_replicas.AsyncDedicated`). All engines are built and warmed up
first; then, ratio by ratio, each scheduler serves the same request list with the same
closed-loop clients (`bench.loop`), schedulers back to back so that a change in the machine's
load hits all of them alike. Compiled steps are kept in a persistent XLA cache
(`--compile-cache`), so engines with the same step shapes compile each variant once.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import sys
import time

from hetero_jax.bench.config import BenchConfig, parse_config
from hetero_jax.bench.loop import closed_loop, counters, counters_delta, summarize
from hetero_jax.bench.report import COLUMNS, NOTES, plot_results
from hetero_jax.bench.stats import (bootstrap_interval, inside_noise, ratio_interval,
                                    rounds_within, run_order)
from hetero_jax.bench.timeshare import TimeShare, on_own_clock
from hetero_jax.bench.workloads import (MixedWorkload, SharedPrefixWorkload,
                                        synthetic_iter_retgen)
from hetero_jax.sched.batching import FeatherConfig
from hetero_jax.sched.policies import COST_AWARE_IBS
from hetero_jax.sim.options import write_json
from hetero_jax.sim.report import format_table


class Contender:
    """One scheduler's engine (with prefix caching on or off, a batching policy, cascade
    attention on or off) and how to make a closed-loop front for it; named by its scheduler,
    "+<batching>" added when the run names a batching policy other than fcfs ("+feather[arm]"
    for one fixed arm), "/no-cache" when caching is off and "/plain" when cascade is off in a
    run that compares both."""

    def __init__(self, scheduler: str, cfg: BenchConfig, engine_config, caching: bool = True,
                 batching: str = "fcfs", arm=None, cascade: bool = True):
        from hetero_jax.serving.factory import make_engine

        self.scheduler = scheduler
        both = len(cfg.prefix_caching) > 1
        shown = f"feather[{arm}]" if arm is not None else batching
        self.name = scheduler + (f"+{shown}" if cfg.batching != ("fcfs",) else "") + (
            "/no-cache" if both and not caching else "") + (
            "/plain" if len(cfg.cascade) > 1 and not cascade else "")
        feather = engine_config.feather if arm is None else dataclasses.replace(
            engine_config.feather, loss_limit=arm.loss_limit, cap=arm.cap)
        # ibs-cost: ibs with cfg.cost_model; the others keep the engine's default ("auto":
        # ibs is cost-aware where the engine knows its model, as a user's engine is)
        cost_aware = scheduler == COST_AWARE_IBS
        self.engine = make_engine(cfg.model or cfg.preset, dataclasses.replace(
            engine_config, scheduler="ibs" if cost_aware else scheduler,
            cost_model=cfg.cost_model if cost_aware else engine_config.cost_model,
            prefix_caching=caching,
            batching=batching, feather=feather,
            cascade_rows=engine_config.cascade_rows if cascade else 0), cfg.seed)
        self.token_budget = engine_config.token_budget
        self.dedicated = scheduler == "dedicated"  # a DedicatedEngine: two worker processes
        self.tokenizer = _tokenizer(cfg.model) if self.dedicated else self.engine.tokenizer
        self.batch_sizes = None  # dedicated: the generation worker's batch sizes, last run

    def serve(self, items: list, clients: int, on_done=None, index=None,
              iterations: int = 2) -> dict:
        """Run `items` through the closed loop alone; returns the summary row."""
        before, cpu0 = self.begin(), time.process_time()
        records = asyncio.run(self.loop(self.front(), items, clients, on_done, index,
                                        iterations))
        return self.row(records, before, time.process_time() - cpu0)

    def begin(self) -> dict:
        """Ready the engine for a run -> its counters before it: an empty prefix cache (so no
        run finds the prompts of the warm-up or of an earlier repeat of the same items)."""
        self.engine.reset_prefix_cache()
        if not self.dedicated:  # a shared cache: share_compiled_steps
            self.engine.count_compiles()
        return counters(self.engine)

    def row(self, records: list, before: dict, cpu_s: float, compiled=None) -> dict:
        """The summary row of a run's records (its counters since `before`; `compiled`:
        (variants, seconds) this run compiled, where its engine's counters also hold other
        engines' compiles made meanwhile)."""
        delta = counters_delta(before, counters(self.engine))
        if compiled is not None:
            delta.update(compiles=compiled[0], compile_s=compiled[1],
                         compile_stall_s=compiled[1])
        row = summarize(records, delta, self.token_budget)
        row.update(cpu_s=cpu_s, requests_per_cpu_s=row["requests"] / cpu_s if cpu_s else None)
        batching = None if self.dedicated else self.engine.stats.batching
        if batching and batching["batching"] != "fcfs":
            row["batching"] = dict(batching)  # the bandit's arm, its mean reward
        if self.batch_sizes:
            row["dedicated_mean_gen_batch"] = sum(self.batch_sizes) / len(self.batch_sizes)
        return dict(scheduler=self.name, **row)

    async def loop(self, front, items, clients, on_done, index, iterations) -> list:
        try:
            return await closed_loop(front, items, clients, on_done, index, iterations)
        finally:
            await front.close()
            if self.dedicated:
                self.batch_sizes = front.batch_sizes["generate"]

    def front(self, share=None):
        """Its closed-loop front; with a `timeshare.TimeShare`, one whose engine steps only
        in its turns."""
        from hetero_jax.serving.async_engine import AsyncEngine
        from hetero_jax.serving.async_replicas import AsyncDedicated

        if self.dedicated:
            return AsyncDedicated(self.engine, self.tokenizer)
        return AsyncEngine(share.engine(self.name, self.engine) if share else self.engine)

    def close(self) -> None:
        if self.dedicated:  # end its worker processes
            self.engine.close()


def _tokenizer(model_dir: str | None):
    from hetero_jax.models.config import model_config_from_hf, read_hf_config
    from hetero_jax.models.tokenizer import ByteTokenizer, load_tokenizer

    if not model_dir:
        return ByteTokenizer()
    cfg = model_config_from_hf(read_hf_config(model_dir))
    return load_tokenizer(model_dir, cfg.eos_token_ids)


def workload_items(cfg: BenchConfig) -> tuple[list, list | None]:
    """([(label, items)], docs): per ratio a request list and no documents, or one list of
    Iter-RetGen query plans and the corpus they retrieve from."""
    if cfg.workload == "iter-retgen":
        docs, plans = synthetic_iter_retgen(cfg.requests, cfg.scale, cfg.seed,
                                            instruction_len=cfg.instruction_len)
        return [("iter-retgen", plans)], docs
    if cfg.workload == "shared-prefix":
        wl = SharedPrefixWorkload(cfg.groups, cfg.prompts_per_group, cfg.prefix_len,
                                  cfg.suffix_len, cfg.output_len, cfg.seed)
        return [(f"{e}:{g}{suffix}", wl.requests((e, g), cfg.vocab_size, shared))
                for e, g in cfg.ratios
                for shared, suffix in ((True, ""),) + (((False, " unshared"),)
                                                       if cfg.control else ())], None
    wl = MixedWorkload(cfg.embed_len, cfg.prompt_len, cfg.output_len, cfg.seed)
    return [(f"{e}:{g}", wl.requests((e, g), cfg.run_size((e, g)), cfg.vocab_size))
            for e, g in cfg.ratios], None


def run_bench(cfg: BenchConfig) -> dict:
    """Build every contender, warm them up, serve each workload list with each one."""
    engine_config = cfg.engine_config()
    t0 = time.perf_counter()
    batchings = [(b, None) for b in cfg.batching if b != "each-arm"] + (
        [("feather", arm) for arm in cfg.arms] if "each-arm" in cfg.batching else [])
    combos = [(name, caching, b, arm, cascade) for name in cfg.schedulers
              for b, arm in batchings for caching in cfg.prefix_caching
              for cascade in cfg.cascade]
    if cfg.aa:  # the first contender twice, the second named with a ': the bench's own noise
        combos = combos[:1] * 2
    n = len(combos)
    print(f"building {n} engine{'s' if n > 1 else ''} ...", flush=True)
    contenders = [Contender(name, cfg, engine_config, caching, b, arm, cascade)
                  for name, caching, b, arm, cascade in combos]
    if cfg.aa:
        contenders[1].name += "'"
    share_compiled_steps([c.engine for c in contenders if not c.dedicated])
    try:
        lists, docs = workload_items(cfg)
        index = None
        if docs is not None:
            from hetero_jax.rag import build_index
            from hetero_jax.requests import PoolingParams

            index = asyncio.run(_with_front(contenders[0], build_index, docs, None,
                                            PoolingParams(truncate=True)))
        warm = lists[len(lists) // 2][1][:cfg.warmup]
        if warm:  # compile the common step shapes before measuring; not counted
            serve_all(contenders, [("warm-up", warm)], cfg, index, "warm-up")
        setup_s = time.perf_counter() - t0
        print(f"engines built and warmed up in {setup_s:.0f} s", flush=True)
        rows = serve_all(contenders, lists, cfg, index, "bench", cfg.repeats)
    finally:
        for c in contenders:
            c.close()
    return dict(rows=rows, setup_s=setup_s, lists=lists)


def share_compiled_steps(engines: list) -> None:
    """Engines (of one model, as the bench builds them) whose configurations differ only in
    how they schedule (`scheduler`, `batching`, `feather`, `cost_model`) run the same step
    executables: they get one `ExecutableCache`. Else each of the contenders that one process
    holds compiles its own copies, and once the process nears its memory-mapping bound the
    caches drop and reload variants in measured runs (8 engines on the small preset's
    homogeneity burst: the 4 built last reloaded 10 variants every run and served 0.74x at
    the same steps)."""
    def steps_only(config):
        return dataclasses.replace(config, scheduler="fcfs", batching="fcfs",
                                   feather=FeatherConfig(), cost_model=None)
    owners = []  # (steps-only config, runner) of the first engine of each configuration
    for engine in engines:  # in-process engines (a DedicatedEngine has its own processes)
        runner = engine.runner
        key = steps_only(engine.config)
        owner = next((r for k, r in owners if k == key), None)
        if owner is None:
            owners.append((key, runner))
        else:
            runner.executable = owner.executable


def serve_all(contenders: list, lists: list, cfg: BenchConfig, index, desc: str,
              repeats: int = 1) -> list:
    """List by list, `repeats` interleaved rounds of every contender (`stats.run_order`:
    round r starts at contender r), under one progress bar -> rows, each the contender's run
    with the median requests/s and the interval of its mean over the rounds."""
    from tqdm.auto import tqdm

    from hetero_jax.runner.compile_progress import BarClock

    total = repeats * len(contenders) * sum(len(items) for _, items in lists)
    bar = tqdm(total=total, unit="req", desc=desc, disable=cfg.no_progress)
    clock = BarClock(bar, lambda: compile_seconds(contenders), time.perf_counter)
    rows = []
    for label, items in lists:
        runs = {c.name: [] for c in contenders}
        if cfg.slice_s:  # every round: all of them at once, in turns (bench.timeshare)
            for r in range(repeats):
                bar.set_postfix_str(f"round {r + 1} {label}")
                order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
                for row in serve_sliced(order, items, cfg, lambda _: clock.update(1), index):
                    runs[row["scheduler"]].append(row)
        else:
            for i in run_order(len(contenders), repeats):
                c = contenders[i]
                bar.set_postfix_str(f"{c.name} {label}")
                runs[c.name].append(c.serve(items, cfg.clients, lambda _: clock.update(1),
                                            index, cfg.iterations))
        rows += [dict(median_run(rs), ratio=label) for rs in runs.values()]
    bar.close()
    return rows


def serve_sliced(contenders: list, items: list, cfg: BenchConfig, on_done, index) -> list:
    """One round: every contender's closed loop over `items` at once, its engine stepping in
    turns of `cfg.slice_s` (the first in `contenders` asks first) -> their rows, each timed
    on its own clock (`timeshare`)."""
    share = TimeShare(cfg.slice_s)
    befores = [c.begin() for c in contenders]

    async def together():
        return await asyncio.gather(*(c.loop(c.front(share), items, cfg.clients, on_done, index,
                                              cfg.iterations) for c in contenders))

    runs = asyncio.run(together())
    return [c.row(on_own_clock(share, c.name, records), before, share.cpu_s[c.name],
                  share.compiled[c.name]) for c, records, before in zip(contenders, runs, befores)]


def compile_seconds(contenders: list) -> float:
    """Seconds the contenders' engines spent building step variants so far, an executable
    cache that engines share counted once (a dedicated engine's workers compile in their own
    processes, unseen here)."""
    runners = [c.engine.runner for c in contenders if not c.dedicated]
    caches = {id(r.executable): r.executable for r in runners}
    return sum(cache.seconds for cache in caches.values())


def median_run(runs: list) -> dict:
    """The run with the median requests/s (the lower middle one for an even count), with every
    run's requests/s (and per CPU-second) alongside, in round order, and the bootstrap
    interval of their mean."""
    ordered = sorted(runs, key=lambda r: r["requests_per_s"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    if len(runs) > 1:
        row["requests_per_s_runs"] = [r["requests_per_s"] for r in runs]
        row["requests_per_cpu_s_runs"] = [r.get("requests_per_cpu_s") for r in runs]
        row["requests_per_s_ci"] = bootstrap_interval(row["requests_per_s_runs"])
    return row


async def _with_front(contender, fn, *a):
    front = contender.front()
    try:
        return await fn(front, *a)
    finally:
        await front.close()


def add_ratios(rows: list, base_name: str = "ibs") -> None:
    """Each row's requests/s over `base_name`'s (same list; with repeats, the ratio of the
    mean requests/s, its bootstrap interval by round and whether it is inside the noise),
    over its own scheduler's without the prefix cache and over its own scheduler's with fcfs
    batching (when the run compares them)."""
    rate = {(r["ratio"], r["scheduler"]): r["requests_per_s"] for r in rows}
    runs = {(r["ratio"], r["scheduler"]): r.get("requests_per_s_runs") for r in rows}
    for r in rows:
        base = rate.get((r["ratio"], base_name))
        r["vs_ibs"] = r["requests_per_s"] / base if base else None
        mine, theirs = r.get("requests_per_s_runs"), runs.get((r["ratio"], base_name))
        if mine and theirs and len(mine) == len(theirs) and r["scheduler"] != base_name:
            r["vs_ibs_mean"] = sum(mine) / sum(theirs)
            r["vs_ibs_ci"] = ratio_interval(mine, theirs)
            r["noise"] = "inside" if inside_noise(r["vs_ibs_ci"]) else "outside"
            r["rounds_within_3pct"] = rounds_within(mine, theirs, 0.03)
        off = rate.get((r["ratio"], r["scheduler"] + "/no-cache"))
        r["vs_no_cache"] = r["requests_per_s"] / off if off else None
        fcfs = rate.get((r["ratio"], re.sub(r"\+[^/]+", "+fcfs", r["scheduler"], count=1)))
        r["vs_fcfs"] = r["requests_per_s"] / fcfs if fcfs and "+" in r["scheduler"] else None


def bench_main(argv=None) -> int:
    return run_config(parse_config(argv))


def run_config(cfg: BenchConfig) -> int:
    """The whole bench of a parsed configuration (`hetero-jax bench` parses its flags, so
    `--help` and bad flags end, before this module and jax are imported)."""
    start, load0 = time.perf_counter(), os.getloadavg()[0]
    _print_header(cfg, load0)
    result = run_bench(cfg)
    rows = result["rows"]
    if cfg.baseline == "hf":
        from hetero_jax.bench.hf_baseline import run_hf_rows

        rows += run_hf_rows(cfg, result["lists"])
    add_ratios(rows, rows[0]["scheduler"] if cfg.aa else "ibs")
    config = dict(dataclasses.asdict(cfg), wall_s=time.perf_counter() - start,
                  setup_s=result["setup_s"], load_start=load0, load_end=os.getloadavg()[0])
    _print_results(cfg, rows, config)
    if cfg.json:
        write_json(cfg.json, dict(config=config, results=rows), indent=1, default=str)
    if cfg.plot:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.plot)), exist_ok=True)
        plot_results(rows, cfg.plot, title=_title(cfg))
    return 0


def _print_header(cfg: BenchConfig, load: float) -> None:
    source = cfg.model or f"preset {cfg.preset}"
    if cfg.workload == "iter-retgen":
        what = (f"Iter-RetGen, {cfg.requests} questions per run, {cfg.iterations} iterations, "
                f"scale {cfg.scale}")
    elif cfg.workload == "shared-prefix":
        what = (f"shared prefixes, {cfg.groups} groups x {cfg.prompts_per_group} requests at "
                f"{', '.join(f'{e}:{g}' for e, g in cfg.ratios)}; prefix {cfg.prefix_len} + "
                f"suffix {cfg.suffix_len} tokens, outputs of {cfg.output_len}"
                + ("; and the no-sharing control" if cfg.control else ""))
    else:
        sizes = ", ".join(f"{cfg.run_size(r)} at {r[0]}:{r[1]}" for r in cfg.ratios)
        what = (f"mixed requests, {sizes} per run; embeddings of {cfg.embed_len} tokens, "
                f"prompts of {cfg.prompt_len}, outputs of {cfg.output_len}")
    runs = "one run" if cfg.repeats == 1 else f"the median of {cfg.repeats} interleaved runs"
    runs += "; A/A: the first contender twice" if cfg.aa else ""
    runs += (f"; each round's contenders at once, in turns of {cfg.slice_s:g} s, each on its "
             "own clock" if cfg.slice_s else "")
    print(f"hetero-jax bench: {source}; schedulers {', '.join(cfg.schedulers)}; "
          f"{cfg.clients} closed-loop clients; {runs} per row; {what}", flush=True)
    print(f"machine: {len(os.sched_getaffinity(0))} cores, load average {load:.1f} (other "
          "processes' load slows and skews every number)", flush=True)


def _print_results(cfg: BenchConfig, rows: list, config: dict) -> None:
    print(format_table(rows, COLUMNS))
    for r in rows:
        if r.get("questions"):
            print(f"{r['scheduler']}: {r['questions_per_s']:.3f} questions/s, p99 question "
                  f"latency {r['p99_latency_s']:.1f} s ({cfg.iterations} x retrieve, "
                  "generate, embed)")
        b = r.get("batching") or {}
        if "best_arm" in b:
            print(f"{r['scheduler']} at {r['ratio']}: {b['rounds']} rounds, last arm {b['arm']}, "
                  f"best arm {b['best_arm']} ({b['best_mean_reward']:.3f} of the tokens/s with "
                  "nothing held back)")
        if r["scheduler"] == "hf" and r.get("vs_ibs"):
            print(f"ibs / transformers at {r['ratio']}: {1 / r['vs_ibs']:.2f}x requests/s")
    print(NOTES)
    print(f"wall time {config['wall_s']:.0f} s (setup and warm-up {config['setup_s']:.0f} s); "
          f"load average {config['load_start']:.1f} at the start, {config['load_end']:.1f} at "
          "the end")


def _title(cfg: BenchConfig) -> str:
    model = os.path.basename(cfg.model.rstrip("/")) if cfg.model else cfg.preset
    if cfg.workload == "iter-retgen":
        return f"{model}: Iter-RetGen, {cfg.clients} clients, scale {cfg.scale}"
    return (f"{model}: {cfg.clients} closed-loop clients, embed {cfg.embed_len} / "
            f"prompt {cfg.prompt_len} + output {cfg.output_len} tokens")


if __name__ == "__main__":
    sys.exit(bench_main())
