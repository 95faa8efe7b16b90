"""Fit the simulator's linear step-time model to the engine's real step times on this machine.

Runs the engine (`--preset small` by default) on a fixed set of workloads whose steps cover
decode batches, embedding chunks of every token bucket, long-context chunks and decodes mixed
with chunks; records each step's `StepShape` and its wall time (pack + jitted step + the one
device->host copy, as `RunnerOutput.step_time` measures it), drops steps that compiled, and
fits by non-negative least squares

    step_s = intercept + c_tokens * bucket(tokens) + c_decode * decode_tokens
             + c_context * context_tokens + c_pairs * attn_pairs + c_sampled * sampled

(`bucket` pads to the engine's token bucket, as the engine pads a step). Every fourth step is
held out and the fit is checked on it. Writes the JSON that `hetero_jax.sim` loads
(`--cost PATH`, `scripts/bench_hol.py --cost PATH`) and prints the fit quality.

    python scripts/calibrate.py --out calibration/small.json         # about 2-3 minutes
    python scripts/calibrate.py --fast --out /tmp/tiny.json          # tiny preset, seconds
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time

import numpy as np
import scipy.optimize

from hetero_jax import EmbedRequest, Engine, EngineConfig, GenerateRequest, SamplingParams
from hetero_jax.sched import SchedulerOutput
from hetero_jax.sched.costmodel import LinearCostModel, StepShape
from hetero_jax.sim.report import percentile

FIT_FEATURES = ("tokens", "decode_tokens", "context_tokens", "attn_pairs", "sampled")


@dataclasses.dataclass
class Sample:
    shape: StepShape
    seconds: float


def record_steps(engine: Engine, samples: list) -> None:
    """Wrap the engine's runner so each step that did not compile appends a Sample (the
    engine runs with async_scheduling off, so a step's pack, launch and collect come in turn
    and its step_time is the device's alone)."""
    pack, collect, packed = engine.runner.pack, engine.runner.collect, []

    def packing(out: SchedulerOutput):
        packed[:] = [out, engine.runner.compiles]
        return pack(out)

    def timed(launched):
        runner_out = collect(launched)
        out, compiles = packed
        if engine.runner.compiles == compiles:
            samples.append(Sample(StepShape.from_output(out), runner_out.step_time))
        return runner_out

    engine.runner.pack, engine.runner.collect = packing, timed


def workloads(args) -> list:
    """Lists of requests, one `engine.run` each, whose steps span the shapes the sim meets."""
    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(1, 256, n).tolist()  # noqa: E731
    greedy = lambda m: SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)  # noqa: E731
    runs = []
    for b in args.decode_batches:  # decode batches, context growing from the prompt
        runs.append([GenerateRequest(ids(args.prompt), greedy(args.decode_steps))
                     for _ in range(b)])
    for t in args.chunk_tokens:  # one step of t embedding tokens (chunks of <= chunk_size)
        sizes = [args.chunk] * (t // args.chunk) + ([t % args.chunk] if t % args.chunk else [])
        runs += [[EmbedRequest(ids(n)) for n in sizes]] * args.chunk_repeats
    runs.append([EmbedRequest(ids(args.long_input))])  # chunks over a growing context
    for b in args.mix_batches:  # decodes beside embedding chunks
        runs.append([GenerateRequest(ids(8), greedy(args.decode_steps)) for _ in range(b)]
                    + [EmbedRequest(ids(args.prompt)) for _ in range(args.mix_embeds)])
    return runs


def features(samples: list, buckets: tuple) -> np.ndarray:
    rows = []
    for s in samples:
        f = s.shape.features()
        f["tokens"] = next(b for b in buckets if b >= f["tokens"])
        rows.append([1.0] + [float(f[name]) for name in FIT_FEATURES])
    return np.asarray(rows)


def fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (scipy's NNLS), on unit-norm columns."""
    norms = np.linalg.norm(x, axis=0)
    norms[norms == 0] = 1.0
    return scipy.optimize.nnls(x / norms, y)[0] / norms


def quality(pred: np.ndarray, y: np.ndarray) -> dict:
    rel = np.abs(pred - y) / y
    r2 = 1 - np.sum((pred - y) ** 2) / np.sum((y - y.mean()) ** 2)
    return {"n": int(len(y)), "r2": float(r2), "mape": float(rel.mean()),
            "p90_rel_err": float(percentile(rel.tolist(), 90)), "max_rel_err": float(rel.max())}


def fit(samples: list, buckets: tuple, source: str) -> tuple[LinearCostModel, dict]:
    x, y = features(samples, buckets), np.asarray([s.seconds for s in samples])
    held = np.arange(len(y)) % 4 == 3
    coef = fit_nonnegative(x[~held], y[~held])
    report = {"train": quality(x[~held] @ coef, y[~held]),
              "held_out": quality(x[held] @ coef, y[held])}
    coef = fit_nonnegative(x, y)  # the model written uses every step
    report["all"] = quality(x @ coef, y)
    model = LinearCostModel(float(coef[0]), tuple(sorted(
        (name, float(c)) for name, c in zip(FIT_FEATURES, coef[1:]) if c > 0)),
        tuple(buckets), source)
    return model, report


def print_report(model: LinearCostModel, report: dict, samples: list) -> None:
    print(f"{len(samples)} steps; step_s = {1e3 * model.intercept_s:.3f} ms"
          + "".join(f" + {1e6 * c:.4g} us * {name}" for name, c in model.coef_s))
    print(f"{'':9s} {'n':>5s} {'R^2':>7s} {'MAPE':>7s} {'p90 err':>8s} {'max err':>8s}")
    for split, q in report.items():
        print(f"{split:9s} {q['n']:5d} {q['r2']:7.4f} {q['mape']:7.1%} {q['p90_rel_err']:8.1%} "
              f"{q['max_rel_err']:8.1%}")
    by_kind = {}
    for s in samples:
        kind = ("decode" if s.shape.decode_tokens == s.shape.tokens else
                "chunk" if not s.shape.decode_tokens else "mixed")
        by_kind.setdefault(kind, []).append(s)
    print(f"{'steps':8s} {'n':>5s} {'tokens':>9s} {'measured ms':>12s} {'model ms':>9s}")
    for kind, group in sorted(by_kind.items()):
        meas = np.mean([s.seconds for s in group])
        pred = np.mean([model.step_time(s.shape) for s in group])
        toks = [s.shape.tokens for s in group]
        print(f"{kind:8s} {len(group):5d} {min(toks):4d}-{max(toks):<4d} {1e3 * meas:12.1f} "
              f"{1e3 * pred:9.1f}")


def parse_args(argv=None):
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-chunk-seqs", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--decode-batches", type=ints, default=(1, 4, 8, 16, 32))
    p.add_argument("--decode-steps", type=int, default=16, help="max_tokens of decode runs")
    p.add_argument("--prompt", type=int, default=128, help="prompt / embedding input length")
    p.add_argument("--chunk-tokens", type=ints, default=(16, 32, 64, 96, 128, 192, 256))
    p.add_argument("--chunk-repeats", type=int, default=3)
    p.add_argument("--long-input", type=int, default=768, help="one long embedding input")
    p.add_argument("--mix-batches", type=ints, default=(4, 16, 32))
    p.add_argument("--mix-embeds", type=int, default=6)
    p.add_argument("--passes", type=int, default=2, help="passes over the workloads; steps "
                   "that compile are dropped, so the first pass mostly compiles")
    p.add_argument("--fast", action="store_true",
                   help="tiny preset, few points, two step variants (a smoke test)")
    p.add_argument("--out", default="calibration.json", help="cost model JSON to write")
    args = p.parse_args(argv)
    args.buckets = {}
    if args.fast:
        # two token buckets far apart, so that the step shape, not the machine's load, sets
        # most of the spread in step times (16-token steps ~5 ms, 256-token ones ~20 ms)
        args.buckets = dict(token_buckets=(16, 256), chunk_seq_buckets=(4,), page_buckets=(16,))
        args.preset, args.max_num_seqs, args.max_model_len = "tiny", 8, 256
        args.decode_batches, args.decode_steps, args.prompt = (1, 8), 4, 64
        args.chunk_tokens, args.chunk_repeats, args.long_input = (16, 128, 256), 2, 96
        args.mix_batches, args.mix_embeds = (4,), 4
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = EngineConfig(token_budget=args.budget, chunk_size=args.chunk,
                       max_num_seqs=args.max_num_seqs, max_chunk_seqs=args.max_chunk_seqs,
                       max_model_len=args.max_model_len, scheduler="fcfs", async_scheduling=False,
                       **args.buckets)
    engine = Engine.from_preset(args.preset, config=cfg)
    samples: list = []
    record_steps(engine, samples)
    start, cpu, load1 = time.perf_counter(), time.process_time(), os.getloadavg()[0]
    for _ in range(args.passes):
        for requests in workloads(args):
            engine.run(requests, use_tqdm=False)
    wall = time.perf_counter() - start
    contention = {"cpu_per_wall": (time.process_time() - cpu) / wall, "load1_start": load1,
                  "load1_end": os.getloadavg()[0], "cpus": len(os.sched_getaffinity(0))}
    source = f"calibrate.py {args.preset} on {platform.node() or 'cpu'} ({os.cpu_count()} cpus)"
    model, report = fit(samples, engine.config.token_buckets, source)
    print(f"{args.preset}: {wall:.0f} s ({engine.runner.compile_s:.0f} s compiling "
          f"{engine.runner.compiles} variants); CPU/wall {contention['cpu_per_wall']:.2f} on "
          f"{contention['cpus']} cpus, load average {contention['load1_start']:.1f} -> "
          f"{contention['load1_end']:.1f} (other processes on the cores slow every step)")
    print_report(model, report, samples)
    data = dict(model.to_dict(), fit=report, machine=contention,
                engine={k: v for k, v in dataclasses.asdict(engine.config).items()
                        if not isinstance(v, tuple)} | {"preset": args.preset})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=2)
    print(f"wrote {args.out}")
    return data


if __name__ == "__main__":
    main()
