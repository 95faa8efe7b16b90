"""XLA:CPU compile options: compile CPU seconds per step variant and step time, interleaved.

Builds one engine (`--preset`, the default bucket lists) and, for each variant of `--keys`
(default: decode-only and mixed steps of the bench's mixed workload, a cascade step), compiles
its step under each option set (`runner.executables.CPU_COMPILE_OPTIONS`, the engine's, and
XLA's defaults), then times the executables in interleaved rounds (A B A B ...) on a batch of
the variant's shapes (zeros: every dense op runs at full size whatever the values). Prints per
variant: compile CPU seconds (`time.process_time`, all threads) and median step wall and CPU
milliseconds under each option set, their ratio, and the load average.

    python scripts/bench_compile_options.py --preset small --rounds 7 [--json out/opts.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import numpy as np

from hetero_jax import Engine, EngineConfig
from hetero_jax.runner.executables import CPU_COMPILE_OPTIONS
from hetero_jax.runner.wire import to_wire, wire_spec

OPTION_SETS = {"engine": CPU_COMPILE_OPTIONS, "xla-default": {}}
KEYS = [(16, 8, 0, 8, 0), (32, 32, 0, 32, 0), (64, 8, 4, 8, 8), (128, 16, 4, 32, 32),
        (256, 32, 4, 32, 8), (256, 32, 4, 128, 128), (32, 32, 0, 8, 32)]


def compile_step(runner, key: tuple, options: dict) -> tuple:
    """(executable, compile CPU seconds) of variant `key` under XLA `options`."""
    fn = jax.jit(runner.step_fn(key), donate_argnums=(1,))
    lowered = fn.lower(runner.params, runner.state, *wire_spec(runner.spec(key)))
    start = time.process_time()
    executable = lowered.compile(compiler_options=options or None)
    return executable, time.process_time() - start


def time_step(runner, executable, wire) -> tuple:
    """(wall, CPU) seconds of one step, its output copied to the host."""
    t0, c0 = time.perf_counter(), time.process_time()
    runner.state, packed, _ = executable(runner.params, runner.state, *wire)
    np.asarray(packed)
    return time.perf_counter() - t0, time.process_time() - c0


def measure(runner, key: tuple, rounds: int) -> dict:
    """Compile `key` under every option set, then `rounds` interleaved timings of each."""
    built = {name: compile_step(runner, key, opts) for name, opts in OPTION_SETS.items()}
    spec = runner.spec(key)
    wire = to_wire(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), spec), spec)
    times = {name: [] for name in built}
    for r in range(rounds + 1):  # round 0 warms the caches, not counted
        order = list(built) if r % 2 else list(reversed(built))
        for name in order:
            t = time_step(runner, built[name][0], wire)
            if r:
                times[name].append(t)
    row = dict(key=list(key), load=os.getloadavg()[0])
    for name, ts in times.items():
        row[name] = dict(compile_cpu_s=built[name][1],
                         step_ms=1e3 * statistics.median(w for w, _ in ts),
                         step_cpu_ms=1e3 * statistics.median(c for _, c in ts))
    return row


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--keys", default=None, help="JSON list of variant keys (default: %s)" % KEYS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    engine = Engine.from_preset(args.preset, config=EngineConfig(compile_cache=None))
    keys = [tuple(k) for k in json.loads(args.keys)] if args.keys else KEYS
    rows = []
    for key in keys:
        row = measure(engine.runner, key, args.rounds)
        rows.append(row)
        a, b = row["engine"], row["xla-default"]
        print(f"{key}: compile CPU s {a['compile_cpu_s']:.1f} vs {b['compile_cpu_s']:.1f}; step "
              f"ms {a['step_ms']:.1f} vs {b['step_ms']:.1f} ({a['step_ms'] / b['step_ms']:.3f}x), "
              f"CPU ms {a['step_cpu_ms']:.1f} vs {b['step_cpu_ms']:.1f} "
              f"({a['step_cpu_ms'] / b['step_cpu_ms']:.3f}x); load {row['load']:.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
