"""Soak test: many mixed requests through one AsyncEngine, with bad requests and cancellations.

N requests (generations of 1-8 tokens and embeddings of 1-64 tokens, on the `tiny` preset by
default) run through `--concurrency` client coroutines; a `--bad-frac` share are malformed
(and must raise ValueError in their own coroutine), a `--cancel-frac` share are cancelled
after a few milliseconds. Every `--every` requests it prints the resident memory, the
compiles, the free KV pages and pooler slots, and the outcomes so far; at the end it checks
that no request, page or slot is left and that nothing compiled after the warm-up.

    python scripts/soak.py --requests 20000          # about 10 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from hetero_jax import AsyncEngine, Engine, EngineConfig, PoolingParams, SamplingParams

CONFIG = EngineConfig(token_budget=64, chunk_size=16, max_num_seqs=16, max_chunk_seqs=2,
                      max_model_len=128, token_buckets=(16, 64), page_buckets=(8,), warmup="all")


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def make_call(aengine, rng: random.Random, bad: bool):
    """A coroutine for one random request; a bad one has one random defect."""
    ids = [rng.randrange(1, 256) for _ in range(rng.randint(1, 64))]
    if bad:
        ids = rng.choice([[], [1, 9999], [1, 2.5], "x\ud800"])
    if rng.random() < 0.5:
        return aengine.embed(ids, PoolingParams(rng.choice(["mean", "cls", "last"])))
    params = SamplingParams(max_tokens=rng.randint(1, 8), temperature=rng.choice([0.0, 0.8]),
                            seed=rng.randrange(2**32), ignore_eos=True)
    return aengine.generate(ids, params)


async def soak(engine, args) -> dict:
    aengine = AsyncEngine(engine)
    counts = dict(ok=0, bad=0, cancelled=0)
    rows, next_index, start = [], iter(range(args.requests)), time.perf_counter()

    async def client(seed: int):
        rng = random.Random(seed)
        for i in next_index:
            bad = rng.random() < args.bad_frac
            task = asyncio.ensure_future(make_call(aengine, rng, bad))
            if rng.random() < args.cancel_frac:
                await asyncio.sleep(rng.random() * 0.01)
                task.cancel()
            try:
                await task
                assert not bad, f"request {i} was malformed and served"
                counts["ok"] += 1
            except asyncio.CancelledError:
                counts["cancelled"] += 1
            except ValueError:
                assert bad, f"request {i} was good and refused"
                counts["bad"] += 1
            if (i + 1) % args.every == 0:
                rows.append(report(engine, i + 1, time.perf_counter() - start, counts))

    try:
        await asyncio.gather(*(client(args.seed * 1000 + c) for c in range(args.concurrency)))
    finally:
        await aengine.close()
    return dict(counts=counts, rows=rows)


def report(engine, done: int, wall: float, counts: dict) -> dict:
    s = engine.scheduler
    row = dict(requests=done, wall_s=round(wall, 1), rss_mb=round(rss_mb(), 1),
               compiles=engine.stats.compiles, free_pages=s.cache_stats().free_pages,
               free_slots=s.slots.num_free, **counts)
    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=48)
    ap.add_argument("--bad-frac", type=float, default=0.05)
    ap.add_argument("--cancel-frac", type=float, default=0.05)
    ap.add_argument("--every", type=int, default=1000, help="report every this many requests")
    ap.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the reports here")
    args = ap.parse_args(argv)
    engine = Engine.from_preset(args.preset, config=CONFIG)
    compiled = engine.warmup()
    print(f"warm-up: {compiled} step variants; rss {rss_mb():.0f} MB", flush=True)
    result = asyncio.run(soak(engine, args))
    s = engine.scheduler
    assert not s.requests and not engine.has_work(), "requests left in the engine"
    assert s.cache_stats().free_pages == s.cfg.num_pages - 1, "KV pages leaked"
    assert s.slots.num_free == s.cfg.max_num_seqs, "pooler slots leaked"
    assert engine.stats.compiles == compiled, "a step compiled after the warm-up"
    rss = [r["rss_mb"] for r in result["rows"]]
    if rss:
        print(f"rss after the first report: {rss[0]:.0f} MB, at the end {rss[-1]:.0f} MB "
              f"(max {max(rss):.0f}); nothing left, {compiled} compiles", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(vars(args), **result), f, indent=1)
    return result


if __name__ == "__main__":
    main()
