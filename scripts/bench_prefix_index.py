"""The Chunked Hash Tree against the radix-tree LPM scan as the waiting queue grows (Feather's
Figure 21). Host only; imports no jax.

Builds `--groups` shared prefixes and, for each queue size in `--sizes`, that many waiting
requests with prompts of `--min-len`..`--max-len` tokens (log-uniform), each a group's prefix
cut at a random length (at least half the prompt) and then its own tokens, plus `--running`
admitted requests. Times, medians (and p99) over `--trials`:
- CHT insertion: `ChunkedHashTree.add` of a new `--max-len`-token prompt, its page digests
  computed beforehand (the prefix cache computes them anyway) and, apart, with the digests;
- CHT FindBest: `find_best()` right after a change (the cache invalidated), and the cost of
  the change itself (an admission and the request leaving again);
- radix LPM: inserting the same prompt into the tree of the running prompts, and one LPM
  scheduling pass (match every waiting prompt against the tree, sort by match length), as
  SGLang does for queues of up to 128 (it falls back to FCFS beyond that because of this cost).

    python scripts/bench_prefix_index.py --sizes 10,100,1000,10000 --json out.json
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

from hetero_jax.sched import Request
from hetero_jax.sched.cht import ChunkedHashTree
from hetero_jax.sched.hashing import chain_seed, page_hashes
from hetero_jax.sched.radix import RadixTree
from hetero_jax.sim.report import format_table

COLUMNS = [("waiting", "waiting", "{}"), ("CHT add us", "cht_add_us", "{:.0f}"),
           ("CHT add+hash us", "cht_add_hash_us", "{:.0f}"),
           ("FindBest us", "find_best_us", "{:.2f}"), ("FindBest p99", "find_best_p99_us",
                                                       "{:.2f}"),
           ("change us", "change_us", "{:.0f}"), ("radix ins us", "radix_insert_us", "{:.0f}"),
           ("LPM scan ms", "lpm_scan_ms", "{:.2f}"), ("LPM/FindBest", "speedup", "{:.0f}x")]
SEED = chain_seed("bench-prefix-index")


def prompts(n: int, prefixes: list, lo: int, hi: int, rng: random.Random, base: int) -> list:
    out = []
    for i in range(n):
        length = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        shared = rng.randint(length // 2, length)
        prefix = rng.choice(prefixes)[:shared]
        own = [base + i * 10_007 + j for j in range(length - len(prefix))]
        out.append(prefix + own)
    return out


def make_request(rid: int, tokens: list, page_size: int, hashed: bool = True) -> Request:
    req = Request(rid, tokens, 1, cache_seed=SEED)
    if hashed:
        req.block_hashes = page_hashes(tokens, page_size, SEED)
    return req


def timed(fn, trials: int) -> list:
    out = []
    for _ in range(trials):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def p99(xs: list) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]


def measure(size: int, args, rng: random.Random) -> dict:
    ps = args.page_size
    prefixes = [[g * 100_003 + j for j in range(args.max_len)] for g in range(args.groups)]
    cht, tree = ChunkedHashTree(ps, args.chunk_pages), RadixTree()
    running = [make_request(i, t, ps) for i, t in enumerate(
        prompts(args.running, prefixes, args.min_len, args.max_len, rng, 10**8))]
    waiting = [make_request(args.running + i, t, ps) for i, t in enumerate(
        prompts(size, prefixes, args.min_len, args.max_len, rng, 2 * 10**8))]
    for r in running + waiting:
        cht.add(r)
    for r in running:
        cht.admit(r)
        tree.insert(r.prompt_token_ids)
    new = prompts(args.trials, prefixes, args.max_len, args.max_len, rng, 3 * 10**8)
    fresh = [make_request(10**7 + i, t, ps) for i, t in enumerate(new)]
    raw = [make_request(2 * 10**7 + i, t, ps, hashed=False) for i, t in enumerate(new)]
    add = [timed(lambda r=r: cht.add(r), 1)[0] for r in fresh]
    add_hash = [timed(lambda r=r: cht.add(r), 1)[0] for r in raw]
    for r in fresh + raw:
        cht.remove(r)

    def fresh_best():
        cht._changed()  # as after any change: the cached answer is gone
        cht.find_best()
    best = timed(fresh_best, args.trials)
    changes = []
    for r in rng.sample(waiting, min(args.trials, len(waiting))):
        t0 = time.perf_counter()
        cht.admit(r)
        cht.preempt(r)
        changes.append((time.perf_counter() - t0) / 2)
    radix = []
    for t in new:
        radix.append(timed(lambda t=t: tree.insert(t), 1)[0])
        tree.remove(t)
    scans = max(1, min(args.trials, 20_000 // size))

    def lpm_scan():
        match = {r.request_id: tree.match(r.prompt_token_ids) for r in waiting}
        sorted(waiting, key=lambda r: -match[r.request_id])
    scan = timed(lpm_scan, scans)
    us = 1e6
    return dict(waiting=size, cht_add_us=us * statistics.median(add),
                cht_add_hash_us=us * statistics.median(add_hash),
                find_best_us=us * statistics.median(best), find_best_p99_us=us * p99(best),
                change_us=us * statistics.median(changes),
                radix_insert_us=us * statistics.median(radix),
                lpm_scan_ms=1e3 * statistics.median(scan),
                speedup=statistics.median(scan) / statistics.median(best))


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="10,100,1000,10000")
    p.add_argument("--min-len", type=int, default=1000)
    p.add_argument("--max-len", type=int, default=10000)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--running", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk-pages", type=int, default=4)
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    rows = [measure(int(n), args, rng) for n in args.sizes.split(",")]
    print(f"{args.groups} prefix groups, prompts of {args.min_len}-{args.max_len} tokens, "
          f"{args.running} running, pages of {args.page_size}, chunks of {args.chunk_pages} "
          f"pages; medians of {args.trials} trials")
    print(format_table(rows, COLUMNS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=vars(args), rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
