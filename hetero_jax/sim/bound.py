"""What mixing embeddings and generation into one step can gain under a linear cost model.

    python -m hetero_jax.sim.bound --cost calibration/small-cpu.json [--ratios 9:1,5:5,1:9]

In: the bench's request trace at each ratio (`sim.workload.ratio_workload`: 128-token
embeddings and prompts, 256-token outputs, `run_size` requests), all of it there at t=0 (a
burst: the offline setting), the bench's scheduler limits and a `LinearCostModel`. Out, per
ratio: lower bounds on the total time of any schedule of mixed steps and of any schedule of
homogeneous steps (one request type a step), the requests/s they allow, the gain of the one
over the other, and the simulated requests/s of ibs, the cost-aware ibs (ibs-cost), fcfs and
homogeneous on the same trace with the fraction of the bound's gain each captures. Imports
no jax.

Why a lower bound: a step costs intercept + sum_f c_f * feature_f with every coefficient >= 0
(`LinearCostModel`), and `tokens` padded to its bucket. Over a schedule of N steps the
features add up: decode tokens, sampled rows and query-key pairs are fixed by the trace, items
(`seqs`) are at least the chunks (ceil(L / chunk_size) per input) plus the decodes, the
context read at least its value with the short chunk first, and the padded tokens at least
max(tokens, N * smallest bucket). So time >= N * intercept + sum_f c_f * (least total of f).
N is at least each of: the tokens over the budget, the chunks over `max_chunk_seqs`, the items
over `max_num_seqs`, the longest request's chain of steps (its chunks, then one decode a step),
and, since at most `max_num_seqs` requests hold a sequence slot at once, ceil(G / slots) x the
shortest generation's chain and the slot-steps of all requests over the slots. Homogeneous
steps take the same bound per type, and their step counts add. Both are bounds, not optima:
their ratio is the gain the model allows when each kind of schedule reaches its bound.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from hetero_jax.sched import EMBED, GENERATE, SchedulerConfig
from hetero_jax.sched.costmodel import LinearCostModel, StepCost, load_cost_model
from hetero_jax.sim.report import format_table
from hetero_jax.sim.simulate import SimConfig, Simulation
from hetero_jax.sim.workload import ratio_workload, request_specs, run_size

RATIOS = ((9, 1), (5, 5), (1, 9))
# the bench's defaults (`hetero-jax bench`): lengths, requests, --min-gens = --clients
BENCH = dict(requests=48, min_gens=16, embed_len=128, prompt_len=128, output_len=256)
BENCH_SCHED = SchedulerConfig(token_budget=256, chunk_size=64, max_num_seqs=32,
                              max_chunk_seqs=4, page_size=16, num_pages=769, max_model_len=384)
POLICY_ROWS = ("ibs", "ibs-cost", "fcfs", "homogeneous")


@dataclasses.dataclass
class Work:
    """The least totals a group of requests puts on any schedule, and its least step count."""

    features: dict  # feature -> least total over the group's steps
    min_steps: int


def _request_work(length: int, outputs: int, chunk: int) -> tuple:
    """(least features, chain of steps) of one request: `outputs` 0 for an embedding."""
    k = -(-length // chunk)
    context = sum(length - chunk * j for j in range(k))  # the short chunk first
    pairs = length * (length + 1) // 2
    decodes = max(outputs - 1, 0)  # the last chunk samples the first token
    positions = range(length, length + decodes)  # a decode at start p: p + 1 keys
    f = dict(tokens=length + decodes, embed_tokens=0 if outputs else length,
             prefill_tokens=length if outputs else 0, decode_tokens=decodes, seqs=k + decodes,
             context_tokens=context + sum(p + 1 for p in positions),
             attn_pairs=pairs + sum(p + 1 for p in positions), sampled=outputs)
    return f, k + decodes


def group_work(specs: list, cfg: SchedulerConfig) -> Work:
    """`Work` of `specs` (`RequestSpec`s) served under `cfg`'s limits."""
    totals, chains, gen_chains, chunks = {}, [], [], 0
    for spec in specs:
        f, chain = _request_work(spec.input_len, spec.max_tokens, cfg.chunk_size)
        for name, v in f.items():
            totals[name] = totals.get(name, 0) + v
        chains.append(chain)
        chunks += f["seqs"] - f["decode_tokens"]
        if spec.kind == GENERATE:
            gen_chains.append(chain)
    slots = cfg.max_num_seqs
    steps = max(-(-totals["tokens"] // cfg.token_budget), -(-chunks // cfg.max_chunk_seqs),
                -(-totals["seqs"] // slots), max(chains), -(-sum(chains) // slots),
                -(-len(gen_chains) // slots) * min(gen_chains, default=0))
    return Work(totals, steps)


def time_bound(model: LinearCostModel, groups: list) -> float:
    """The least total seconds of the steps of `groups` ([Work]: one a step type; a mixed
    schedule has one group, a homogeneous one a group per type)."""
    assert model.intercept_s >= 0 and all(c >= 0 for _, c in model.coef_s), (
        f"the bound needs coefficients >= 0: {model.intercept_s=}, {model.coef_s=}")
    smallest = model.token_buckets[0] if model.token_buckets else 0
    total = 0.0
    for work in groups:
        feats = dict(work.features)
        feats["tokens"] = max(feats["tokens"], work.min_steps * smallest)
        total += work.min_steps * model.intercept_s + sum(c * feats[f] for f, c in model.coef_s)
    return total


def bound_row(model: LinearCostModel, specs: list, cfg: SchedulerConfig) -> dict:
    """Lower bounds on the seconds of mixed and of homogeneous schedules of `specs`."""
    by_kind = [[s for s in specs if s.kind == kind] for kind in (EMBED, GENERATE)]
    mixed = time_bound(model, [group_work(specs, cfg)])
    homo = time_bound(model, [group_work(g, cfg) for g in by_kind if g])
    return dict(requests=len(specs), mixed_bound_s=mixed, homo_bound_s=homo,
                mixed_bound_rps=len(specs) / mixed, homo_bound_rps=len(specs) / homo,
                bound_gain=homo / mixed - 1)


def simulate_rows(model, workload, cfg: SchedulerConfig) -> dict:
    """Simulated requests/s (and split steps) of each of `POLICY_ROWS` on `workload`."""
    out = {}
    for row in POLICY_ROWS:
        policy, cost = (("ibs", StepCost(model, cfg.page_size)) if row == "ibs-cost"
                        else (row, None))
        sim_cfg = SimConfig(dataclasses.replace(cfg, policy=policy, step_cost=cost), workload)
        sim = Simulation(sim_cfg, model)
        result = sim.run()
        done = sum(t["completed"] for t in result.per_type.values())
        assert done == workload.size, f"{row}: {done} of {workload.size} requests finished"
        out[row] = dict(rps=done / result.makespan_s, steps=result.steps,
                        splits=getattr(sim.replicas[0].sched.policy, "splits", 0))
    return out


def bound_table(model, ratios=RATIOS, cfg: SchedulerConfig = BENCH_SCHED, **bench) -> list:
    """One row per ratio: the bounds, the simulated policies and the fraction of the bound's
    gain each captures (its gain over simulated homogeneous / the bound's gain)."""
    b = dict(BENCH, **bench)
    rows = []
    for ratio in ratios:
        num = run_size(ratio, b["requests"], b["min_gens"])
        workload = ratio_workload(ratio, num, b["embed_len"], b["prompt_len"],
                                  b["output_len"], arrival="burst")
        row = dict(ratio=f"{ratio[0]}:{ratio[1]}", **bound_row(model, request_specs(workload),
                                                               cfg))
        sims = simulate_rows(model, workload, cfg)
        homo = sims["homogeneous"]["rps"]
        for name, r in sims.items():
            gain = r["rps"] / homo - 1
            row[name] = dict(r, gain=gain, captured=gain / row["bound_gain"]
                             if row["bound_gain"] > 0 else None)
        rows.append(row)
    return rows


COLUMNS = [("ratio", "ratio", "{}"), ("reqs", "requests", "{}"),
           ("mixed bound r/s", "mixed_bound_rps", "{:.3f}"),
           ("homo bound r/s", "homo_bound_rps", "{:.3f}"), ("bound gain", "bound_gain", "{:.1%}")]
COLUMNS += [(f"{name} r/s", f"{name}_rps", "{:.3f}") for name in POLICY_ROWS]
COLUMNS += [(f"{name} captured", f"{name}_captured", "{:.0%}") for name in ("ibs", "ibs-cost")]
COLUMNS += [("ibs-cost splits", "splits", "{}")]


def _flat(row: dict) -> dict:
    flat = {k: v for k, v in row.items() if not isinstance(v, dict)}
    for name in POLICY_ROWS:
        flat[f"{name}_rps"] = row[name]["rps"]
        flat[f"{name}_captured"] = row[name]["captured"]
    flat["splits"] = row["ibs-cost"]["splits"]
    return flat


def parse_ratios(text: str) -> tuple:
    """'9:1,5:5' -> ((9, 1), (5, 5)): embed:gen weights, each ratio with a generation."""
    try:
        ratios = tuple(tuple(int(x) for x in part.split(":")) for part in text.split(","))
    except ValueError:
        ratios = ()
    if not ratios or any(len(r) != 2 or min(r) < 0 or r[1] == 0 for r in ratios):
        raise argparse.ArgumentTypeError(f"bad ratios {text!r}: expected EMBED:GEN integers "
                                         "like 9:1,5:5 with GEN >= 1")
    return ratios


def main(argv=None) -> list:
    p = argparse.ArgumentParser(prog="python -m hetero_jax.sim.bound", description=__doc__
                                .splitlines()[0])
    p.add_argument("--cost", required=True, help="a linear cost model JSON file "
                   "(scripts/calibrate.py)")
    p.add_argument("--ratios", type=parse_ratios, default="9:1,5:5,1:9")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args(argv)
    model = load_cost_model(args.cost)
    if not isinstance(model, LinearCostModel):
        p.error(f"argument --cost: the bound needs a linear cost model, not {model.describe()}")
    rows = bound_table(model, args.ratios)
    print(f"cost model: {model.describe()}; the bench's trace at t=0 (burst), budget "
          f"{BENCH_SCHED.token_budget}, chunk {BENCH_SCHED.chunk_size}")
    print(format_table([_flat(r) for r in rows], COLUMNS))
    print("captured: (policy r/s / homogeneous r/s - 1) / bound gain, both from the simulator;\n"
          "bound gain: homogeneous time bound / mixed time bound - 1")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cost": args.cost, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
