"""The CPU runner's two layout choices against a runner without them, step by step.

On a CPU the decoder's runner stores the MLP's weights transposed and runs it on [d, T]
activations (`layers.feature_major_mlp`), reads the decode keys in 128-token blocks up to
the step's longest sequence (`decoder.decode_block_pages`), and pads steps to token buckets
from 8 (`config.SMALLEST_TOKEN_BUCKET`). This builds two engines of `--preset` with the
default config in one process: one as the engine sets itself up on a CPU, one without the
choices `--drop` names (`mlp`: the MLP row-major; `blocks`: every decode group read by one
gather of its page bucket; `tokens`: token buckets from 16; mlp and blocks by default, as
before them). Each times
the same steps, round-robin over `--repeats` rounds: decode-only steps of
`--batches` sequences with contexts drawn from `--contexts LO:HI`, embedding chunks of 64
tokens (1 and 4), and one of them beside 12 decodes. Prints medians and their ratio.

    python scripts/bench_cpu_layout.py --preset small --repeats 7 [--drop mlp|blocks|tokens]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_forward, when imported
from bench_forward import fake_items  # noqa: E402

from hetero_jax import Engine, EngineConfig  # noqa: E402
from hetero_jax.models.layers import row_major_mlp  # noqa: E402
from hetero_jax.sched import DECODE, EMBED, SchedulerOutput  # noqa: E402


CHOICES = ("mlp", "blocks", "tokens")


def without_config(resolved, drop: tuple) -> EngineConfig:
    """The other engine's config beside an engine's `resolved` one: the defaults, with token
    buckets from 16 when `drop` names "tokens"."""
    return EngineConfig(token_buckets=tuple(b for b in resolved.token_buckets if b >= 16)
                        if "tokens" in drop else None)


def without_cpu_layout(engine, drop: tuple = CHOICES) -> None:
    """The engine's runner without the CPU choices in `drop` ("mlp": row-major MLP; "blocks":
    one gather per decode group), before it compiles anything."""
    runner = engine.runner
    assert not runner.executable.held(), "the layout must change before the first compile"
    if "mlp" in drop:
        runner.params = row_major_mlp(runner.params)
    if "blocks" in drop:
        runner.backend = "other"  # decode_block_pages: one gather off the CPU


def cases(engine, batches: list, contexts: tuple, seed: int) -> dict:
    rng = random.Random(seed)
    ctx = lambda n: [(rng.randint(*contexts), 1) for _ in range(n)]  # noqa: E731
    out = {f"decode x{b}": fake_items(engine, ctx(b), DECODE, first_id=1000 * (i + 1))
           for i, b in enumerate(batches)}
    out["embed 1x64"] = fake_items(engine, [(0, 64)], EMBED, first_id=1)
    out["embed 4x64"] = fake_items(engine, [(0, 64)] * 4, EMBED, first_id=2)
    out["embed 1x64 + decode x12"] = (fake_items(engine, [(0, 64)], EMBED, first_id=3)
                                      + fake_items(engine, ctx(12), DECODE, first_id=500))
    return {name: SchedulerOutput(items, []) for name, items in out.items()}


def bench(preset: str, batches: list, contexts: tuple, repeats: int, seed: int = 0,
          drop: tuple = ("mlp", "blocks")) -> dict:
    engine = Engine.from_preset(preset, config=EngineConfig())
    engines = {"cpu layout": engine,
               "without": Engine.from_preset(preset, config=without_config(engine.config, drop))}
    without_cpu_layout(engines["without"], drop)
    steps = {name: cases(e, batches, contexts, seed) for name, e in engines.items()}
    for name, e in engines.items():  # compile, then once more untimed
        for step in steps[name].values():
            e.runner.execute(step)
            e.runner.execute(step)
    times = {(name, case): [] for name in engines for case in steps["without"]}
    for _ in range(repeats):
        for case in steps["without"]:
            for name, e in engines.items():
                times[(name, case)].append(e.runner.execute(steps[name][case]).step_time)
    rows = []
    for case in steps["without"]:
        new, old = (statistics.median(times[(n, case)]) for n in ("cpu layout", "without"))
        rows.append(dict(step=case, cpu_layout_s=new, without_s=old, ratio=new / old))
    return dict(preset=preset, contexts=list(contexts), repeats=repeats, drop=list(drop),
                rows=rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batches", default="1,8,16,32", help="decode batches, comma-separated")
    ap.add_argument("--contexts", default="130:380", help="LO:HI cached tokens per decode")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--drop", default="mlp,blocks", help="the choices the other engine runs "
                    "without, comma-separated: mlp, blocks, tokens")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    lo, hi = (int(x) for x in args.contexts.split(":"))
    drop = tuple(args.drop.split(","))
    if not drop or set(drop) - set(CHOICES):
        ap.error(f"--drop {args.drop!r}: expected some of {', '.join(CHOICES)}")
    r = bench(args.preset, [int(b) for b in args.batches.split(",")], (lo, hi), args.repeats,
              drop=drop)
    print(f"{args.preset}, contexts {lo}-{hi}, medians of {args.repeats} round-robin rounds; "
          f"'without': no {' and no '.join(drop)}")
    for row in r["rows"]:
        print(f"{row['step']:>24}: cpu layout {row['cpu_layout_s'] * 1e3:7.1f} ms, without "
              f"{row['without_s'] * 1e3:7.1f} ms, ratio {row['ratio']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
