"""Where one engine step's time goes, by what XLA emitted: thread time per kind of kernel.

Runs a decode step (`--batch` sequences at `--context` cached tokens, small preset by default)
under `jax.profiler`, then sums the time of every XLA:CPU kernel over the CPU's worker threads,
grouped by what its fusion computes (read from the executable's optimised HLO): a gather, a
dot (the weights' matmuls), a batched dot (attention's scores and values), a scatter (the KV
write), a reduction or exponential (softmax, norms), a transpose, or other elementwise work.
Thread time is summed over the threads, so it exceeds the wall time when kernels run in
parallel.

    python scripts/profile_step.py --preset small --batch 16 --context 384
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import statistics
import sys
import tempfile

KINDS = (("gather", "gather("), ("scatter", "scatter("), ("dot", "dot("),
         ("reduce/exp", "reduce("), ("reduce/exp", "exponential("), ("transpose", "transpose("))
WRAPPERS = ("ThunkExecutor", "Slinky", "$")  # events that contain kernels, not kernels


def fusion_kinds(hlo: str) -> dict:
    """{fusion instruction name: kind} from optimised HLO text (the first matching kind of
    KINDS in the fused computation's body; a gather fused with a transpose is a gather)."""
    bodies = {m.group(1): m.group(2)
              for m in re.finditer(r"^(%[\w.-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S | re.M)}
    out = {}
    for name, comp in re.findall(r"(%[\w.-]+) = [^\n]*?fusion\([^\n]*calls=(%[\w.-]+)", hlo):
        body = bodies.get(comp, "")
        kind = next((kind for kind, op in KINDS if op in body), "elementwise")
        if kind == "dot" and "lhs_batch_dims" in body:
            kind = "batched dot"  # attention's scores and values; the weights' dots have none
        out[name[1:]] = kind
    return out


def kernel_times(trace_dir: str) -> collections.Counter:
    """{kernel name: nanoseconds} summed over the XLA threads of a jax.profiler trace."""
    import jax

    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    total: collections.Counter = collections.Counter()
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):
                continue
            for event in line.events:
                if not event.name.startswith(WRAPPERS):
                    total[event.name] += event.duration_ns
    return total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=16, help="decode sequences")
    ap.add_argument("--context", type=int, default=384, help="cached tokens per sequence")
    ap.add_argument("--repeats", type=int, default=5, help="profiled steps")
    ap.add_argument("--top", type=int, default=10, help="single kernels to list")
    args = ap.parse_args(argv)
    if "jax" in sys.modules:
        raise SystemExit("run this as a script: XLA_FLAGS must be set before jax is imported")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_cpu_enable_xprof_traceme=true").strip()
    import jax
    from bench_forward import fake_items

    from hetero_jax import Engine, EngineConfig
    from hetero_jax.sched import DECODE, SchedulerOutput

    engine = Engine.from_preset(args.preset, config=EngineConfig(
        max_num_seqs=max(32, args.batch), max_model_len=max(2048, args.context + 1)))
    step = SchedulerOutput(fake_items(engine, [(args.context, 1)] * args.batch, DECODE), [])
    for _ in range(3):  # compile, settle
        engine.runner.execute(step)
    _, executable = engine.runner.executable.held()[-1]  # the step just run
    kinds = fusion_kinds(executable.as_text())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            walls = [engine.runner.execute(step).step_time for _ in range(args.repeats)]
        times = kernel_times(trace_dir)
    per_kind: collections.Counter = collections.Counter()
    for name, ns in times.items():
        per_kind[kinds.get(name, "elementwise" if name.startswith("wrapped") else name)] += ns
    n = args.repeats
    print(f"decode x{args.batch} at {args.context} cached tokens: "
          f"{statistics.median(walls) * 1e3:.1f} ms wall per step (profiled), "
          f"{sum(times.values()) / n / 1e6:.1f} ms of XLA thread time")
    for kind, ns in per_kind.most_common():
        if ns / n >= 1e4:
            print(f"  {kind:>12}: {ns / n / 1e6:7.2f} ms")
    print(f"the {args.top} longest kernels (ms per step, kind):")
    for name, ns in times.most_common(args.top):
        print(f"  {ns / n / 1e6:7.2f}  {name} ({kinds.get(name, '-')})")


if __name__ == "__main__":
    main()
