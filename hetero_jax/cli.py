"""The `hetero-jax` command line.

    hetero-jax generate [--preset small | --model DIR] [--num-prompts N] [--max-tokens N] ...
    hetero-jax sim [--policy ibs] [--cost roofline:h200] ...
    hetero-jax bench [--preset small] [--ratios 9:1,5:5,1:9] [--json PATH] [--plot PATH] ...

`generate` runs a batch generation with a progress bar and prints a throughput summary (the
bench's `bench.loop.summarize` over the outputs; `--json` writes it);
`sim` runs a scheduling policy in the discrete-event simulator (`hetero_jax.sim`);
`bench` runs every scheduler on the same closed-loop workload (`hetero_jax.bench`).
"""
from __future__ import annotations

import argparse
import json
import sys


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def cmd_generate(args) -> int:
    from hetero_jax import Engine, EngineConfig, SamplingParams
    from hetero_jax.bench.loop import counters, counters_delta, output_records, summarize
    from hetero_jax.bench.workloads import demo_prompts

    cfg = EngineConfig(token_budget=args.token_budget, chunk_size=args.chunk_size,
                       max_num_seqs=args.max_num_seqs, dtype=args.dtype)
    if args.model:
        engine = Engine.from_pretrained(args.model, config=cfg)
    else:
        engine = Engine.from_preset(args.preset, seed=args.seed, config=cfg)
    print(f"model: {args.model or args.preset} ({engine.model_cfg.num_params / 1e6:.1f}M params, "
          f"{args.dtype}); budget {cfg.token_budget} tokens, chunk {cfg.chunk_size}, "
          f"{cfg.max_num_seqs} sequences", flush=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, ignore_eos=True)
    before = counters(engine)
    outs = engine.generate(demo_prompts(args.num_prompts, args.seed), params)
    stats = engine.stats
    summary = dict(summarize(output_records(outs), counters_delta(before, counters(engine)),
                             cfg.token_budget), preemptions=stats.preemptions,
                   mean_step_ms=1e3 * (stats.step_time_s - stats.compile_s) / max(stats.steps, 1))
    _print_summary(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


def _print_summary(r: dict) -> None:
    print(f"{r['requests']} requests, {r['gen_tokens']} tokens in {r['wall_s']:.1f} s "
          f"({r['gen_tokens'] / r['wall_s']:.1f} tokens/s); without the {r['compile_s']:.1f} s "
          f"spent compiling {r['compiles']} step variants: {r['gen_tokens_per_s']:.1f} tokens/s, "
          f"{r['requests_per_s']:.2f} requests/s")
    print(f"latency p50 {r['p50_latency_s']:.2f} s, p99 {r['p99_latency_s']:.2f} s; TTFT p50 "
          f"{r['ttft_p50_s']:.2f} s; {r['steps']} steps of {r['mean_step_ms']:.1f} ms, "
          f"{r['budget_fill']:.0%} of the token budget filled; {r['preemptions']} preemptions")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hetero-jax", description="Batch generation, the "
                                 "scheduler simulator and the serving benchmark.")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("sim", help="simulate a scheduling policy against a cost model "
                   "(hetero-jax sim --help)", add_help=False)
    sub.add_parser("bench", help="closed-loop benchmark of every scheduler side by side "
                   "(hetero-jax bench --help)", add_help=False)
    g = sub.add_parser("generate", help="batch generation with a throughput summary")
    g.add_argument("--preset", default="small", help="embedded model: tiny or small")
    g.add_argument("--model", default=None, help="local Hugging Face directory (overrides --preset)")
    g.add_argument("--num-prompts", type=_positive, default=64)
    g.add_argument("--max-tokens", type=_positive, default=64)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--token-budget", type=_positive, default=256)
    g.add_argument("--chunk-size", type=_positive, default=64)
    g.add_argument("--max-num-seqs", type=_positive, default=32)
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", default=None, help="write the summary here")
    g.set_defaults(func=cmd_generate)
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["sim"]:  # host-only: no jax import
        from hetero_jax.sim.cli import sim_main
        sim_main(argv[1:])
        return 0
    if argv[:1] == ["bench"]:
        from hetero_jax.bench.cli import bench_main
        try:
            return bench_main(argv[1:])
        except (ValueError, FileNotFoundError) as e:
            print(f"hetero-jax bench: error: {e}", file=sys.stderr)
            return 2
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"hetero-jax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
