"""`hetero-jax bench`: every scheduler on the same closed-loop workload, side by side.

    hetero-jax bench [--preset small | --model DIR] [--ratios 9:1,5:5,1:9]
                     [--schedulers ibs,fcfs,homogeneous,dedicated] [--clients N] [--requests N]
                     [--json PATH] [--plot PATH] [--baseline hf] [--workload mixed|iter-retgen]

In: argv. Out: a table on stdout (one row per scheduler x ratio), and optionally JSON
(`{"config": {...}, "results": [row, ...]}`) and a PNG plot. A tqdm bar (stderr) counts
finished requests over the whole run.

Every scheduler gets its own engine with the same weights and `EngineConfig` (one `Engine`
per policy, driven by `AsyncEngine`; `dedicated` is a `DedicatedEngine`, two processes on
their own cores, driven by `bench.loop.DedicatedFront`). All engines are built and warmed up
first; then, ratio by ratio, each scheduler serves the same request list with the same
closed-loop clients (`bench.loop`), schedulers back to back so that a change in the machine's
load hits all of them alike. Compiled steps are kept in a persistent XLA cache
(`--compile-cache`), so engines with the same step shapes compile each variant once.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time

from hetero_jax.bench.loop import (DedicatedFront, closed_loop, counters, counters_delta,
                                   summarize)
from hetero_jax.bench.report import NOTES, format_table, plot_results
from hetero_jax.bench.workloads import MixedWorkload, synthetic_iter_retgen

SCHEDULERS = ("ibs", "fcfs", "homogeneous", "dedicated")
LIMITS = dict(clients=(1, 1024), requests=(1, 100_000), min_gens=(0, 100_000), repeats=(1, 20),
              embed_len=(1, 8192), prompt_len=(1, 8192), output_len=(1, 8192), iterations=(1, 10),
              token_budget=(16, 8192), chunk_size=(1, 8192), max_num_seqs=(1, 1024),
              max_chunk_seqs=(1, 64), warmup=(0, 10_000))
QUICK = dict(clients=4, requests=8, min_gens=2, embed_len=16, prompt_len=16, output_len=16,
             warmup=0, token_budget=16, chunk_size=16, max_num_seqs=8, max_chunk_seqs=1)
_DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "hetero-jax", "xla")


def int_in(name: str):
    lo, hi = LIMITS[name]

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is outside [{lo}, {hi}]")
        return value
    return parse


def parse_ratios(text: str) -> list:
    """'9:1,5:5' -> [(9, 1), (5, 5)]: embed:gen weights, integers >= 0, not both 0."""
    out = []
    for part in text.split(","):
        try:
            e, g = (int(x) for x in part.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"bad ratio {part!r}: expected EMBED:GEN integers like 9:1") from None
        if e < 0 or g < 0 or e + g == 0 or e + g > 1000:
            raise argparse.ArgumentTypeError(
                f"bad ratio {part!r}: weights must be >= 0 with a sum in [1, 1000]")
        out.append((e, g))
    return out


def parse_schedulers(text: str) -> list:
    names = [s for s in text.split(",") if s]
    bad = [s for s in names if s not in SCHEDULERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown scheduler {bad[0] if bad else text!r}; expected a comma-separated subset "
            f"of {','.join(SCHEDULERS)}")
    return list(dict.fromkeys(names))


def _scale(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is outside (0, 1]")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetero-jax bench", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", choices=["tiny", "small"],
                   help="embedded model (random weights, no download)")
    p.add_argument("--model", metavar="PATH", help="local Hugging Face directory (overrides "
                   "--preset)")
    p.add_argument("--workload", default="mixed", choices=["mixed", "iter-retgen"])
    p.add_argument("--ratios", type=parse_ratios, default="9:1,5:5,1:9",
                   help="embed:gen request ratios (mixed workload)")
    p.add_argument("--schedulers", type=parse_schedulers, default=",".join(SCHEDULERS))
    p.add_argument("--clients", type=int_in("clients"), default=16,
                   help="closed-loop clients (concurrent requests or questions)")
    p.add_argument("--requests", type=int_in("requests"), default=48,
                   help="requests per scheduler and ratio (iter-retgen: questions)")
    p.add_argument("--min-gens", type=int_in("min_gens"), default=None,
                   help="raise a ratio's request count until its run holds this many "
                   "generations (default: --clients; 9:1 then runs 160 requests)")
    p.add_argument("--repeats", type=int_in("repeats"), default=1,
                   help="timed runs per scheduler and ratio, round robin over the schedulers "
                   "in a rotating order; each row is the run with the median requests/s")
    p.add_argument("--embed-len", type=int_in("embed_len"), default=128)
    p.add_argument("--prompt-len", type=int_in("prompt_len"), default=128)
    p.add_argument("--output-len", type=int_in("output_len"), default=256,
                   help="generated tokens per request (default 256, not 512: the default run "
                   "then fits in about 10 minutes on 2 CPU cores)")
    p.add_argument("--quick", action="store_true", help="a smoke run in well under a minute "
                   f"on --preset tiny: defaults become {QUICK}")
    p.add_argument("--iterations", type=int_in("iterations"), default=2,
                   help="iter-retgen: retrieve-generate rounds per question")
    p.add_argument("--scale", type=_scale, default=0.05,
                   help="iter-retgen: scale of the paper's lengths (prompt 500, decode 3000)")
    p.add_argument("--token-budget", type=int_in("token_budget"), default=256)
    p.add_argument("--chunk-size", type=int_in("chunk_size"), default=64)
    p.add_argument("--max-num-seqs", type=int_in("max_num_seqs"), default=32)
    p.add_argument("--max-chunk-seqs", type=int_in("max_chunk_seqs"), default=4)
    p.add_argument("--warmup", type=int_in("warmup"), default=None,
                   help="warm-up requests per engine before measuring (default: --clients)")
    p.add_argument("--baseline", choices=["hf"], help="also run transformers on PyTorch CPU "
                   "(scripts/bench_hf_baseline.py) on the same weights and workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile-cache", default=_DEFAULT_CACHE, metavar="DIR",
                   help="persistent XLA compilation cache ('none' disables)")
    p.add_argument("--json", metavar="PATH", help="write {config, results} here")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def check_args(parser, args) -> None:
    """Limits that depend on several flags or on the model: parser.error names them."""
    from hetero_jax.models.config import model_config_from_hf, read_hf_config
    from hetero_jax.models.presets import preset_config

    if args.model and not os.path.isdir(args.model):
        parser.error(f"argument --model: {args.model!r} is not a directory")
    model_cfg = (model_config_from_hf(read_hf_config(args.model)) if args.model
                 else preset_config(args.preset))
    model_max, args.vocab_size = model_cfg.max_position_embeddings, model_cfg.vocab_size
    need = max(args.embed_len, args.prompt_len + args.output_len)
    if args.workload == "iter-retgen":
        args.docs, args.plans = synthetic_iter_retgen(args.requests, args.scale, args.seed)
        need = max(p.prompt_budget + p.max_tokens for p in args.plans) + 1
        if args.baseline:
            parser.error("--baseline hf runs the mixed workload only")
    if need > model_max:
        parser.error(f"the requests need {need} positions; the model has "
                     f"max_position_embeddings={model_max}")
    if args.chunk_size > args.token_budget:
        parser.error(f"--chunk-size {args.chunk_size} exceeds --token-budget "
                     f"{args.token_budget}")
    args.max_model_len = -(-need // 64) * 64
    args.warmup = args.clients if args.warmup is None else args.warmup
    args.min_gens = args.clients if args.min_gens is None else args.min_gens


def enable_compile_cache(path: str) -> None:
    """Persistent XLA cache for this process and the worker processes it starts."""
    if path == "none":
        return
    import jax

    os.makedirs(path, exist_ok=True)
    values = dict(jax_compilation_cache_dir=path, jax_persistent_cache_min_compile_time_secs=0.0,
                  jax_persistent_cache_min_entry_size_bytes=0)
    for key, value in values.items():
        os.environ[key.upper()] = str(value)  # read by the workers' jax at import
        jax.config.update(key, value)


class Contender:
    """One scheduler's engine and how to make a closed-loop front for it."""

    def __init__(self, name: str, args, config):
        from hetero_jax.serving.factory import make_engine

        self.name = name
        source = args.model or args.preset
        self.engine = make_engine(source, dataclasses.replace(config, scheduler=name), args.seed)
        self.token_budget = config.token_budget
        self.tokenizer = getattr(self.engine, "tokenizer", None) or _tokenizer(args)
        self.batch_sizes = None  # dedicated: the generation worker's batch sizes, last run

    def serve(self, items: list, clients: int, on_done=None, index=None,
              iterations: int = 2) -> dict:
        """Run `items` through the closed loop; returns the summary row."""
        before = counters(self.engine)
        records = asyncio.run(self._loop(items, clients, on_done, index, iterations))
        after = counters(self.engine)
        row = summarize(records, counters_delta(before, after), self.token_budget)
        if self.batch_sizes:
            row["dedicated_mean_gen_batch"] = sum(self.batch_sizes) / len(self.batch_sizes)
        return dict(scheduler=self.name, **row)

    async def _loop(self, items, clients, on_done, index, iterations) -> list:
        front = self.front()
        try:
            return await closed_loop(front, items, clients, on_done, index, iterations)
        finally:
            await front.close()
            self.batch_sizes = getattr(front, "batch_sizes", {}).get("generate")

    def front(self):
        from hetero_jax.serving.async_engine import AsyncEngine

        if self.name == "dedicated":
            return DedicatedFront(self.engine, self.tokenizer)
        return AsyncEngine(self.engine)

    def close(self) -> None:
        if hasattr(self.engine, "close"):  # DedicatedEngine: end its worker processes
            self.engine.close()


def _tokenizer(args):
    from hetero_jax.models.config import model_config_from_hf, read_hf_config
    from hetero_jax.models.tokenizer import ByteTokenizer, load_tokenizer

    if not args.model:
        return ByteTokenizer()
    cfg = model_config_from_hf(read_hf_config(args.model))
    return load_tokenizer(args.model, cfg.eos_token_ids)


def workload_items(args, vocab: int) -> list:
    """[(label, items)]: per ratio a request list, or one list of Iter-RetGen query plans."""
    if args.workload == "iter-retgen":
        return [("iter-retgen", args.plans)]
    wl = MixedWorkload(args.embed_len, args.prompt_len, args.output_len, args.seed)
    return [(f"{e}:{g}", wl.requests((e, g), run_size(args, (e, g)), vocab))
            for e, g in args.ratios]


def run_size(args, ratio: tuple) -> int:
    return MixedWorkload.run_size(ratio, args.requests, args.min_gens)


def run_bench(args) -> dict:
    """Build every contender, warm them up, serve each workload list with each one."""
    from hetero_jax.config import EngineConfig

    enable_compile_cache(args.compile_cache)
    config = EngineConfig(token_budget=args.token_budget, chunk_size=args.chunk_size,
                          max_num_seqs=args.max_num_seqs, max_chunk_seqs=args.max_chunk_seqs,
                          max_model_len=args.max_model_len, seed=args.seed)
    t0 = time.perf_counter()
    print(f"building {len(args.schedulers)} engines ...", flush=True)
    contenders = [Contender(name, args, config) for name in args.schedulers]
    try:
        lists = workload_items(args, args.vocab_size)
        index = None
        if args.workload == "iter-retgen":
            from hetero_jax.rag import build_index
            from hetero_jax.requests import PoolingParams

            index = asyncio.run(_with_front(contenders[0], build_index, args.docs, None,
                                            PoolingParams(truncate=True)))
        warm = lists[len(lists) // 2][1][:args.warmup]
        if warm:  # compile the common step shapes before measuring; not counted
            serve_all(contenders, [("warm-up", warm)], args, index, "warm-up")
        setup_s = time.perf_counter() - t0
        print(f"engines built and warmed up in {setup_s:.0f} s", flush=True)
        rows = serve_all(contenders, lists, args, index, "bench", args.repeats)
    finally:
        for c in contenders:
            c.close()
    return dict(rows=rows, setup_s=setup_s, lists=lists)


def serve_all(contenders: list, lists: list, args, index, desc: str,
               repeats: int = 1) -> list:
    """List by list, `repeats` rounds of every contender back to back (round r starts at
    contender r, so no contender always runs first), under one progress bar -> rows, each the
    contender's run with the median requests/s."""
    from tqdm.auto import tqdm

    total = repeats * len(contenders) * sum(len(items) for _, items in lists)
    bar = tqdm(total=total, unit="req", desc=desc, disable=args.no_progress)
    rows = []
    for label, items in lists:
        runs = {c.name: [] for c in contenders}
        for r in range(repeats):
            for c in contenders[r % len(contenders):] + contenders[:r % len(contenders)]:
                bar.set_postfix_str(f"{c.name} {label}")
                runs[c.name].append(c.serve(items, args.clients, lambda _: bar.update(1), index,
                                            args.iterations))
        rows += [dict(median_run(rs), ratio=label) for rs in runs.values()]
    bar.close()
    return rows


def median_run(runs: list) -> dict:
    """The run with the median requests/s (the lower middle one for an even count), with every
    run's requests/s alongside."""
    ordered = sorted(runs, key=lambda r: r["requests_per_s"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    if len(runs) > 1:
        row["requests_per_s_runs"] = [r["requests_per_s"] for r in runs]
    return row


async def _with_front(contender, fn, *a):
    front = contender.front()
    try:
        return await fn(front, *a)
    finally:
        await front.close()


def add_ratios_to_ibs(rows: list) -> None:
    ibs = {r["ratio"]: r["requests_per_s"] for r in rows if r["scheduler"] == "ibs"}
    for r in rows:
        base = ibs.get(r["ratio"])
        r["vs_ibs"] = r["requests_per_s"] / base if base else None


def bench_main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:  # quick defaults; flags given explicitly still win
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    check_args(parser, args)
    start, load0 = time.perf_counter(), os.getloadavg()[0]
    _print_header(args, parser.get_default("output_len"), load0)
    result = run_bench(args)
    rows = result["rows"]
    if args.baseline == "hf":
        from hetero_jax.bench.hf_baseline import run_hf_rows

        rows += run_hf_rows(args, result["lists"])
    add_ratios_to_ibs(rows)
    config = {k: v for k, v in vars(args).items() if k not in ("docs", "plans")}
    config.update(wall_s=time.perf_counter() - start, setup_s=result["setup_s"],
                  load_start=load0, load_end=os.getloadavg()[0])
    _print_results(args, rows, config)
    for path in filter(None, (args.json, args.plot)):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=config, results=rows), f, indent=1, default=str)
    if args.plot:
        plot_results(rows, args.plot, title=_title(args))
    return 0


def _print_header(args, default_output_len: int, load: float) -> None:
    source = args.model or f"preset {args.preset}"
    what = (f"embeddings {args.embed_len} tokens, prompts {args.prompt_len}, outputs "
            f"{args.output_len}" if args.workload == "mixed" else
            f"scale {args.scale}, {args.iterations} iterations")
    unit = "questions" if args.workload == "iter-retgen" else "requests"
    sizes = ", ".join(f"{run_size(args, r)} at {r[0]}:{r[1]}" for r in args.ratios)
    count = args.requests if args.workload == "iter-retgen" else sizes
    print(f"hetero-jax bench: {source}, workload {args.workload}, schedulers "
          f"{','.join(args.schedulers)}; {args.clients} closed-loop clients, {count} "
          f"{unit} per run, {args.repeats} run(s) each (median); {what}", flush=True)
    if args.workload == "mixed" and args.output_len == default_output_len and not args.quick:
        print(f"note: {args.output_len}-token outputs by default, not the issue's 512 "
              "(--output-len 512), so that the default run takes about 10 minutes on 2 idle CPU "
              "cores", flush=True)
    print(f"machine: {len(os.sched_getaffinity(0))} cores, load average {load:.1f} (other "
          "processes' load slows and skews every number)", flush=True)


def _print_results(args, rows: list, config: dict) -> None:
    print(format_table(rows))
    for r in rows:
        if r.get("questions"):
            print(f"{r['scheduler']}: {r['questions_per_s']:.3f} questions/s, p99 question "
                  f"latency {r['p99_latency_s']:.1f} s ({args.iterations} x retrieve, "
                  "generate, embed)")
        if r["scheduler"] == "hf" and r.get("vs_ibs"):
            print(f"ibs / transformers at {r['ratio']}: {1 / r['vs_ibs']:.2f}x requests/s")
    print(NOTES)
    print(f"wall time {config['wall_s']:.0f} s (setup and warm-up {config['setup_s']:.0f} s); "
          f"load average {config['load_start']:.1f} at the start, {config['load_end']:.1f} at "
          "the end")


def _title(args) -> str:
    model = os.path.basename(args.model.rstrip("/")) if args.model else args.preset
    if args.workload == "iter-retgen":
        return f"{model}: Iter-RetGen, {args.clients} clients, scale {args.scale}"
    return (f"{model}: {args.clients} closed-loop clients, embed {args.embed_len} / "
            f"prompt {args.prompt_len} + output {args.output_len} tokens")


if __name__ == "__main__":
    sys.exit(bench_main())
