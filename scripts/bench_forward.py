"""Step time of the mixed forward pass against its roofline floor, on this machine.

Measures the machine's peaks itself (fp32 matmul FLOP/s, memory read bandwidth), then times
one engine step (pack + jitted step + the one device->host copy) for decode batches of 1..256
tokens (each sequence with `--context` cached tokens) and for one 512-token prefill chunk.
Floor = max(FLOPs / peak, bytes / bandwidth), with bytes = weights + KV read + KV written.

    python scripts/bench_forward.py --preset small --json out/bench_forward.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from hetero_jax import Engine, EngineConfig
from hetero_jax.sched import DECODE, PREFILL, GenKnobs, ScheduledItem


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_peaks(repeats: int) -> tuple[float, float]:
    """(fp32 matmul FLOP/s, memory read bytes/s)."""
    n = 2048
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    flops = 2 * n**3 / median_time(lambda: mm(a).block_until_ready(), repeats)
    big = jnp.ones((64 * 2**20,), jnp.float32)  # 256 MB, far past the caches
    read = jax.jit(jnp.sum)
    bw = big.nbytes / median_time(lambda: read(big).block_until_ready(), repeats)
    return flops, bw


def step_cost(cfg, num_tokens: int, context: list) -> tuple[float, float]:
    """(FLOPs, bytes) of one fp32 step: layer matmuls on every token, attention over each
    sequence's context, the LM head on one row per sequence; weights and KV read once."""
    head = cfg.hidden_size * cfg.vocab_size
    layer_params = cfg.num_params - head * (1 if cfg.tie_word_embeddings else 2)
    attn_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * sum(context)
    flops = 2 * layer_params * num_tokens + attn_flops + 2 * head * len(context)
    kv_row = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    return flops, 4 * (layer_params + head) + kv_row * (sum(context) + num_tokens)


def fake_items(engine, lengths: list, kind: str) -> list:
    """Decoder items whose pages are allocated as if their context were already computed."""
    items = []
    for i, (ctx, n) in enumerate(lengths):
        pages = engine.scheduler.pages.allocate(-(-(ctx + n) // engine.config.page_size))
        items.append(ScheduledItem(
            request_id=10_000 + i, kind=kind, start=ctx, num_tokens=n, ends=True,
            token_ids=tuple(range(ctx, ctx + n)), pages=tuple(pages),
            knobs=GenKnobs(0.0, 0, 1.0, 0, None), num_output_tokens=int(kind == DECODE)))
    return items


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--context", type=int, default=128, help="cached tokens per decode sequence")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    cfg = EngineConfig(token_budget=max(max(batches), args.chunk), chunk_size=args.chunk,
                       max_num_seqs=max(batches), max_chunk_seqs=1, max_model_len=1024,
                       token_buckets=tuple(sorted(set(batches + [args.chunk]))),
                       seq_buckets=tuple(sorted(set(batches))), page_buckets=(16, 64),
                       chunk_seq_buckets=(0, 1))
    engine = Engine.from_preset(args.preset, config=cfg)
    flops_peak, bw = measure_peaks(args.repeats)
    print(f"{args.preset}: {engine.model_cfg.num_params / 1e6:.1f}M params; measured peaks: "
          f"{flops_peak / 1e9:.0f} GFLOP/s fp32 matmul, {bw / 1e9:.1f} GB/s memory read")
    cases = [(f"decode x{b}", [(args.context, 1)] * b, DECODE) for b in batches]
    cases.append((f"chunk {args.chunk}", [(0, args.chunk)], PREFILL))
    rows = []
    print(f"{'step':>12} {'tokens':>6} {'time ms':>8} {'floor ms':>8} {'bound':>7} {'of floor':>8}")
    for name, lengths, kind in cases:
        items = fake_items(engine, lengths, kind)
        num_tokens = sum(it.num_tokens for it in items)
        t = median_time(lambda: engine.runner.execute(items), args.repeats)
        flops, bytes_ = step_cost(engine.model_cfg, num_tokens,
                                  [it.start + it.num_tokens for it in items])
        floor = max(flops / flops_peak, bytes_ / bw)
        bound = "compute" if flops / flops_peak > bytes_ / bw else "memory"
        rows.append(dict(step=name, tokens=num_tokens, time_s=t, floor_s=floor, bound=bound,
                         gflops=flops / 1e9, mbytes=bytes_ / 1e6))
        print(f"{name:>12} {num_tokens:>6} {t * 1e3:>8.2f} {floor * 1e3:>8.2f} {bound:>7} "
              f"{floor / t:>7.0%}")
        for it in items:
            engine.scheduler.pages.free(list(it.pages))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(preset=args.preset, flops_peak=flops_peak, bandwidth=bw, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
