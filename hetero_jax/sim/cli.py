"""`hetero-jax sim`: run scheduling policies against a cost model and print what they give.

In: argv (workload, policies, budget, chunk size, replicas, cost model). `dedicated` (with
`--replicas` >= 2) is the static split: `--embed-replicas` replicas (default half) serve only
embeddings and the rest only generation, each in arrival order. Out: one table row
per policy on stdout (throughput per type, p50/p99 latency and TTFT, average budget fill,
embedding share of scheduled tokens) and, with `--json PATH`, the same numbers as JSON:
`{"config": {...}, "results": {policy: SimResult}}`. Imports no jax.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from hetero_jax.sched import EMBED, GENERATE, POLICIES, SchedulerConfig
from hetero_jax.sim.costmodel import HARDWARE, MODELS, load_cost_model
from hetero_jax.sim.report import format_table
from hetero_jax.sim.simulate import SimConfig, simulate
from hetero_jax.sim.workload import ARRIVALS, ORDERS, LengthDist, WorkloadConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetero-jax sim", description="Run scheduling "
                                "policies against a cost model and print what they give.")
    p.add_argument("--policy", default="ibs",
                   help=f"comma-separated policies, or 'all' ({', '.join(POLICIES)}, and "
                   "dedicated when --replicas >= 2)")
    p.add_argument("--cost", default="roofline:h200",
                   help=f"roofline:<{'|'.join(HARDWARE)}> or a cost model JSON file")
    p.add_argument("--model", default="mistral-7b", help=f"roofline model: {', '.join(MODELS)}")
    s = p.add_argument_group("scheduler")
    s.add_argument("--budget", type=int, default=256, help="token budget per step")
    s.add_argument("--chunk", type=int, default=64, help="chunk size")
    s.add_argument("--max-num-seqs", type=int, default=64)
    s.add_argument("--max-chunk-seqs", type=int, default=8)
    s.add_argument("--page-size", type=int, default=16)
    s.add_argument("--num-pages", type=int, default=16384)
    s.add_argument("--max-model-len", type=int, default=4096)
    s.add_argument("--replicas", type=int, default=1)
    s.add_argument("--embed-replicas", type=int, default=None,
                   help="dedicated: replicas that serve only embeddings (default: half)")
    w = p.add_argument_group("workload")
    w.add_argument("--requests", type=int, default=500)
    w.add_argument("--embed-frac", type=float, default=0.2)
    w.add_argument("--gen-prompt", default="128", help="length spec: 128 | 96,224 | "
                   "96:0.55,224:0.45 | 64-256")
    w.add_argument("--gen-output", default="256")
    w.add_argument("--embed-len", default="96:0.55,224:0.45")
    w.add_argument("--arrival", default="poisson", choices=ARRIVALS)
    w.add_argument("--rate", type=float, default=20.0, help="requests/s (poisson)")
    w.add_argument("--clients", type=int, default=32, help="closed-loop clients")
    w.add_argument("--order", default="mixed", choices=ORDERS)
    w.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p


def _configs(args) -> tuple:
    known = list(POLICIES) + ["dedicated"]
    policies = (known if args.replicas >= 2 else list(POLICIES)) if args.policy == "all" else \
        args.policy.split(",")
    for name in policies:
        if name not in known:
            raise SystemExit(f"unknown policy {name!r}; expected one of {', '.join(known)}")
    split = args.replicas // 2 if args.embed_replicas is None else args.embed_replicas
    if "dedicated" in policies and not 0 < split < args.replicas:
        raise SystemExit(f"dedicated needs --replicas >= 2 and 0 < --embed-replicas < "
                         f"--replicas (one device per type at least); got --replicas "
                         f"{args.replicas}, --embed-replicas {split}")
    workload = WorkloadConfig(
        num_requests=args.requests, embed_frac=args.embed_frac,
        gen_prompt=LengthDist.parse(args.gen_prompt), gen_output=LengthDist.parse(args.gen_output),
        embed_len=LengthDist.parse(args.embed_len), arrival=args.arrival, rate=args.rate,
        clients=args.clients, order=args.order, seed=args.seed)
    sched = SchedulerConfig(
        token_budget=args.budget, chunk_size=args.chunk, max_num_seqs=args.max_num_seqs,
        max_chunk_seqs=args.max_chunk_seqs, page_size=args.page_size, num_pages=args.num_pages,
        max_model_len=args.max_model_len)
    return policies, [
        SimConfig(dataclasses.replace(sched, policy="fcfs" if name == "dedicated" else name),
                  workload, args.replicas, split if name == "dedicated" else 0)
        for name in policies]


# (header, row key, format): latencies in milliseconds
COLUMNS = [
    ("policy", "policy", "{}"), ("gen req/s", "gen_rps", "{:.2f}"),
    ("gen tok/s", "gen_tps", "{:.0f}"), ("emb req/s", "emb_rps", "{:.2f}"),
    ("gen p50 ms", "gen_p50", "{:.1f}"), ("gen p99 ms", "gen_p99", "{:.1f}"),
    ("TTFT p50 ms", "ttft_p50", "{:.1f}"), ("TTFT p99 ms", "ttft_p99", "{:.1f}"),
    ("emb p50 ms", "emb_p50", "{:.1f}"), ("emb p99 ms", "emb_p99", "{:.1f}"),
    ("fill", "fill", "{:.0%}"), ("emb tokens", "emb_share", "{:.1%}"),
    ("steps", "steps", "{}"), ("preempted", "preemptions", "{}"),
]


def _ms(x):
    return None if x is None else 1e3 * x


def table_row(name: str, r) -> dict:
    """A `SimResult` as one row of `COLUMNS`."""
    g, e = r.per_type[GENERATE], r.per_type[EMBED]
    return dict(policy=name, gen_rps=g["throughput_rps"], gen_tps=g["tokens_per_s"],
                emb_rps=e["throughput_rps"], gen_p50=_ms(g["latency_p50_s"]),
                gen_p99=_ms(g["latency_p99_s"]), ttft_p50=_ms(g["ttft_p50_s"]),
                ttft_p99=_ms(g["ttft_p99_s"]), emb_p50=_ms(e["latency_p50_s"]),
                emb_p99=_ms(e["latency_p99_s"]), fill=r.avg_budget_fill,
                emb_share=r.embed_token_share, steps=r.steps, preemptions=r.preemptions)


def sim_main(argv=None) -> dict:
    """Entry point of `hetero-jax sim`; returns {policy: SimResult}."""
    args = build_parser().parse_args(argv)
    try:
        cost = load_cost_model(args.cost, args.model)
        policies, configs = _configs(args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"hetero-jax sim: {e}") from None
    results = {name: simulate(cfg, cost) for name, cfg in zip(policies, configs)}
    print(f"cost model: {cost.describe()}; {args.requests} requests, {args.arrival} arrivals, "
          f"{args.replicas} replica(s), budget {args.budget}, chunk {args.chunk}")
    print(format_table([table_row(n, r) for n, r in results.items()], COLUMNS))
    print("latencies from arrival; TTFT: to the first generated token; fill: scheduled tokens /\n"
          "token budget, mean over steps; emb tokens: the embeddings' share of scheduled tokens")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": {n: r.to_dict() for n, r in results.items()}},
                      f, indent=2)
    return results


if __name__ == "__main__":
    sim_main()
