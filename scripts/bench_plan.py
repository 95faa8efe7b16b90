"""Host CPU time of the scheduler's cascade planning next to the rest of `schedule()` +
`update()`, per decode-only step (no model, no jax).

`--seqs` generation requests in 8 prefix groups (64-176 shared tokens, 8 of their own each)
decode for `--steps` timed steps after as many untimed ones. Each timed step is scheduled
without planning, then planned alone (`CascadeSettings.plan` on its items, what
`SchedulerConfig.cascade` adds to `schedule()`), both in CPU time (`time.thread_time`, so
other processes on the host count less). The planner ran at pack time in the runner before
the scheduler took it over, so its time is moved, not new.

    python scripts/bench_plan.py --seqs 32,256 [--pallas]
"""
from __future__ import annotations

import argparse
import statistics
import time

from hetero_jax.sched import (GENERATE, Request, RunnerOutput, SampledToken, Scheduler,
                              SchedulerConfig)
from hetero_jax.sched.hashing import chain_seed
from hetero_jax.sched.tiles import CascadeSettings


def step_times(seqs: int, steps: int, pallas: bool = False) -> dict:
    """Mean CPU microseconds per step of schedule()+update() and of planning its items."""
    cfg = SchedulerConfig(token_budget=max(256, seqs), chunk_size=256, max_num_seqs=seqs,
                          page_size=16, num_pages=seqs * 40, max_model_len=2048,
                          prefix_caching=True)
    settings = CascadeSettings(8, 16, seqs, planned=pallas, mixed=pallas)
    sched, seed = Scheduler(cfg), chain_seed("bench_plan")
    for i in range(seqs):
        group = i % 8
        sched.add(Request(i, [group + 1] * (64 + 16 * group) + [1000 + i] * 8, 100_000,
                          kind=GENERATE, cache_seed=seed))
    loop, plan, planned = [], [], 0
    for step in range(2 * steps):
        t0 = time.thread_time()
        out = sched.schedule()
        sched.update(out, RunnerOutput({it.request_id: SampledToken(5, 0.0)
                                        for it in out.items if it.samples}))
        t1 = time.thread_time()
        tiles = settings.plan(out.items, cfg.page_size)
        if step >= steps:
            loop.append(t1 - t0)
            plan.append(time.thread_time() - t1)
            planned += tiles is not None
    return dict(seqs=seqs, schedule_update_us=statistics.fmean(loop) * 1e6,
                plan_us=statistics.fmean(plan) * 1e6, planned=planned, steps=steps)


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="32,256", help="decode batch sizes, comma-separated")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--pallas", action="store_true",
                    help="plan as the engine on the Pallas kernel: tiles as long as the runs")
    args = ap.parse_args(argv)
    rows = [step_times(int(s), args.steps, args.pallas) for s in args.seqs.split(",")]
    for r in rows:
        print(f"{r['seqs']} decodes: schedule()+update() {r['schedule_update_us']:.0f} us, "
              f"planning {r['plan_us']:.0f} us ({r['planned']}/{r['steps']} steps planned)")
    return rows


if __name__ == "__main__":
    main()
