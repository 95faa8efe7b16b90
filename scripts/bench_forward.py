"""Step time of the mixed forward pass against its roofline floor, on this machine.

Measures the machine's peaks itself (fp32 matmul FLOP/s, memory read bandwidth), then times
one engine step (pack + jitted step + the one device->host copy) for decode batches of 1..256
tokens (each sequence with `--context` cached tokens) and for one 512-token prefill chunk.
Floor = max(FLOPs / peak, bytes / bandwidth), with bytes = weights + KV read + KV written.

Then the mixed step next to its two parts (`--mixed CHUNKS:LEN:DECODES`, default 4:60:16, a
256-token step): CHUNKS fresh embedding chunks of LEN tokens with DECODES decode tokens at
`--context`, the embedding chunks alone and the decodes alone, on an engine with the default
bucket lists (as the engine runs them), timed round-robin, medians of `--repeats`. It prints
what the mixed step costs past the embedding-only step as a fraction of the decode-only step
(issue target: at most 40%; 100% means mixing saved nothing).

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
from hetero_jax.sched import (DECODE, EMBED, PREFILL, EmbedKnobs, GenKnobs, ScheduledItem,
                              SchedulerOutput)


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_peaks(repeats: int, dtype=jnp.float32) -> tuple[float, float]:
    """(matmul FLOP/s in `dtype`, memory read bytes/s)."""
    n = 2048 if jax.default_backend() == "cpu" else 8192
    a = jnp.ones((n, n), dtype)
    mm = jax.jit(lambda x: x @ x)
    flops = 2 * n**3 / median_time(lambda: mm(a).block_until_ready(), repeats)
    # 256 MB on a CPU, 2 GB on a GPU: far past the caches, and long past a launch's overhead
    big = jnp.ones(((64 if jax.default_backend() == "cpu" else 512) * 2**20,), jnp.float32)
    read = jax.jit(jnp.sum)
    bw = big.nbytes / median_time(lambda: read(big).block_until_ready(), repeats)
    return flops, bw


def step_cost(cfg, num_tokens: int, context: list, itemsize: int = 4) -> tuple[float, float]:
    """(FLOPs, bytes) of one step with `itemsize`-byte weights and KV: layer matmuls on every
    token, attention over each sequence's context, the LM head on one row per sequence;
    weights and KV read once."""
    head = cfg.hidden_size * cfg.vocab_size
    layer_params = cfg.num_params - head * (1 if cfg.tie_word_embeddings else 2)
    attn_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * sum(context)
    flops = 2 * layer_params * num_tokens + attn_flops + 2 * head * len(context)
    kv_row = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    return flops, itemsize * (layer_params + head) + kv_row * (sum(context) + num_tokens)


def fake_items(engine, lengths: list, kind: str, first_id: int = 10_000) -> list:
    """Decoder items whose pages are allocated as if their context were already computed
    (an embedding item: a whole fresh input in one chunk, pooled into slot i)."""
    items = []
    for i, (ctx, n) in enumerate(lengths):
        pages = engine.scheduler.pages.allocate(-(-(ctx + n) // engine.config.page_size))
        embed = kind == EMBED
        items.append(ScheduledItem(
            request_id=first_id + i, kind=kind, start=ctx, num_tokens=n, ends=True,
            token_ids=tuple(range(ctx, ctx + n)), pages=tuple(pages),
            knobs=EmbedKnobs(0, True) if embed else GenKnobs(0.0, 0, 1.0, 0, None),
            num_output_tokens=int(kind == DECODE), pool_slot=i if embed else None))
    return items


def forward_config(batches: list, context: int, chunk: int | None, dtype: str) -> EngineConfig:
    """An engine whose buckets are exactly these decode batches (at `context` cached tokens
    each) and one `chunk`-token prefill chunk (None: a 64-token bucket no case uses), with
    pages for the largest case."""
    chunk = chunk or 64
    max_len = max(1024, context + 16)
    return EngineConfig(token_budget=max(max(batches), chunk), chunk_size=chunk,
                        max_num_seqs=max(batches), max_chunk_seqs=1, max_model_len=max_len,
                        token_buckets=tuple(sorted(set(batches + [chunk]))),
                        seq_buckets=tuple(sorted(set(batches))),
                        page_buckets=tuple(sorted({16, 64, -(-max_len // 16)})),
                        chunk_seq_buckets=(0, 1), dtype=dtype,
                        # the largest case's pages, past kv_cache_gib's default cap where need
                        # be (and at least a max_model_len sequence's, as the engine asks)
                        num_pages=max(max(batches) * -(-(context + 1) // 16),
                                      -(-max(max_len, chunk) // 16)) + 1)


def mixed_vs_parts(preset: str, spec: str, context: int, repeats: int,
                   dtype: str = "auto") -> dict:
    """The mixed step of `spec` (CHUNKS:LEN:DECODES) and its embedding-only and decode-only
    parts on the default buckets, timed round-robin; medians in seconds."""
    chunks, length, decodes = (int(x) for x in spec.split(":"))
    engine = Engine.from_preset(preset, config=EngineConfig(
        token_budget=max(256, chunks * length + decodes), chunk_size=max(64, length),
        max_chunk_seqs=max(4, chunks), max_num_seqs=max(32, chunks + decodes),
        max_model_len=max(2048, context + 16), dtype=dtype))
    embeds = fake_items(engine, [(0, length)] * chunks, EMBED)
    decs = fake_items(engine, [(context, 1)] * decodes, DECODE, first_id=20_000)
    cases = {name: SchedulerOutput(items, []) for name, items in (
        ("mixed", embeds + decs), ("embed-only", embeds), ("decode-only", decs))}
    times = {name: [] for name in cases}
    for name, step in cases.items():  # compile, and one run each before timing
        engine.runner.execute(step)
    for _ in range(repeats):
        for name, step in cases.items():
            times[name].append(engine.runner.execute(step).step_time)
    out = {name: statistics.median(t) for name, t in times.items()}
    out["extra_over_decode"] = (out["mixed"] - out["embed-only"]) / out["decode-only"]
    return dict(spec=spec, context=context, **out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--context", type=int, default=128, help="cached tokens per decode sequence")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mixed", default="4:60:16", help="CHUNKS:LEN:DECODES of the mixed step "
                    "timed next to its parts ('none': skip)")
    ap.add_argument("--dtype", default="auto", help="EngineConfig.dtype (default: %(default)s: "
                    "bfloat16 on GPUs, float32 on CPUs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    engine = Engine.from_preset(args.preset, config=forward_config(
        batches, args.context, args.chunk, args.dtype))
    dtype = jnp.dtype(engine.config.dtype)
    flops_peak, bw = measure_peaks(args.repeats, dtype)
    print(f"{args.preset}: {engine.model_cfg.num_params / 1e6:.1f}M params in {dtype}; measured "
          f"peaks: {flops_peak / 1e9:.0f} GFLOP/s {dtype} matmul, {bw / 1e9:.1f} GB/s memory "
          "read")
    cases = [(f"decode x{b}", [(args.context, 1)] * b, DECODE) for b in batches]
    cases.append((f"chunk {args.chunk}", [(0, args.chunk)], PREFILL))
    rows = []
    print(f"{'step':>12} {'tokens':>6} {'time ms':>8} {'floor ms':>8} {'bound':>7} {'of floor':>8}")
    for name, lengths, kind in cases:
        items = fake_items(engine, lengths, kind)
        num_tokens = sum(it.num_tokens for it in items)
        t = median_time(lambda: engine.runner.execute(SchedulerOutput(items, [])), args.repeats)
        flops, bytes_ = step_cost(engine.model_cfg, num_tokens,
                                  [it.start + it.num_tokens for it in items], dtype.itemsize)
        floor = max(flops / flops_peak, bytes_ / bw)
        bound = "compute" if flops / flops_peak > bytes_ / bw else "memory"
        rows.append(dict(step=name, tokens=num_tokens, time_s=t, floor_s=floor, bound=bound,
                         gflops=flops / 1e9, mbytes=bytes_ / 1e6))
        print(f"{name:>12} {num_tokens:>6} {t * 1e3:>8.2f} {floor * 1e3:>8.2f} {bound:>7} "
              f"{floor / t:>7.0%}")
        for it in items:
            engine.scheduler.pages.free(list(it.pages))
    mixed = None
    if args.mixed != "none":
        mixed = mixed_vs_parts(args.preset, args.mixed, args.context, args.repeats, args.dtype)
        print(f"mixed step {args.mixed} (chunks:len:decodes at {args.context} cached): mixed "
              f"{mixed['mixed'] * 1e3:.1f} ms, embedding-only {mixed['embed-only'] * 1e3:.1f} "
              f"ms, decode-only {mixed['decode-only'] * 1e3:.1f} ms; the mixed step costs "
              f"{mixed['extra_over_decode']:.0%} of the decode-only step past the embedding-only"
              " one (target <= 40%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(preset=args.preset, dtype=str(dtype), flops_peak=flops_peak, bandwidth=bw, rows=rows,
                           mixed=mixed), f, indent=1)


if __name__ == "__main__":
    main()
