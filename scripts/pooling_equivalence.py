"""Chunked vs single-pass embeddings (the paper's Table 7) on an embedded preset.

Embeds `--num-inputs` random token inputs with lengths spread over the model's range once in a
single pass (chunk size = the longest input) and once per chunk size, for every pooling head,
and reports min cosine similarity and mean / p99 relative L2 error of chunked vs single-pass,
for each dtype.

    python scripts/pooling_equivalence.py --preset tiny --json out/pooling.json
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from hetero_jax import Engine, EngineConfig, PoolingParams
from hetero_jax.requests import STREAMING_KINDS


def engine_for(preset: str, chunk: int, max_len: int, dtype: str) -> Engine:
    budget = min(max(4 * chunk, 256), max_len)
    cfg = EngineConfig(token_budget=budget, chunk_size=chunk, max_num_seqs=8, max_chunk_seqs=4,
                       max_model_len=max_len, dtype=dtype, token_buckets=(budget,),
                       seq_buckets=(8,), page_buckets=(-(-max_len // 16),))
    return Engine.from_preset(preset, seed=0, config=cfg)


def embed_all(engine: Engine, inputs: list) -> dict:
    return {p: engine.embed(inputs, PoolingParams(p, normalize=False), use_tqdm=False)
            for p in STREAMING_KINDS}


def compare(got: np.ndarray, want: np.ndarray) -> dict:
    cos = np.sum(got * want, -1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    rel = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    return dict(min_cosine=float(cos.min()), mean_rel_l2=float(rel.mean()),
                p99_rel_l2=float(np.percentile(rel, 99)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--num-inputs", type=int, default=250)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--chunks", default="16,64,256,512")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    lengths = np.linspace(1, args.max_len, args.num_inputs).astype(int)
    inputs = [rng.integers(0, 256, int(n)).tolist() for n in rng.permutation(lengths)]
    chunks = [int(c) for c in args.chunks.split(",")]
    print(f"{args.num_inputs} inputs of 1..{args.max_len} tokens, preset {args.preset}; "
          "chunked vs single pass", flush=True)
    print(f"{'dtype':>8} {'chunk':>5} {'chunks':>6} {'pooling':>13} {'min cos':>9} "
          f"{'mean relL2':>10} {'p99 relL2':>10}", flush=True)
    rows = []
    for dtype in args.dtypes.split(","):
        want = embed_all(engine_for(args.preset, args.max_len, args.max_len, dtype), inputs)
        for chunk in chunks:
            got = embed_all(engine_for(args.preset, chunk, args.max_len, dtype), inputs)
            for pooling in STREAMING_KINDS:
                r = dict(dtype=dtype, chunk=chunk, pooling=pooling,
                         max_chunks=-(-args.max_len // chunk),
                         **compare(got[pooling], want[pooling]))
                rows.append(r)
                print(f"{r['dtype']:>8} {r['chunk']:>5} {r['max_chunks']:>6} {r['pooling']:>13} "
                      f"{r['min_cosine']:>9.6f} {r['mean_rel_l2']:>10.2e} "
                      f"{r['p99_rel_l2']:>10.2e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
