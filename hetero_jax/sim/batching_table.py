"""Batching policies side by side in the simulator, with cascade attention off and on.

    python -m hetero_jax.sim.batching_table --cost roofline:h200 --model llama-3-8b \
        --groups 4,16 --prefix-len 2048 --control
    python -m hetero_jax.sim.batching_table --arms --groups 1,4,16 --control --embed-frac 0,0.5

In: the flags below (a shared-prefix workload in a closed loop or a burst, the scheduler's
limits, a cost model). Out: one row per workload x mix (`--embed-frac`, a comma list) x
cascade setting x batching policy (and, with `--each-arm`, feather with each bandit arm
fixed): generation requests and tokens per second, the ratio to fcfs with the same cascade
setting, the KV the attention read (GB, from the model's bytes per token), steps, the mean
decode batch, the steps that used cascade, the share of decode steps on one prefix group
("homog"), the ratio to fcfs with the plain kernel (the paper's baseline: cascade off), the
prefix-cache hit rate, the bandit's best arm and the row's no-KV ceiling: its ratio to that
baseline had each of its steps read no KV (the most any sharing of KV reads, cascade's included,
could give these steps under the cost model). `--planned-tiles`: cascade tiles sized by the
planner instead of `--cascade-rows` rows, each read once per block of members one program of the
Pallas kernel serves (`tiles.kernel_block_rows` of the model's heads), as the engine on the
Pallas kernel does; `--mixed-cascade`: cascade also in mixed steps, as it does too.
`--l2-share F` (a roofline only) credits locality: repeated reads of a step's shared pages come
from the share F of the GPU's L2 while those pages fit (`sim.simulate`, "Locality", says what
that assumes); the KV column is then what HBM served. With `--arms`, the bandit's target
instead: one row per workload x mix x cascade setting with fcfs, every arm of `feather-bandit`
run alone as a fixed `feather` on the same trace, and the bandit; requests per second
(generations and embeddings) of fcfs, of the best fixed arm (named) and of the bandit, and the
bandit over each. `--json PATH` writes the rows.
Every run uses the scheduler of the engine (`sched.Scheduler`) under the simulator's cost
model; imports no jax.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools

from hetero_jax.sched import BATCHING, SchedulerConfig
from hetero_jax.sched.bandit import DEFAULT_ARMS
from hetero_jax.sched.batching import FeatherConfig
from hetero_jax.sched.costmodel import (HARDWARE, MODELS, ModelSpec, RooflineCostModel,
                                        load_cost_model)
from hetero_jax.sched.tiles import CascadeSettings, kernel_block_rows
from hetero_jax.sim.options import int_range, on_off, output_file, real_range, write_json
from hetero_jax.sim.report import format_table
from hetero_jax.sim.simulate import SimConfig, simulate
from hetero_jax.sim.workload import LengthDist, WorkloadConfig

COLUMNS = [("workload", "workload", "{}"), ("mix", "mix", "{}"), ("batching", "batching", "{}"),
           ("cascade", "cascade", "{}"), ("gen req/s", "gen_rps", "{:.2f}"),
           ("gen tok/s", "gen_tps", "{:.0f}"), ("x fcfs", "vs_fcfs", "{:.2f}"),
           ("KV read GB", "kv_gb", "{:.0f}"), ("steps", "steps", "{}"),
           ("decode batch", "decode_batch", "{:.1f}"), ("cascade steps", "cascade_steps", "{}"),
           ("homog", "homog", "{:.0%}"), ("x fcfs/plain", "vs_plain", "{:.2f}"),
           ("no-KV ceiling", "kv_free_ceiling", "{:.2f}"), ("hit", "hit_rate", "{:.0%}"),
           ("best arm", "best_arm", "{}")]
ARM_COLUMNS = [("workload", "workload", "{}"), ("mix", "mix", "{}"), ("cascade", "cascade", "{}"),
               ("fcfs req/s", "fcfs_rps", "{:.2f}"), ("best fixed arm", "best_arm", "{}"),
               ("arm req/s", "arm_rps", "{:.2f}"), ("bandit req/s", "bandit_rps", "{:.2f}"),
               ("x best arm", "vs_arm", "{:.3f}"), ("x fcfs", "vs_fcfs", "{:.3f}"),
               ("worst arm req/s", "worst_rps", "{:.2f}"), ("bandit's best", "learned", "{}")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hetero_jax.sim.batching_table",
                                description=__doc__.split("\n")[0])
    ints = int_range(1, 1 << 20)
    p.add_argument("--cost", default="roofline:h200",
                   help=f"roofline:<{'|'.join(HARDWARE)}> or a cost model JSON file")
    p.add_argument("--model", default="llama-3-8b", choices=list(MODELS),
                   help="the roofline's model and the bytes per KV token of the KV column")
    p.add_argument("--groups", default="4", help="comma-separated prefix group counts")
    p.add_argument("--prompts-per-group", type=ints, default=64)
    p.add_argument("--prefix-len", type=int_range(0, 1 << 20), default=2048)
    p.add_argument("--suffix-len", type=ints, default=32)
    p.add_argument("--output-len", type=ints, default=256)
    p.add_argument("--embed-frac", type=_fractions, default="0",
                   help="comma-separated fractions of each group's requests that are "
                   "embeddings (one mix each)")
    p.add_argument("--clients", type=ints, default=64, help="closed loop: concurrent requests")
    p.add_argument("--arrival", default="closed", choices=["closed", "burst"],
                   help="closed loop, or every request queued at time 0")
    p.add_argument("--control", action="store_true", help="also the no-sharing control")
    p.add_argument("--each-arm", action="store_true", help="feather with each arm fixed")
    p.add_argument("--homogeneous-arm", action="store_true", help="also feather[homog]: "
                   "feather whose decode steps each hold one prefix group")
    p.add_argument("--arms", action="store_true", help="the bandit against its best fixed "
                   "arm (each run alone on the same trace) and fcfs, one row per setting")
    p.add_argument("--cascade", type=on_off, default="off,on", help="off, on or off,on")
    p.add_argument("--budget", type=ints, default=2048)
    p.add_argument("--chunk", type=ints, default=512)
    p.add_argument("--max-num-seqs", type=ints, default=64)
    p.add_argument("--max-chunk-seqs", type=ints, default=8)
    p.add_argument("--num-pages", type=int_range(2, 1 << 30), default=65536)
    p.add_argument("--chunk-pages", type=ints, default=4)
    p.add_argument("--cascade-rows", type=ints, default=8)
    p.add_argument("--planned-tiles", action="store_true",
                   help="cascade tiles sized by the planner (a tile per shared prefix, any "
                   "length, read once per Pallas program), not --cascade-rows rows each")
    p.add_argument("--mixed-cascade", action="store_true",
                   help="cascade also over the decodes of mixed steps (the Pallas engine's)")
    p.add_argument("--l2-share", type=real_range(0, 1), default=0.0,
                   help="the share of the GPU's L2 that holds KV: repeated reads of a step's "
                   "shared pages hit it while those pages fit (0: no locality)")
    p.add_argument("--policy", default="ibs", help="the scheduling policy (embed vs generate)")
    p.add_argument("--json", metavar="PATH", type=output_file)
    return p


def _fractions(text: str) -> tuple:
    """An argparse type: comma-separated numbers in [0, 1]."""
    return tuple(real_range(0, 1)(part) for part in text.split(","))


def _contenders(args) -> list:
    """(name, batching, FeatherConfig) for every policy (and fixed arm) of the table."""
    base = FeatherConfig(chunk_pages=args.chunk_pages)
    names = ("fcfs", "feather-bandit") if args.arms else BATCHING
    out = [(name, name, base) for name in names]
    if args.homogeneous_arm:
        out.append(("feather[homog]", "feather", dataclasses.replace(base, homogeneous=True)))
    if args.each_arm or args.arms:
        out += [(f"feather[{arm}]", "feather",
                 dataclasses.replace(base, loss_limit=arm.loss_limit, cap=arm.cap))
                for arm in DEFAULT_ARMS]
    return out


def _settings(args) -> list:
    """(workload label, mix label, cascade label, WorkloadConfig, CascadeSettings | None)."""
    groups = [int(g) for g in args.groups.split(",")]
    workloads = [(f"{g} groups", g, True) for g in groups]
    if args.control:
        workloads.append(("no sharing", groups[0], False))
    spec: ModelSpec = MODELS[args.model]
    block = kernel_block_rows(spec.num_heads, spec.num_kv_heads) if args.planned_tiles else 0
    out = []
    for (label, g, shared), frac in itertools.product(workloads, args.embed_frac):
        wl = WorkloadConfig(name="shared-prefix", groups=g,
                            prompts_per_group=args.prompts_per_group,
                            prefix_len=args.prefix_len, suffix_len=args.suffix_len,
                            gen_output=LengthDist((args.output_len,)), embed_frac=frac,
                            arrival=args.arrival, clients=args.clients, shared=shared)
        for cascade in sorted(args.cascade):
            settings = CascadeSettings(args.cascade_rows, 16, args.max_num_seqs,
                                       planned=args.planned_tiles, mixed=args.mixed_cascade,
                                       block_rows=block) if cascade else None
            out.append((label, f"{frac:.0%} emb" if frac else "gen", "on" if cascade else "off",
                        wl, settings))
    return out


def l2_kv_tokens(cost, spec: ModelSpec, share: float) -> int:
    """KV tokens of one layer that `share` of the cost model's GPU L2 holds (0 for none)."""
    if not share:
        return 0
    if not isinstance(cost, RooflineCostModel) or not cost.hardware.l2_bytes:
        raise ValueError(f"--l2-share {share} needs a roofline with an L2 size, not "
                         f"{cost.describe()}")
    return int(share * cost.hardware.l2_bytes * spec.num_layers / spec.kv_bytes_per_token)


def _results(args, cost, wl, cascade, l2: int) -> dict:
    """{contender name: SimResult} on one workload and cascade setting (`l2`: the L2's KV
    tokens a layer, `l2_kv_tokens`)."""
    out = {}
    for name, batching, feather in _contenders(args):
        sched = SchedulerConfig(
            token_budget=args.budget, chunk_size=args.chunk, max_num_seqs=args.max_num_seqs,
            max_chunk_seqs=args.max_chunk_seqs, page_size=16, num_pages=args.num_pages,
            max_model_len=args.prefix_len + args.suffix_len + args.output_len,
            policy=args.policy, prefix_caching=True, batching=batching, feather=feather)
        out[name] = simulate(SimConfig(sched, wl, cascade=cascade, l2_kv_tokens=l2), cost)
    return out


def table(args, cost, l2: int) -> list:
    """The rows of `args` under `cost` (a loaded cost model) with `l2` KV tokens of L2 a
    layer (`l2_kv_tokens`)."""
    spec: ModelSpec = MODELS[args.model]
    rows = []
    for label, mix, cascade, wl, settings in _settings(args):
        results = _results(args, cost, wl, settings, l2)
        if args.arms:
            rows.append(_arm_row(dict(workload=label, mix=mix, cascade=cascade), results))
            continue
        base = results["fcfs"].per_type["generate"]["throughput_rps"]
        for name, r in results.items():
            g = r.per_type["generate"]
            rows.append(dict(
                workload=label, mix=mix, batching=name, cascade=cascade,
                gen_rps=g["throughput_rps"], gen_tps=g["tokens_per_s"],
                vs_fcfs=g["throughput_rps"] / base if base else None,
                kv_gb=r.kv_read_tokens * spec.kv_bytes_per_token / 1e9, steps=r.steps,
                decode_batch=r.mean_decode_batch, cascade_steps=r.cascade_steps,
                homog=r.homogeneous_decode_share, hit_rate=r.cache_hit_rate,
                best_arm=r.batching.get("best_arm", ""),
                kv_free_rps=g["completed"] / (r.makespan_s - r.busy_s + r.kv_free_s)))
    plain = {(r["workload"], r["mix"]): r["gen_rps"] for r in rows
             if r.get("batching") == "fcfs" and r["cascade"] == "off"}
    for r in rows:  # the paper's baseline: fcfs with the plain kernel
        base = plain.get((r["workload"], r["mix"]))
        if "batching" in r:
            r["vs_plain"] = r["gen_rps"] / base if base else None
            r["kv_free_ceiling"] = r.pop("kv_free_rps") / base if base else None
    return rows


def _arm_row(row: dict, results: dict) -> dict:
    """The bandit beside fcfs and its best and worst fixed arms."""
    arms = {n[len("feather["):-1]: r.requests_per_s for n, r in results.items()
            if n.startswith("feather[")}
    best = max(arms, key=arms.get)
    fcfs, bandit = results["fcfs"].requests_per_s, results["feather-bandit"].requests_per_s
    return dict(row, fcfs_rps=fcfs, best_arm=best, arm_rps=arms[best], bandit_rps=bandit,
                vs_arm=bandit / arms[best], vs_fcfs=bandit / fcfs,
                worst_rps=min(arms.values()), arms=arms,
                learned=results["feather-bandit"].batching.get("best_arm", ""))


def main(argv=None) -> list:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # a cost model that cannot load, or --l2-share without an L2: a usage error
        cost = load_cost_model(args.cost, args.model)
        l2 = l2_kv_tokens(cost, MODELS[args.model], args.l2_share)
    except (OSError, ValueError) as e:
        parser.error(str(e))
    rows = table(args, cost, l2)
    print(f"cost model {args.cost} / {args.model}; {args.prompts_per_group} requests per group, "
          f"prefix {args.prefix_len} + suffix {args.suffix_len} tokens, {args.output_len} "
          f"outputs, {args.clients if args.arrival == 'closed' else 'all'} at once "
          f"({args.arrival}), scheduler {args.policy}")
    print(format_table(rows, ARM_COLUMNS if args.arms else COLUMNS))
    if args.json:
        write_json(args.json, dict(config=vars(args), rows=rows), indent=1)
    return rows


if __name__ == "__main__":
    main()
