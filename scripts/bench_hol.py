"""Head-of-line scenario (paper §5.3, scaled to this machine): p99 latency per type per policy.

`--n` generation requests (`--gen-prompt` tokens, `--max-tokens` new tokens, greedy, no early
stop) followed by `--n` embedding requests (`--embed-len` tokens), all at time 0. Each policy
(`ibs`, `fcfs`, `homogeneous`; `dedicated` on request) runs the same requests
- on the real engine (`--preset small`): one engine whose scheduler is replaced per policy,
  so the compiled step variants are shared; each policy first runs the workload once untimed
  (scheduling is deterministic, so the timed runs compile nothing: checked), then `--repeats`
  timed runs go round robin over the policies and the median of each metric is reported,
  with the engine's CPU time over wall time and the load average (other processes on the
  cores slow every policy; round robin spreads that over all of them);
- in the simulator (`hetero_jax.sim`, imports no jax) with the same scheduler settings and the
  cost model `--cost` (a JSON from `scripts/calibrate.py`), else a roofline (`--roofline`).
Prints one table (latency p50/p99 per type, generation TTFT p99, makespan) and the target
ratios: embedding p99 of `fcfs` and `homogeneous` over `ibs`, and the change of generation
p99 under `ibs` against `fcfs`. `--json PATH` writes the same numbers.

The defaults give every request the shape of `hetero-jax bench` (128-token prompts, 256-token
outputs, 128-token embeddings): generation holds its sequence slot for its whole decode, which
is where an embedding behind it waits. With short outputs (`--max-tokens 32`) the slots free
quickly and the gain shrinks to what the credits give: they share the chunk budget in
proportion to the work left, so in a burst both queues drain together and the last embedding
finishes near the end of all prefill work under every policy (the median halves; the p99 not).

    python scripts/bench_hol.py --cost cal.json --json hol.json   # ~8 minutes on 2 cores
    python scripts/bench_hol.py --sim-only --n 64                               # seconds
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import time

from hetero_jax.sched import EMBED, GENERATE, SchedulerConfig
from hetero_jax.sim import (HARDWARE, LengthDist, ModelSpec, RooflineCostModel, SimConfig,
                            WorkloadConfig, format_table, load_cost_model, simulate)

METRICS = ("gen_p50_s", "gen_p99_s", "gen_ttft_p99_s", "emb_p50_s", "emb_p99_s", "makespan_s")
COLUMNS = [("where", "where", "{}"), ("policy", "policy", "{}"),
           ("gen p50 ms", "gen_p50_ms", "{:.1f}"), ("gen p99 ms", "gen_p99_ms", "{:.1f}"),
           ("TTFT p99 ms", "gen_ttft_p99_ms", "{:.1f}"), ("emb p50 ms", "emb_p50_ms", "{:.1f}"),
           ("emb p99 ms", "emb_p99_ms", "{:.1f}"), ("makespan ms", "makespan_ms", "{:.1f}"),
           ("cpu/wall", "cpu_per_wall", "{:.2f}"), ("load1", "load1", "{:.1f}"),
           ("timed compiles", "compiles_while_timed", "{}")]


def engine_config(args):
    from hetero_jax import EngineConfig

    return EngineConfig(token_budget=args.budget, chunk_size=args.chunk,
                        max_num_seqs=args.max_num_seqs, max_chunk_seqs=args.max_chunk_seqs,
                        max_model_len=args.max_model_len, scheduler="fcfs", seed=args.seed)


def hol_requests(args) -> list:
    """N generation requests, then N embedding requests (random token ids, seeded)."""
    import numpy as np

    from hetero_jax import EmbedRequest, GenerateRequest, SamplingParams

    rng = np.random.default_rng(args.seed)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    gen = [GenerateRequest(rng.integers(1, 256, args.gen_prompt).tolist(), sp)
           for _ in range(args.n)]
    return gen + [EmbedRequest(rng.integers(1, 256, args.embed_len).tolist())
                  for _ in range(args.n)]


def timed_run(engine, requests: list, token_budget: int) -> tuple[dict, int]:
    """Metrics of one run (the bench's `summarize` of its outputs; `makespan_s` from the first
    arrival to the last finish), and how many step variants it compiled.

    `cpu_per_wall` is this process's CPU time over the wall time (about the number of cores
    the engine kept busy; well below it when other processes share the cores). `load1` is the
    1-minute load average when the run started.
    """
    from hetero_jax.bench.loop import counters, counters_delta, output_records, summarize

    before, load1 = counters(engine), os.getloadavg()[0]
    start, cpu = time.perf_counter(), time.process_time()
    outs = engine.run(requests, use_tqdm=False)
    wall = time.perf_counter() - start
    delta = counters_delta(before, counters(engine))
    row = summarize(output_records(outs), delta, token_budget)
    in_process = hasattr(engine, "runner")  # a DedicatedEngine computes in its workers
    metrics = {"gen_p50_s": row[f"{GENERATE}_p50_latency_s"],
               "gen_p99_s": row[f"{GENERATE}_p99_latency_s"], "gen_ttft_p99_s": row["ttft_p99_s"],
               "emb_p50_s": row[f"{EMBED}_p50_latency_s"],
               "emb_p99_s": row[f"{EMBED}_p99_latency_s"], "makespan_s": row["wall_s"],
               "cpu_per_wall": (time.process_time() - cpu) / wall if in_process else None,
               "load1": load1}
    return metrics, delta["compiles"]


def _use(engine, policy: str):
    """The engine that serves `policy`: the shared one gets a fresh scheduler with it."""
    from hetero_jax.sched import Scheduler

    if policy != "dedicated":
        engine.scheduler = Scheduler(dataclasses.replace(engine.scheduler.cfg, policy=policy))
    return engine


def run_real(args) -> dict:
    """Every policy on the real engine; {policy: median metrics of its timed runs}.

    Each policy first runs once untimed (it compiles its variants); then the timed runs go
    round robin over the policies, so a slow spell of the machine hits every policy alike.
    """
    from hetero_jax import Engine
    from hetero_jax.serving.dedicated import DedicatedEngine

    cfg, requests = engine_config(args), hol_requests(args)
    shared = Engine.from_preset(args.preset, args.seed, cfg)
    engines = {p: shared for p in args.policies if p != "dedicated"}
    with contextlib.ExitStack() as stack:
        if "dedicated" in args.policies:
            engines["dedicated"] = stack.enter_context(
                DedicatedEngine.from_preset(args.preset, args.seed, cfg))
        for policy in args.policies:
            start = time.perf_counter()
            _use(engines[policy], policy).run(requests, use_tqdm=False)
            print(f"  real {policy}: warm-up {time.perf_counter() - start:.0f} s", flush=True)
        runs = {p: [] for p in args.policies}
        for _ in range(args.repeats):
            for policy in args.policies:
                runs[policy].append(timed_run(_use(engines[policy], policy), requests,
                                              cfg.token_budget))
    results = {}
    for policy, rs in runs.items():
        keys = METRICS + ("cpu_per_wall", "load1")
        results[policy] = {k: None if rs[0][0][k] is None else
                           statistics.median(m[k] for m, _ in rs) for k in keys}
        results[policy].update(compiles_while_timed=sum(n for _, n in rs), repeats=len(rs),
                               emb_p99_runs_s=[m["emb_p99_s"] for m, _ in rs],
                               gen_p99_runs_s=[m["gen_p99_s"] for m, _ in rs])
    return results


def sim_cost(args):
    if args.cost:
        return load_cost_model(args.cost)
    from hetero_jax.models.presets import preset_config

    spec = ModelSpec.from_config(preset_config(args.preset), args.preset)
    return RooflineCostModel(spec, HARDWARE[args.roofline])


def run_sim(args, num_pages: int) -> dict:
    """Every policy but `dedicated` in the simulator; {policy: metrics}."""
    cost, results = sim_cost(args), {}
    workload = WorkloadConfig(
        num_requests=2 * args.n, embed_frac=0.5, gen_prompt=LengthDist((args.gen_prompt,)),
        gen_output=LengthDist((args.max_tokens,)), embed_len=LengthDist((args.embed_len,)),
        arrival="burst", order="gen-first", seed=args.seed)
    for policy in args.policies:
        if policy == "dedicated":
            continue
        sched = SchedulerConfig(token_budget=args.budget, chunk_size=args.chunk,
                                max_num_seqs=args.max_num_seqs,
                                max_chunk_seqs=args.max_chunk_seqs, page_size=16,
                                num_pages=num_pages, max_model_len=args.max_model_len,
                                policy=policy, thin_batch=args.thin_batch)
        r = simulate(SimConfig(sched, workload), cost)
        g, e = r.per_type[GENERATE], r.per_type[EMBED]
        results[policy] = {
            "gen_p50_s": g["latency_p50_s"], "gen_p99_s": g["latency_p99_s"],
            "gen_ttft_p99_s": g["ttft_p99_s"], "emb_p50_s": e["latency_p50_s"],
            "emb_p99_s": e["latency_p99_s"], "makespan_s": r.makespan_s,
            "budget_fill": r.avg_budget_fill}
    return {"cost_model": cost.describe(), "policies": results}


def targets(results: dict) -> dict:
    """Embedding p99 of fcfs / homogeneous over ibs; generation p99 change of ibs vs fcfs."""
    ibs = results.get("ibs")
    if not ibs:
        return {}
    out = {f"emb_p99_{p}_over_ibs": results[p]["emb_p99_s"] / ibs["emb_p99_s"]
           for p in ("fcfs", "homogeneous", "dedicated") if p in results}
    if "fcfs" in results:
        out["gen_p99_ibs_vs_fcfs"] = ibs["gen_p99_s"] / results["fcfs"]["gen_p99_s"] - 1
    return out


def print_table(sections: dict) -> None:
    """One row per place and policy (latencies in ms), then the target ratios per place."""
    rows = [dict({f"{k[:-2]}_ms": 1e3 * m[k] for k in METRICS}, where=where, policy=policy,
                 **{k: m.get(k) for k in ("cpu_per_wall", "load1", "compiles_while_timed")})
            for where, results in sections.items() for policy, m in results.items()]
    print(format_table(rows, COLUMNS))
    for where, results in sections.items():
        t = targets(results)
        if t:
            print(f"{where}: " + ", ".join(
                f"{k} {v:+.1%}" if k.startswith("gen") else f"{k} x{v:.2f}" for k, v in t.items()))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--n", type=int, default=32, help="requests of each type")
    p.add_argument("--gen-prompt", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256,
                   help="new tokens per generation (default: the shape of hetero-jax bench)")
    p.add_argument("--embed-len", type=int, default=128)
    p.add_argument("--policies", default="ibs,fcfs,homogeneous",
                   help="comma-separated: ibs, fcfs, homogeneous, dedicated")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-chunk-seqs", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--thin-batch", type=float, default=SchedulerConfig.thin_batch,
                   help="simulator: ibs leads with generation prefill below this x "
                   "--max-num-seqs running generations (0: Algorithm 2 as published)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per policy (median)")
    p.add_argument("--cost", help="simulator cost model JSON (scripts/calibrate.py)")
    p.add_argument("--roofline", default="h200", choices=sorted(HARDWARE),
                   help="simulator roofline when --cost is not given")
    p.add_argument("--sim-only", action="store_true", help="skip the real engine (no jax)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    args.policies = args.policies.split(",")
    bad = set(args.policies) - {"ibs", "fcfs", "homogeneous", "dedicated"}
    if bad:
        p.error(f"unknown policies {sorted(bad)}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    print(f"head-of-line: {args.n} generation ({args.gen_prompt} prompt + {args.max_tokens} "
          f"new tokens) then {args.n} embeddings ({args.embed_len} tokens) at t=0; budget "
          f"{args.budget}, chunk {args.chunk}, {args.max_num_seqs} seqs", flush=True)
    sections, num_pages = {}, 1 + args.max_num_seqs * -(-args.max_model_len // 16)
    if not args.sim_only:
        sections["real"] = run_real(args)
    sim = run_sim(args, num_pages)
    sections["sim"] = sim["policies"]
    print(f"sim cost model: {sim['cost_model']}")
    print_table(sections)
    data = {"config": vars(args), "sim_cost_model": sim["cost_model"], "results": sections,
            "targets": {where: targets(r) for where, r in sections.items()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)
    return data


if __name__ == "__main__":
    main()
