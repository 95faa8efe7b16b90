"""Times ragged paged attention: the Pallas kernel vs the XLA version vs dense attention.

In: workloads of prefill chunks (from an empty cache) and decode tokens over shuffled KV pages.
Out: a table on stdout and, with `--out DIR` (default `$OUT`), `DIR/bench_attention.json`.
The dense baseline is `jax.nn.dot_product_attention` on the same K/V gathered into contiguous
`[B, L, Hkv, D]` arrays beforehand (gather not timed). Decode workloads also report the KV bytes
read per second as a fraction of the device's copy bandwidth, measured here with a big
elementwise copy. `--cpu-smoke` runs tiny shapes with the kernel in Pallas interpret mode.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.ops import ragged_paged_attention
from hetero_jax.ops.pallas_attention import ragged_paged_attention_pallas


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    chunk_len: int  # new tokens of each prefill chunk (empty cache before it)
    num_chunks: int
    decode_ctx: tuple[int, ...]  # context of each decode sequence, its new token included
    hq: int = 32
    hkv: int = 8
    d: int = 128
    page_size: int = 16


def _ragged(rng, n, lo, hi):
    return tuple(int(x) for x in rng.integers(lo, hi, n))


def gpu_workloads():
    rng = np.random.default_rng(0)
    return [
        Workload("decode 8 x 4096", 0, 0, (4096,) * 8),
        Workload("decode 64 x 2048", 0, 0, (2048,) * 64),
        Workload("decode 256 x U[256,2048)", 0, 0, _ragged(rng, 256, 256, 2048)),
        Workload("decode 64 x 2048, GQA 8, D 64", 0, 0, (2048,) * 64, hq=32, hkv=4, d=64),
        Workload("mixed 2 x 512 chunk + 62 x 2048 decode", 512, 2, (2048,) * 62),
        Workload("mixed 1 x 1024 chunk + 127 x U[256,2048)", 1024, 1,
                 _ragged(rng, 127, 256, 2048)),
    ]


def smoke_workloads():
    return [Workload("smoke decode", 0, 0, (40, 17, 5), hq=4, hkv=2, d=64, page_size=8),
            Workload("smoke mixed", 12, 2, (9, 30), hq=4, hkv=2, d=64, page_size=8)]


def make_batch(w: Workload, dtype, seed=0):
    """Paged arrays (chunks first, then decode tokens, as the runner sorts them) + dense ones."""
    q_lens = [w.chunk_len] * w.num_chunks + [1] * len(w.decode_ctx)
    kv_lens = [w.chunk_len] * w.num_chunks + list(w.decode_ctx)
    npages = [-(-n // w.page_size) for n in kv_lens]
    pps, num_pages = max(npages), 1 + sum(npages)
    perm = np.random.default_rng(seed).permutation(np.arange(1, num_pages))
    page_indices = np.zeros((len(kv_lens), pps), np.int32)
    for s, start in enumerate(np.cumsum([0] + npages[:-1])):
        page_indices[s, :npages[s]] = perm[start:start + npages[s]]
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    t = sum(q_lens)
    paged = dict(
        q=jax.random.normal(kq, (t, w.hq, w.d), dtype),
        k_pages=jax.random.normal(kk, (num_pages, w.page_size, w.hkv, w.d), dtype),
        v_pages=jax.random.normal(kv, (num_pages, w.page_size, w.hkv, w.d), dtype),
        kv_lens=jnp.asarray(kv_lens, jnp.int32), page_indices=jnp.asarray(page_indices),
        cu_q_lens=jnp.asarray(np.cumsum([0] + q_lens), jnp.int32),
        num_seqs=jnp.int32(len(q_lens)))
    dense_k = paged["k_pages"][page_indices].reshape(len(kv_lens), -1, w.hkv, w.d)
    dense_v = paged["v_pages"][page_indices].reshape(len(kv_lens), -1, w.hkv, w.d)
    c, lc = w.num_chunks, w.chunk_len
    dense = dict(
        qc=paged["q"][:c * lc].reshape(c, lc, w.hq, w.d),
        kc=dense_k[:c, :lc], vc=dense_v[:c, :lc],
        qd=paged["q"][c * lc:, None], kd=dense_k[c:], vd=dense_v[c:],
        lens=paged["kv_lens"][c:])
    return paged, dense


@jax.jit
def dense_attention(qc, kc, vc, qd, kd, vd, lens):
    """Chunks: causal from an empty cache; decode: one query over `lens` keys."""
    outs = []
    if qc.shape[0]:
        outs.append(jax.nn.dot_product_attention(qc, kc, vc, is_causal=True))
    if qd.shape[0]:
        outs.append(jax.nn.dot_product_attention(qd, kd, vd, key_value_seq_lengths=lens))
    return outs


def time_fn(fn, *args, iters, repeats=3, **kwargs):
    """Seconds per call: best over `repeats` of `iters` back-to-back calls (compile excluded)."""
    jax.block_until_ready(fn(*args, **kwargs))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args, **kwargs)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def copy_bandwidth(nbytes, iters):
    """Bytes read + written per second by an elementwise op over an `nbytes` array."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    return 2 * x.nbytes / time_fn(jax.jit(lambda a: a + 1.0), x, iters=iters)


def bench_workload(w, dtype, variants, interpret, iters, copy_bw):
    paged, dense = make_batch(w, dtype)
    hints = dict(max_q_len=max(w.chunk_len, 1), num_multi_query_seqs=w.num_chunks)
    want = ragged_paged_attention(**paged, **hints)
    shape = dataclasses.asdict(w) | dict(decode_ctx=dict(seqs=len(w.decode_ctx),
                                                          tokens=sum(w.decode_ctx)))
    row = dict(workload=shape,
               xla_s=time_fn(ragged_paged_attention, **paged, **hints, iters=iters),
               dense_s=time_fn(dense_attention, *dense.values(), iters=iters), pallas={})
    for name, kw in variants.items():
        got = ragged_paged_attention_pallas(**paged, **kw, interpret=interpret)
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        row["pallas"][name] = dict(
            seconds=time_fn(ragged_paged_attention_pallas, **paged, **kw, interpret=interpret,
                            iters=iters), max_abs_diff_vs_xla=err)
    best = min(row["pallas"], key=lambda n: row["pallas"][n]["seconds"])
    row["pallas_best"] = best
    if w.num_chunks == 0:  # decode only: K and V of every context token, read once
        kv_bytes = 2 * sum(w.decode_ctx) * w.hkv * w.d * jnp.dtype(dtype).itemsize
        row["kv_bytes"] = kv_bytes
        for key, secs in (("pallas", row["pallas"][best]["seconds"]), ("xla", row["xla_s"]),
                          ("dense", row["dense_s"])):
            row[f"{key}_kv_fraction_of_copy_bw"] = kv_bytes / secs / copy_bw
    return row


def report(rows, copy_bw):
    print(f"copy bandwidth: {copy_bw / 1e9:.1f} GB/s (read + write)")
    print(f"{'workload':44s} {'pallas us':>10s} {'xla us':>9s} {'dense us':>9s} "
          f"{'pallas/xla':>10s} {'KV frac':>8s}  best variant, max |diff| vs xla")
    for r in rows:
        p = r["pallas"][r["pallas_best"]]
        frac = r.get("pallas_kv_fraction_of_copy_bw")
        print(f"{r['workload']['name']:44s} {p['seconds'] * 1e6:10.1f} {r['xla_s'] * 1e6:9.1f} "
              f"{r['dense_s'] * 1e6:9.1f} {p['seconds'] / r['xla_s']:10.2f} "
              f"{'' if frac is None else f'{frac:8.2f}':>8s}  {r['pallas_best']}, "
              f"{p['max_abs_diff_vs_xla']:.2e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny shapes, kernel in interpret mode (runs on CPU)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory for the JSON")
    args = parser.parse_args()
    if args.cpu_smoke:
        workloads, dtype, interpret, iters = smoke_workloads(), jnp.float32, True, 2
        variants = {"default": {}}
        copy_bw = copy_bandwidth(1 << 24, iters=2)
    else:
        assert jax.default_backend() == "gpu", f"no GPU: {jax.devices()}; try --cpu-smoke"
        workloads, dtype, interpret, iters = gpu_workloads(), jnp.bfloat16, False, 20
        variants = {"default": {}, "block_q=4": dict(block_q=4),
                    "pages_per_block=8": dict(pages_per_block=8),
                    "pages_per_block=8,num_warps=8": dict(pages_per_block=8, num_warps=8)}
        copy_bw = copy_bandwidth(1 << 31, iters=20)
    rows = [bench_workload(w, dtype, variants, interpret, iters, copy_bw) for w in workloads]
    report(rows, copy_bw)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "bench_attention.json")
        with open(path, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), jax=jax.__version__,
                           copy_bandwidth_bytes_per_s=copy_bw, rows=rows), f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
