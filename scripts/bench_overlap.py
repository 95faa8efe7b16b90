"""The host off the critical path: a CPU engine step's wall time with async scheduling off and on.

Keeps `--running` generation requests decoding (ignore_eos, long max_tokens, so every measured
step is the same decode-only step) and `--queued` more waiting (the scheduler walks them each
step, as in a loaded server), then times `Engine.step()` with the overlap off and on in
alternating blocks of `--steps` steps (`--repeats` blocks each). Per step it reports the host's
CPU seconds (`time.thread_time` of the stepping thread: schedule, pack, dispatch, update), the
device time (the step's executable alone, replayed on a recorded batch and blocked on), the
other threads' CPU seconds (XLA's compute), the wall time, and wall / max(host, device): 1.0 is a perfect overlap, (host + device) / max(...)
none. Medians over all the blocks' steps.

    python scripts/bench_overlap.py --preset tiny --running 256 --queued 1000
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax

from hetero_jax import Engine, EngineConfig, GenerateRequest, SamplingParams
from hetero_jax.runner.wire import to_wire

PARAMS = SamplingParams(max_tokens=1800, temperature=0, ignore_eos=True)


def make_engine(preset: str, running: int, budget: int | None = None) -> Engine:
    """An engine whose steady decode-only step at `running` sequences needs few variants
    (`budget` None: room for 4 prefill chunks beside every decode while ramping up)."""
    budget = budget or running + 256
    return Engine.from_preset(preset, config=EngineConfig(
        token_budget=budget, chunk_size=64, max_num_seqs=running, max_model_len=2048,
        token_buckets=tuple(sorted({64, running, budget})), seq_buckets=(running,),
        page_buckets=(8, 32, 128), num_pages=running * 40 + 8, prefix_caching=True))


def top_up(engine: Engine, queued: int, prompt_len: int, first: int) -> int:
    """Keep `queued` requests waiting; -> the next prompt number."""
    need = queued - engine.scheduler.num_waiting
    engine.add([GenerateRequest([1 + (first + i) % 250] + [7] * (prompt_len - 1), PARAMS)
                for i in range(max(need, 0))])
    return first + max(need, 0)


def timed_steps(engine: Engine, n: int) -> tuple[list, list, list]:
    """(wall seconds, the stepping thread's CPU seconds, the other threads' CPU seconds: XLA's
    compute) of n `Engine.step()` calls."""
    walls, cpus, others = [], [], []
    for _ in range(n):
        w0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        engine.step()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.thread_time() - c0)
        others.append(time.process_time() - p0 - cpus[-1])
    return walls, cpus, others


def device_times(engine: Engine, batch: tuple, n: int) -> list:
    """Seconds of n runs of a step's executable alone on a recorded (key, StepBatch), each
    blocked on (it rewrites K/V the step already wrote: the bench reads no tokens)."""
    runner, (key, packed_batch) = engine.runner, batch
    fn, times = runner.executable(key), []
    wire = to_wire(packed_batch, runner.spec(key))
    for _ in range(n):
        t0 = time.perf_counter()
        runner.state, packed, _ = fn(runner.params, runner.state, *wire)
        jax.block_until_ready(packed)
        times.append(time.perf_counter() - t0)
    return times


def record_launches(engine: Engine) -> list:
    """Wrap the runner's launch to keep the last launched (key, batch) in the returned list."""
    seen, launch = [], engine.runner.launch

    def recording(items, key, batch):
        seen[:] = [(key, batch)]
        return launch(items, key, batch)
    engine.runner.launch = recording
    return seen


def bench(preset: str, running: int, queued: int, prompt_len: int, steps: int,
          repeats: int) -> dict:
    engine = make_engine(preset, running)
    seen = record_launches(engine)
    nxt = top_up(engine, running + queued, prompt_len, 0)
    while len(engine.scheduler.running) < running or any(
            not r.is_decoding for r in engine.scheduler.running):
        engine.step()  # admit and prefill everyone (and compile)
    timed_steps(engine, 3)
    samples, device = {on: ([], [], []) for on in (False, True)}, []
    for _ in range(repeats):  # off, on and the executable alone, in turn
        for on in (False, True):
            engine.pipeline.overlap = on  # safe between steps: a flight is collected either way
            nxt = top_up(engine, queued, prompt_len, nxt)
            for kept, new in zip(samples[on], timed_steps(engine, steps)):
                kept.extend(new)
        engine.pipeline.overlap = False
        engine.step()  # collects the flight and leaves none: the device is the executable's
        device += device_times(engine, seen[0], steps)
    assert len(engine.scheduler.running) == running, "a request finished or was preempted"
    device = statistics.median(device)
    out = dict(preset=preset, running=running, queued=queued, device_s=device,
               load_average=os.getloadavg()[0])
    for on, (walls, cpus, others) in samples.items():
        name = "on" if on else "off"
        wall, host = statistics.median(walls), statistics.median(cpus)
        out[name] = dict(wall_s=wall, host_s=host, xla_cpu_s=statistics.median(others),
                         wall_over_max=wall / max(host, device),
                         sum_over_max=(host + device) / max(host, device))
    return out


def report(r: dict) -> str:
    lines = [f"{r['preset']}, {r['running']} decoding, {r['queued']} queued: device (the "
             f"executable alone) {r['device_s'] * 1e3:.2f} ms/step (1-min load average "
             f"{r['load_average']:.1f})"]
    for name in ("off", "on"):
        m = r[name]
        lines.append(f"  overlap {name:>3}: wall {m['wall_s'] * 1e3:7.2f} ms, host CPU "
                     f"{m['host_s'] * 1e3:6.2f} ms (XLA threads {m['xla_cpu_s'] * 1e3:.1f} ms CPU), "
                     "wall / max(host, device) "
                     f"{m['wall_over_max']:.2f} (no overlap would be {m['sum_over_max']:.2f})")
    return "\n".join(lines)


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--running", default="256", help="decoding sequences, comma-separated cases")
    ap.add_argument("--queued", type=int, default=1000)
    ap.add_argument("--prompt-len", type=int, default=100, help="tokens per prompt (the "
                    "default keeps every measured step in one page bucket)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per block")
    ap.add_argument("--repeats", type=int, default=5, help="blocks per mode, alternating")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    return run_cases(args.running, lambda running: bench(
        args.preset, running, args.queued, args.prompt_len, args.steps, args.repeats),
        report, args.json)


def run_cases(running: str, one, describe, json_path: str | None) -> list:
    """`one(n)` for each comma-separated count of `running`, each result printed as
    `describe` says; the list written to `json_path` (None: not written)."""
    results = []
    for n in (int(x) for x in running.split(",")):
        results.append(one(n))
        print(describe(results[-1]), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
