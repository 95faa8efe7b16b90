"""Where one engine step's time goes: on the host (pack, dispatch, wait) and in XLA's kernels.

Runs decode steps (`--batches` sequences at `--context` cached tokens, small preset by default)
and, with `--chunk N`, one N-token prefill chunk, under `jax.profiler`. For each step:
- the host's share, timed around the runner's three calls: `pack` (the scheduler's items into
  numpy arrays), `launch` (dispatch: the jitted call's argument handling and the host->device
  copies it starts) and `collect` (the wait for the sampled tokens, the device->host copy and
  unpacking); and the step's time when `--repeats` launches are queued before the first
  collect ("queued": the device's own pace where dispatch keeps ahead of it);
- the kernels' share, by what their fusion computes (read from the executable's optimised
  HLO): a gather, a dot (the weights' matmuls), a batched dot (attention's scores and
  values), a scatter (the KV write), a reduction or exponential (softmax, norms), a transpose,
  a sort (the sampler), other elementwise work; kernels no fusion names (cuBLAS GEMMs, the
  Pallas attention kernel, copies) keep their own names. On a CPU, thread time summed over
  XLA's worker threads (it exceeds the wall time when kernels run in parallel); on a GPU,
  kernel time on the device's streams, with the number of kernels and copies per step.

    python scripts/profile_step.py --preset small --batches 16 --context 384
    python3 scripts/profile_step.py --preset llama-8b-shape --batches 1,16,64 --context 2048 \
        --chunk 512 --json out/profile.json --traces out/traces   # on a GPU
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

KINDS = (("gather", "gather("), ("scatter", "scatter("), ("sort", "sort("), ("dot", "dot("),
         ("reduce/exp", "reduce("), ("reduce/exp", "exponential("), ("transpose", "transpose("))
WRAPPERS = ("ThunkExecutor", "Slinky", "$")  # CPU events that contain kernels, not kernels


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


def kernel_lines(planes: list) -> list:
    """The lines of a profile whose events are kernels: XLA:CPU's worker threads, or the GPU's
    streams (kernels and copies; not the "XLA Modules"/"XLA Ops" summaries above them)."""
    gpu = [p for p in planes if p.name.startswith("/device:GPU")]
    if not gpu:
        return [line for p in planes for line in p.lines if line.name.startswith("tf_XLA")]
    return [line for p in gpu for line in p.lines if line.name.startswith("Stream")]


def read_trace(trace_dir: str, steps: int) -> dict:
    """A profiled run of `steps` steps -> kernel nanoseconds by name, kernels and copies,
    each per step."""
    import jax

    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    planes = list(jax.profiler.ProfileData.from_file(path).planes)
    times: collections.Counter = collections.Counter()
    events = [e for line in kernel_lines(planes) for e in line.events
              if not e.name.startswith(WRAPPERS)]
    for e in events:
        times[e.name] += e.duration_ns / steps
    names = [e.name for e in events]
    copies = sum("memcpy" in name.lower() for name in names)
    return dict(times=times, kernels_per_step=(len(names) - copies) / steps,
                copies_per_step=copies / steps)


def host_split(engine, step, repeats: int) -> dict:
    """Median ms of the runner's pack, launch and collect over `repeats` steps, and the step's
    ms when `repeats` launches are queued before their collects."""
    runner = engine.runner
    phases = collections.defaultdict(list)
    for _ in range(repeats):
        t0 = time.perf_counter()
        packed = runner.pack(step)
        t1 = time.perf_counter()
        launched = runner.launch(step.items, *packed)
        t2 = time.perf_counter()
        runner.collect(launched)
        t3 = time.perf_counter()
        for name, dt in (("pack", t1 - t0), ("launch", t2 - t1), ("collect", t3 - t2),
                         ("step", t3 - t0)):
            phases[name].append(dt * 1e3)
    out = {name: statistics.median(v) for name, v in phases.items()}
    t0 = time.perf_counter()
    flights = [runner.launch(step.items, *runner.pack(step)) for _ in range(repeats)]
    for launched in flights:
        runner.collect(launched)
    out["queued"] = (time.perf_counter() - t0) * 1e3 / repeats
    return out


def profile_case(engine, name: str, step, args) -> dict:
    import jax

    for _ in range(3):  # compile, settle
        engine.runner.execute(step)
    _, executable = engine.runner.executable.held()[-1]  # the step just run
    kinds = fusion_kinds(executable.as_text())
    host = host_split(engine, step, args.repeats)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            walls = [engine.runner.execute(step).step_time for _ in range(args.repeats)]
        trace = read_trace(trace_dir, args.repeats)
        if args.traces:
            os.makedirs(args.traces, exist_ok=True)
            (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
            shutil.copy(path, os.path.join(args.traces, re.sub(r"\W+", "_", name) + ".xplane.pb"))
    # a GPU's kernels carry their fusion's name with "_" for "." and "-"
    kinds.update({re.sub(r"\W", "_", name): kind for name, kind in kinds.items()})
    per_kind: collections.Counter = collections.Counter()
    for kernel, ns in trace.pop("times").items():
        per_kind[kinds.get(kernel, "elementwise" if kernel.startswith("wrapped") else kernel)] \
            += ns / 1e6
    return dict(step=name, host_ms=host, profiled_ms=statistics.median(walls) * 1e3,
                kernel_ms=sum(per_kind.values()), by_kind=dict(per_kind.most_common()), **trace)


def report(row: dict, top: int) -> None:
    host = row["host_ms"]
    print(f"{row['step']}: pack {host['pack']:.2f} + launch {host['launch']:.2f} + collect "
          f"{host['collect']:.2f} = {host['step']:.2f} ms a step; queued {host['queued']:.2f} ms"
          f" a step; kernels {row['kernel_ms']:.2f} ms ({row['kernels_per_step']:.0f} kernels, "
          f"{row['copies_per_step']:.0f} copies a step)")
    for kind, ms in list(row["by_kind"].items())[:top]:
        if ms >= 0.01:
            print(f"  {ms:8.3f} ms  {kind}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batches", default="16", help="decode batches, comma-separated")
    ap.add_argument("--context", type=int, default=384, help="cached tokens per sequence")
    ap.add_argument("--chunk", type=int, default=0, help="also one prefill chunk this long")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=5, help="profiled steps")
    ap.add_argument("--top", type=int, default=12, help="kinds or kernels to list per step")
    ap.add_argument("--json", default=None)
    ap.add_argument("--traces", default=None, help="keep each step's xplane.pb here")
    args = ap.parse_args(argv)
    if "jax" in sys.modules:
        raise SystemExit("run this as a script: XLA_FLAGS must be set before jax is imported")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_cpu_enable_xprof_traceme=true").strip()
    import jax
    from bench_forward import fake_items, forward_config

    from hetero_jax import Engine
    from hetero_jax.sched import DECODE, PREFILL, SchedulerOutput

    batches = [int(b) for b in args.batches.split(",")]
    engine = Engine.from_preset(args.preset, config=forward_config(
        batches, args.context, args.chunk or None, args.dtype))
    cases = [(f"decode x{b}", [(args.context, 1)] * b, DECODE) for b in batches]
    cases += [(f"chunk {args.chunk}", [(0, args.chunk)], PREFILL)] if args.chunk else []
    print(f"{args.preset} on {jax.devices()[0].device_kind}, {engine.config.dtype}, "
          f"{args.context} cached tokens per decode, {args.repeats} steps each")
    rows = []
    for name, lengths, kind in cases:
        items = fake_items(engine, lengths, kind)
        rows.append(profile_case(engine, name, SchedulerOutput(items, []), args))
        report(rows[-1], args.top)
        engine.scheduler.pages.free([p for it in items for p in it.pages])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(preset=args.preset, device=jax.devices()[0].device_kind,
                           dtype=str(engine.config.dtype), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
