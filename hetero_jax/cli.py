"""The `hetero-jax` command line.

    hetero-jax generate [PROMPT ...] [--preset mini | --model DIR] [--max-tokens N] ...
    hetero-jax embed TEXT [TEXT ...] [--preset mini | --model DIR] [--pooling mean] ...
    hetero-jax sim [--policy ibs] [--cost roofline:h200] ...
    hetero-jax bench [--preset small] [--ratios 9:1,5:5,1:9] [--json PATH] [--plot PATH] ...
    hetero-jax batch INPUT --output OUTPUT [--preset mini | --model DIR] [--errors PATH] ...
    hetero-jax train-adapter --pairs PATH --output DIR [--preset tiny | --model DIR] ...
    hetero-jax serve [--preset mini | --model DIR] [--port 8000] [--api-key KEY] ...
    hetero-jax bench-serve --url URL [--rate 20] [--requests 200] [--json PATH] ...

`generate` completes the PROMPTs given and prints the texts, or runs a batch of demo prompts
with a progress bar; either way it prints a throughput summary (the bench's
`bench.loop.summarize` over the outputs; `--json` writes it); `embed` prints the TEXTs'
embeddings and their cosine similarities;
`sim` runs a scheduling policy in the discrete-event simulator (`hetero_jax.sim`);
`bench` runs every scheduler on the same closed-loop workload (`hetero_jax.bench`);
`batch` runs an offline, resumable batch job over a file of rows (`hetero_jax.offline`);
`train-adapter` fits a LoRA embedding adapter (`hetero_jax.train`).
`serve` starts the OpenAI-compatible server (`hetero_jax.server`); `bench-serve` sends an
open-loop trace to a running server over HTTP (`hetero_jax.bench.online`).
Each command checks its flags, and that the paths it will write can be written, before any
work (`generate` and `batch` before they import jax): a bad one is an argparse error, exit status 2.
"""
from __future__ import annotations

import argparse
import os
import sys

from hetero_jax.models.presets import PRESETS
from hetero_jax.requests import STREAMING_KINDS
from hetero_jax.sim.cli import sim_main
from hetero_jax.sim.options import add_dtype_flag, add_step_flags, int_range, output_file, \
    real_range, write_json


# generate's integer flags: (lo, hi); the upper limits are the bench's
LIMITS = dict(num_prompts=(1, 100_000), max_tokens=(1, 8192), token_budget=(1, 8192),
              chunk_size=(1, 8192), max_num_seqs=(1, 1024), seed=(0, 2**32 - 1))


def _model_dir(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return text


def cmd_generate(args) -> int:
    from hetero_jax import SamplingParams
    from hetero_jax.bench.loop import counters, counters_delta, output_records, summarize
    from hetero_jax.bench.workloads import demo_prompts

    engine, cfg = _engine(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, ignore_eos=not args.prompts)
    before = counters(engine)
    outs = engine.generate(args.prompts or demo_prompts(args.num_prompts, args.seed), params)
    for prompt, out in zip(args.prompts, outs):
        print(f"{prompt!r} -> {out.text!r} ({out.finish_reason})")
    stats = engine.stats
    summary = dict(summarize(output_records(outs), counters_delta(before, counters(engine)),
                             cfg.token_budget), preemptions=stats.preemptions,
                   mean_step_ms=1e3 * stats.step_time_s / max(stats.steps, 1))
    _print_summary(summary)
    if args.json:
        write_json(args.json, summary, indent=1)
    return 0


def _engine(args):
    """-> (the engine of --model or --preset, its EngineConfig); prints a line about it."""
    from hetero_jax import Engine, EngineConfig

    cfg = EngineConfig(token_budget=args.token_budget, chunk_size=args.chunk_size,
                       max_num_seqs=args.max_num_seqs, dtype=args.dtype)
    if args.model:
        engine = Engine.from_pretrained(args.model, config=cfg)
    else:
        engine = Engine.from_preset(args.preset, seed=args.seed, config=cfg)
    print(f"model: {args.model or args.preset} ({engine.model_cfg.num_params / 1e6:.1f}M params, "
          f"{engine.config.dtype}); budget {cfg.token_budget} tokens, chunk {cfg.chunk_size}, "
          f"{cfg.max_num_seqs} sequences", flush=True)
    return engine, cfg


def cmd_embed(args) -> int:
    from hetero_jax import PoolingParams

    engine, _ = _engine(args)
    vecs = engine.embed(args.texts, PoolingParams(args.pooling, normalize=True), use_tqdm=False)
    for text, v in zip(args.texts, vecs):  # v [d], unit norm
        head = ", ".join(f"{x:.4f}" for x in v[:4])
        print(f"{text!r}: [{head}, ...] ({v.shape[0]} dims, L2-normalised)")
    if len(vecs) > 1:
        print("cosine similarities:")
        for text, row in zip(args.texts, vecs @ vecs.T):
            print(f"  {' '.join(f'{c:6.3f}' for c in row)}  {text[:40]!r}")
    if args.json:
        write_json(args.json, dict(texts=args.texts, embeddings=vecs.tolist()))
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
    sub.add_parser("batch", help="resumable offline job: embed and generate for every row of "
                   "a JSONL file (hetero-jax batch --help)", add_help=False)
    sub.add_parser("train-adapter", help="fit a LoRA embedding adapter with optax, written "
                   "as PEFT (hetero-jax train-adapter --help)", add_help=False)
    sub.add_parser("serve", help="OpenAI-compatible HTTP server (hetero-jax serve --help)",
                   add_help=False)
    sub.add_parser("bench-serve", help="open-loop benchmark of a running server over HTTP "
                   "(hetero-jax bench-serve --help)", add_help=False)
    g = sub.add_parser("generate", help="generate from PROMPTs and print the texts, or (none "
                       "given) a batch of demo prompts with a throughput summary",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ints = {name: int_range(*limits) for name, limits in LIMITS.items()}
    g.add_argument("prompts", nargs="*", metavar="PROMPT",
                   help="prompts to complete (stops at EOS); none: --num-prompts demo prompts")
    g.add_argument("--preset", default="mini", choices=list(PRESETS),
                   help="embedded model, no download (mini: trained; the others: random)")
    g.add_argument("--model", type=_model_dir, default=None, metavar="DIR",
                   help="local Hugging Face directory (overrides --preset)")
    g.add_argument("--num-prompts", type=ints["num_prompts"], default=64,
                   help="demo prompts to generate from")
    g.add_argument("--max-tokens", type=ints["max_tokens"], default=64,
                   help="tokens generated per prompt")
    g.add_argument("--temperature", type=real_range(0), default=0.8,
                   help="sampling temperature (0: greedy)")
    g.add_argument("--top-p", type=real_range(0, 1, open_lo=True), default=0.95,
                   help="nucleus sampling: keep the smallest set of tokens with this much "
                   "probability")
    add_step_flags(g, ints)
    g.add_argument("--seed", type=ints["seed"], default=0, help="weights (preset) and prompts")
    g.add_argument("--json", type=output_file, default=None, metavar="PATH",
                   help="write the summary here")
    g.set_defaults(func=cmd_generate)
    e = sub.add_parser("embed", help="embed TEXTs, print them and their cosine similarities",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    e.add_argument("texts", nargs="+", metavar="TEXT", help="texts to embed")
    e.add_argument("--preset", default="mini", choices=list(PRESETS),
                   help="embedded model, no download (mini: trained; the others: random)")
    e.add_argument("--model", type=_model_dir, default=None, metavar="DIR",
                   help="local Hugging Face directory (overrides --preset)")
    e.add_argument("--pooling", default=None, choices=STREAMING_KINDS,
                   help="pooler (None: the model's default)")
    add_dtype_flag(e)
    e.add_argument("--json", type=output_file, default=None, metavar="PATH",
                   help="write the texts and vectors here")
    e.set_defaults(func=cmd_embed, seed=0, token_budget=256, chunk_size=64, max_num_seqs=32)
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["sim"]:  # host-only: no jax import
        sim_main(argv[1:])
        return 0
    if argv[:1] == ["bench"]:
        from hetero_jax.bench.config import parse_config  # jax-free: --help stays fast
        try:
            cfg = parse_config(argv[1:])
            from hetero_jax.bench.cli import run_config
            return run_config(cfg)
        except (ValueError, FileNotFoundError) as e:
            print(f"hetero-jax bench: error: {e}", file=sys.stderr)
            return 2
    if argv[:1] == ["serve"]:  # checks every flag before jax
        from hetero_jax.server.cli import serve_main
        return serve_main(argv[1:])
    if argv[:1] == ["bench-serve"]:  # HTTP only: no jax
        from hetero_jax.bench.online import online_main
        return online_main(argv[1:])
    if argv[:1] == ["batch"]:  # checks everything before jax
        from hetero_jax.offline.cli import batch_main
        return batch_main(argv[1:])
    if argv[:1] == ["train-adapter"]:  # checks its flags before jax
        from hetero_jax.train.cli import train_main
        return train_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"hetero-jax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
