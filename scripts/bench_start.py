"""Cold and warm start: `Engine.from_preset(PRESET)` + `warmup()`, each in a fresh process.

The first process starts with an empty persistent compilation cache (a new directory under
`--root`, as `$XDG_CACHE_HOME`), so it compiles every step variant its warm-up builds
(`--warmup`: `EngineConfig.warmup`, auto = lazy on a CPU: none); the second, the same
configuration on the same cache, should build none. Prints one line per start: construction
and warm-up seconds, the process's CPU seconds (all threads), variants built, executables held
and dropped under the memory-mapping bound, the process's mappings at the end and the load
average (the host is shared: CPU seconds are the steadier measure).

    python scripts/bench_start.py --preset small [--warmup all] [--json out/start.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_START = """
import json, sys, time
t0 = time.perf_counter()
from hetero_jax import Engine, EngineConfig
from hetero_jax.runner.executables import process_maps
engine = Engine.from_preset(sys.argv[1], seed=0, config=EngineConfig(warmup=sys.argv[2]))
t1 = time.perf_counter()
built = engine.warmup()
t2 = time.perf_counter()
cache = engine.runner.executable
print(json.dumps(dict(construct_s=t1 - t0, warmup_s=t2 - t1, cpu_s=time.process_time(),
                      built=built, variants=len(engine.config.variants()), held=len(cache),
                      dropped=cache.dropped, maps=process_maps())))
"""


def start(preset: str, warmup: str, cache_home: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env["XDG_CACHE_HOME"] = cache_home
    run = subprocess.run([sys.executable, "-c", _START, preset, warmup], env=env, capture_output=True,
                         text=True, check=False)
    if run.returncode:
        raise SystemExit(f"the start failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small", choices=["tiny", "small"])
    ap.add_argument("--warmup", default="auto", choices=["auto", "all", "lazy"],
                    help="EngineConfig.warmup (default: %(default)s)")
    ap.add_argument("--root", default=None, help="where the fresh cache directory goes")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hetero-jax-start-", dir=args.root) as home:
        for name in ("cold", "warm"):
            load = os.getloadavg()[0]
            r = dict(start=name, load_start=load, **start(args.preset, args.warmup, home))
            rows.append(r)
            print(f"{name}: construction {r['construct_s']:.1f} s, warmup() {r['warmup_s']:.1f} s, "
                  f"{r['cpu_s']:.0f} CPU s, {r['built']} of {r['variants']} variants built, "
                  f"{r['held']} held, {r['dropped']} dropped, {r['maps']} mappings; load "
                  f"{load:.1f} -> {os.getloadavg()[0]:.1f}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(preset=args.preset, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
