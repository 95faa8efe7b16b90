"""Host time of `Scheduler.schedule()` (and `update()`) with a deep queue, per policy.

Keeps `--queued` requests waiting (topped up after every step; 80% generation, 20% embedding;
each starts with one of 8 shared 64-192-token prefixes) while up to `--max-num-seqs` run, with
prefix caching on and off (`--prefix-caching`), drives the scheduler with a fake runner (no
model, no jax), and prints the mean, p50 and p99 of schedule() and update() per step (the target: under 1 ms
per schedule() with 1,000 queued requests). `main` returns one dict per policy (`--json PATH`
writes the list): the times in microseconds, the timed steps and the tokens they scheduled.

    python scripts/bench_schedule.py --queued 1000 --steps 2000 --prefix-caching on,off
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from hetero_jax.sched import (EMBED, GENERATE, POLICIES, Request, RunnerOutput, SampledToken,
                              Scheduler, SchedulerConfig)
from hetero_jax.sched.hashing import chain_seed
from hetero_jax.sim.report import format_table, percentile

COLUMNS = [("policy", "policy", "{}"), ("caching", "prefix_caching", "{}"),
           ("queued", "queued", "{}"), ("steps", "steps", "{}"), ("hit", "hit_rate", "{:.0%}"),
           ("schedule() mean us", "schedule_mean_us", "{:.1f}"),
           ("p50 us", "schedule_p50_us", "{:.1f}"), ("p99 us", "schedule_p99_us", "{:.1f}"),
           ("update() mean us", "update_mean_us", "{:.1f}")]


PREFIXES = [[g] * (64 + 16 * g) for g in range(8)]
SEED = chain_seed("bench_schedule")


def make_request(rid: int, rng: random.Random) -> Request:
    prefix = rng.choice(PREFIXES)
    if rng.random() < 0.2:
        return Request(rid, prefix + [rid] * rng.choice((32, 96)), kind=EMBED, cache_seed=SEED)
    return Request(rid, prefix + [rid] * rng.randint(16, 64), rng.randint(16, 256),
                   kind=GENERATE, cache_seed=SEED)


def fake_output(out) -> RunnerOutput:
    sampled = {it.request_id: SampledToken(11, 0.0) for it in out.items if it.samples}
    return RunnerOutput(sampled)


def bench(policy: str, caching: bool, args) -> dict:
    cfg = SchedulerConfig(token_budget=args.budget, chunk_size=args.chunk,
                          max_num_seqs=args.max_num_seqs, max_chunk_seqs=args.max_chunk_seqs,
                          page_size=16, num_pages=args.num_pages, policy=policy,
                          prefix_caching=caching)
    sched, rng, next_id = Scheduler(cfg), random.Random(0), 0
    t_sched, t_update, tokens = [], [], 0
    for step in range(args.warmup + args.steps):
        while sched.num_waiting < args.queued:
            sched.add(make_request(next_id, rng))
            next_id += 1
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        sched.update(out, fake_output(out))
        t2 = time.perf_counter()
        if step >= args.warmup:
            t_sched.append(t1 - t0)
            t_update.append(t2 - t1)
            tokens += out.num_tokens
    us = lambda xs, q: 1e6 * percentile(xs, q)  # noqa: E731
    cache = sched.cache_stats()
    return {"policy": policy, "prefix_caching": "on" if caching else "off",
            "hit_rate": cache.hit_pages / max(cache.query_pages, 1), "queued": args.queued,
            "running": len(sched.running),
            "steps": len(t_sched), "scheduled_tokens": tokens,
            "schedule_mean_us": 1e6 * statistics.fmean(t_sched), "schedule_p50_us": us(t_sched, 50),
            "schedule_p99_us": us(t_sched, 99), "update_mean_us": 1e6 * statistics.fmean(t_update)}


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queued", type=int, default=1000)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-chunk-seqs", type=int, default=4)
    p.add_argument("--num-pages", type=int, default=4096)
    p.add_argument("--policy", default=",".join(POLICIES))
    p.add_argument("--prefix-caching", default="on,off", help="on, off or on,off")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    rows = [bench(name, on == "on", args) for name in args.policy.split(",")
            for on in args.prefix_caching.split(",")]
    print(format_table(rows, COLUMNS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
