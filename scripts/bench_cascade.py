"""Decode attention with and without cascade: N sequences sharing a prefix, one layer.

Builds one step of N decode sequences whose page tables start with the same `--prefix` tokens of
pages (as prefix-cache hits leave them) followed by `--suffix` tokens of their own, on shuffled
pages, and times `ragged_paged_attention` plain and with the cascade plan of
`sched.tiles.plan_tiles`: on XLA at each `--rows` (sequences per tile); on the Pallas kernel
(`--impl pallas`) with an empty tile list (what every step without sharing runs) and with the
planner's tiles; medians of `--repeats` runs of `--iters` calls, in one process. Reports the
speed-up, the K/V bytes each variant must read (plain: every sequence's whole context; cascade:
each tile's shared pages once plus every sequence's own pages) and the bytes per second that
implies, and the largest difference from the plain result. `main` returns the rows; `--json
PATH` writes them.

    python scripts/bench_cascade.py --seqs 32 --prefix 1024 --suffix 64
    python scripts/bench_cascade.py --impl pallas --dtype bfloat16 --seqs 256 --prefix 2048 \
        --heads 32,8,128    # on a GPU
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.ops import ragged_paged_attention
from hetero_jax.ops.cascade import cascade_arrays, tile_list_arrays
from hetero_jax.sched.tiles import kernel_block_rows, plan_tiles, saved_pages
from hetero_jax.sim.report import format_table

COLUMNS = [("variant", "variant", "{}"), ("ms", "ms", "{:.2f}"), ("speed-up", "speedup", "{:.2f}"),
           ("KV MB", "kv_mb", "{:.1f}"), ("GB/s", "gb_per_s", "{:.1f}"),
           ("max |diff|", "max_diff", "{:.1e}")]


def shared_step(seqs, prefix, suffix, hq, hkv, d, page_size, seed=0):
    """Arrays of one decode step whose sequences share `prefix` tokens of pages."""
    rng = np.random.default_rng(seed)
    shared = prefix // page_size
    lens = [shared * page_size + suffix + i % page_size for i in range(seqs)]
    own = [-(-n // page_size) - shared for n in lens]
    num_pages = 1 + shared + sum(own)
    perm = rng.permutation(np.arange(1, num_pages))
    tables, used = [], shared
    for n in own:
        tables.append([int(p) for p in perm[:shared]] + [int(p) for p in perm[used:used + n]])
        used += n
    page_indices = np.zeros((seqs, max(map(len, tables))), np.int32)
    for s, t in enumerate(tables):
        page_indices[s, :len(t)] = t
    batch = dict(
        q=jnp.asarray(rng.standard_normal((seqs, hq, d)), jnp.float32),
        k_pages=jnp.asarray(rng.standard_normal((num_pages, page_size, hkv, d)), jnp.float32),
        v_pages=jnp.asarray(rng.standard_normal((num_pages, page_size, hkv, d)), jnp.float32),
        kv_lens=jnp.asarray(lens, jnp.int32), page_indices=jnp.asarray(page_indices),
        cu_q_lens=jnp.arange(seqs + 1, dtype=jnp.int32), num_seqs=jnp.int32(seqs))
    return batch, tables, lens


def median_seconds(fn, args, iters, repeats):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / iters)
    return statistics.median(times)


def xla_rows(step, batch, tables, lens, args, token_bytes, plain) -> list:
    """The XLA path's cascade (`CascadeMeta`) at each `--rows`: G = seqs // rows tiles."""
    rows, ps = [], args.page_size
    for m in (int(x) for x in args.rows.split(",")):
        if m > args.seqs:
            continue
        g = args.seqs // m
        plan = plan_tiles(tables, lens, ps, g, m, min_saved_pages=1)
        rest = max(-(-n // ps) - off for n, off in zip(lens, plan[1]))
        meta = jax.tree.map(jnp.asarray, cascade_arrays(
            tables, lens, ps, plan, g, m, max(n for _, n in plan[0]), rest, args.seqs))
        read = (sum(n for _, n in plan[0]) * ps + sum(n - off * ps for n, off in
                                                      zip(lens, plan[1]))) * token_bytes
        rows.append(timed(f"cascade, {m} rows x {g} tiles", step, batch, meta, read, plain, args))
    return rows


def pallas_rows(step, batch, tables, lens, args, token_bytes, plain, block: int) -> list:
    """The Pallas kernel's tiles as data (`TileList`): an empty list (what a step with nothing
    shared runs), then the planner's tiles, each read once per `block` members."""
    ps, s = args.page_size, args.seqs
    empty = jax.tree.map(jnp.asarray, tile_list_arrays(None, s, ps))
    rows = [timed("tiles, none shared", step, batch, empty, sum(lens) * token_bytes, plain,
                  args)]
    plan = plan_tiles(tables, lens, ps, s // 2, s, min_saved_pages=1)
    tiles = jax.tree.map(jnp.asarray, tile_list_arrays(plan, s, ps))
    read = (sum(lens) - ps * saved_pages(plan[0], block)) * token_bytes
    sizes = "/".join(str(len(m)) for m, _ in plan[0])
    rows.append(timed(f"tiles of {sizes}, {block} a read", step, batch, tiles, read, plain, args))
    return rows


def timed(name, step, batch, meta, read, plain, args) -> dict:
    secs = median_seconds(step, (batch, meta), args.iters, args.repeats)
    base = plain["ms"] / 1e3
    diff = float(jnp.max(jnp.abs(step(batch, meta).astype(jnp.float32) - plain["out"])))
    return dict(variant=name, ms=secs * 1e3, speedup=base / secs, kv_mb=read / 1e6,
                gb_per_s=read / secs / 1e9, max_diff=diff)


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--prefix", type=int, default=1024, help="shared tokens (whole pages)")
    p.add_argument("--suffix", type=int, default=64, help="own tokens of each sequence")
    p.add_argument("--rows", default="4,8,16,32", help="sequences per tile, comma-separated "
                   "(XLA; the Pallas kernel's tiles are the planner's)")
    p.add_argument("--heads", default="12,4,64", help="Hq,Hkv,D (default: the small preset)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--impl", choices=("xla", "pallas"), default="xla",
                   help="the attention (pallas: interpret mode off a GPU)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    batch, tables, lens = shared_step(args.seqs, args.prefix, args.suffix, hq, hkv, d,
                                      args.page_size)
    dtype = jnp.dtype(args.dtype)
    batch = dict(batch, **{k: batch[k].astype(dtype) for k in ("q", "k_pages", "v_pages")})
    hints = dict(num_multi_query_seqs=0, impl=args.impl)
    if args.impl == "pallas":
        hints["interpret"] = jax.default_backend() != "gpu"
    step = jax.jit(lambda b, meta: ragged_paged_attention(**b, **hints, cascade=meta))
    token_bytes = 2 * hkv * d * dtype.itemsize  # K and V of one token
    base = median_seconds(step, (batch, None), args.iters, args.repeats)
    kv = sum(lens) * token_bytes
    plain = dict(variant="plain", ms=base * 1e3, speedup=1.0, kv_mb=kv / 1e6,
                 gb_per_s=kv / base / 1e9, max_diff=0.0,
                 out=step(batch, None).astype(jnp.float32))
    rows = xla_rows(step, batch, tables, lens, args, token_bytes, plain) if args.impl == "xla" \
        else pallas_rows(step, batch, tables, lens, args, token_bytes, plain,
                         kernel_block_rows(hq, hkv))
    rows.insert(0, {k: v for k, v in plain.items() if k != "out"})
    print(f"{args.seqs} decode sequences sharing {args.prefix} tokens, {args.suffix}+ own; "
          f"Hq={hq} Hkv={hkv} D={d}, page {args.page_size}, {args.dtype}; {args.impl} on "
          f"{jax.devices()[0].platform}, medians of {args.repeats} x {args.iters} calls")
    print(format_table(rows, COLUMNS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
