"""Replica streams: time to the first delta against the end, and the batch path's time.

Two replicas of the `tiny` preset (one step variant, warmed up). `AsyncReplicas`: rounds of
4 concurrent greedy streams of 64 tokens; prints the median time to a stream's first delta, to
its end, and its number of deltas. `ReplicaSet.run` (the batch path, which never streams):
the median wall time of 16 greedy generations of 32 tokens. Needs two cores.

    python scripts/bench_replica_stream.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from hetero_jax import EngineConfig, GenerateRequest, SamplingParams, make_engine
from hetero_jax.serving.async_replicas import AsyncReplicas

CONFIG = dict(token_budget=64, chunk_size=32, max_num_seqs=8, max_model_len=256,
              token_buckets=(64,), chunk_seq_buckets=(4,), page_buckets=(16,), cascade_rows=0,
              warmup="all")


async def one_stream(front, i: int, params) -> tuple:
    """-> (seconds to the first delta, seconds to the end, number of deltas)."""
    start, first, count = time.perf_counter(), None, 0
    async for _ in front.generate([256, i + 1, 7], params):
        count += 1
        first = first or time.perf_counter() - start
    return first, time.perf_counter() - start, count


async def streams(replicas, rounds: int) -> list:
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    front = AsyncReplicas(replicas)
    results = []
    for _ in range(rounds + 1):  # the first round warms the front's threads: not counted
        results.append(await asyncio.gather(*[one_stream(front, i, params) for i in range(4)]))
    await front.close()
    return [r for batch in results[1:] for r in batch]


def batch_seconds(replicas, rounds: int) -> float:
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    requests = [GenerateRequest([256, i + 1, 7], params) for i in range(16)]
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        replicas.run(requests)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    replicas = make_engine("tiny", EngineConfig(**CONFIG), replicas=2)
    try:
        replicas.warmup()
        got = asyncio.run(streams(replicas, args.rounds))
        first, end, count = (statistics.median(column) for column in zip(*got))
        print(f"stream of 64 tokens, 4 at once: first delta p50 {first * 1e3:.1f} ms, end p50 "
              f"{end * 1e3:.1f} ms, deltas p50 {count:g}")
        print(f"run 16 x 32 tokens: median {batch_seconds(replicas, args.rounds) * 1e3:.0f} ms")
    finally:
        replicas.close()


if __name__ == "__main__":
    main()
