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
from hetero_jax.sim.simulate import SimConfig, simulate
from hetero_jax.sim.workload import ARRIVALS, ORDERS, LengthDist, WorkloadConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetero-jax sim", description=__doc__.splitlines()[0])
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


def _ms(x) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def format_table(results: dict) -> str:
    head = (f"{'policy':12s} {'gen req/s':>9s} {'gen tok/s':>9s} {'emb req/s':>9s} "
            f"{'gen p50/p99 ms':>16s} {'gen ttft p50/p99':>17s} {'emb p50/p99 ms':>16s} "
            f"{'fill':>5s} {'emb%':>5s} {'steps':>6s} {'preempt':>7s}")
    rows = [head]
    for name, r in results.items():
        g, e = r.per_type[GENERATE], r.per_type[EMBED]
        rows.append(
            f"{name:12s} {g['throughput_rps']:9.2f} {g['tokens_per_s']:9.0f} "
            f"{e['throughput_rps']:9.2f} "
            f"{_ms(g['latency_p50_s']) + '/' + _ms(g['latency_p99_s']):>16s} "
            f"{_ms(g['ttft_p50_s']) + '/' + _ms(g['ttft_p99_s']):>17s} "
            f"{_ms(e['latency_p50_s']) + '/' + _ms(e['latency_p99_s']):>16s} "
            f"{r.avg_budget_fill:5.2f} {100 * r.embed_token_share:5.1f} {r.steps:6d} "
            f"{r.preemptions:7d}")
    return "\n".join(rows)


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
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": {n: r.to_dict() for n, r in results.items()}},
                      f, indent=2)
    return results


if __name__ == "__main__":
    sim_main()
