"""The host's CPU a step, by phase, on a steady decode-only load (issue 31 item 3).

Keeps `--running` generation requests decoding and `--queued` more waiting (as
`bench_overlap.py` does), steps the engine with the overlap off, and times each host call of a
step in CPU seconds of the stepping thread (`time.thread_time`): `schedule`, `pack` (the
items into numpy arrays), `launch` (the jitted call's dispatch), `collect` (the wait's CPU,
the device->host copy, the sampled tokens unpacked), `advance` and `settle` (the two halves
of the scheduler's update), and the whole step. The issue's bar: schedule + pack + update at
most 1.5 ms at 256 running, a 2,048-token budget and 1,000 queued. Medians over `--repeats`
blocks of `--steps` steps (and the best block: a loaded host only adds); the XLA
threads' compute is not counted.

    python scripts/bench_host.py --running 64,256 --budget 2048 --queued 1000
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overlap import make_engine, run_cases, top_up  # noqa: E402

PHASES = (("schedule", "scheduler"), ("advance", "scheduler"), ("settle", "scheduler"),
          ("pack", "runner"), ("launch", "runner"), ("collect", "runner"))
BAR = ("schedule", "pack", "advance", "settle")  # the schedule + pack + update


def time_phases(engine, spent: dict, clock=time.thread_time) -> None:
    """Wrap each host call of `PHASES` to add its `clock` seconds (the thread's CPU) to
    `spent[name]`, whether it returns or raises."""
    for name, owner in PHASES:
        obj = getattr(engine, owner)
        call = getattr(obj, name)

        def timed(*args, _call=call, _name=name, **kw):
            t0 = clock()
            try:
                return _call(*args, **kw)
            finally:
                spent[_name] += clock() - t0
        setattr(obj, name, timed)


def bench(preset: str, running: int, budget: int, queued: int, prompt_len: int, steps: int,
          repeats: int) -> dict:
    engine = make_engine(preset, running, budget)
    nxt = top_up(engine, running + queued, prompt_len, 0)
    while len(engine.scheduler.running) < running or any(
            not r.is_decoding for r in engine.scheduler.running):
        engine.step()  # admit and prefill everyone (and compile)
    engine.pipeline.overlap = False
    spent = collections.defaultdict(float)
    time_phases(engine, spent)
    engine.step()
    per_step = collections.defaultdict(list)
    for _ in range(repeats):
        nxt = top_up(engine, queued, prompt_len, nxt)
        spent.clear()
        t0 = time.thread_time()
        for _ in range(steps):
            engine.step()
        per_step["step"].append((time.thread_time() - t0) / steps)
        for name, _ in PHASES:
            per_step[name].append(spent[name] / steps)
        per_step["bar"].append(sum(spent[name] for name in BAR) / steps)
    assert len(engine.scheduler.running) == running, "a request finished or was preempted"
    return dict(preset=preset, running=running, budget=budget, queued=queued,
                ms={k: 1e3 * statistics.median(v) for k, v in per_step.items()},
                best_ms={k: 1e3 * min(v) for k, v in per_step.items()},
                spread_ms={k: 1e3 * (max(v) - min(v)) for k, v in per_step.items()})


def report(r: dict) -> str:
    ms = r["ms"]
    phases = ", ".join(f"{name} {ms[name]:.2f}" for name, _ in PHASES)
    return (f"{r['preset']}, {r['running']} decoding, budget {r['budget']}, {r['queued']} queued: "
            f"host CPU {ms['step']:.2f} ms a step ({phases}); schedule + pack + update "
            f"{ms['bar']:.2f} ms, best block {r['best_ms']['bar']:.2f} (the bar: 1.5; spread "
            f"over blocks {r['spread_ms']['bar']:.2f})")


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--running", default="64,256", help="decoding sequences, comma-separated")
    ap.add_argument("--budget", type=int, default=2048, help="the engine's token budget")
    ap.add_argument("--queued", type=int, default=1000)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per block")
    ap.add_argument("--repeats", type=int, default=5, help="blocks")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    return run_cases(args.running, lambda running: bench(
        args.preset, running, args.budget, args.queued, args.prompt_len, args.steps,
        args.repeats), report, args.json)


if __name__ == "__main__":
    main()
