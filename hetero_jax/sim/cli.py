"""`hetero-jax sim`: run scheduling policies against a cost model and print what they give.

In: argv (workload, policies, budget, chunk size, replicas, prefix caching, cost model).
`dedicated` (with `--replicas` >= 2) is the static split: `--embed-replicas` replicas
(default half) serve only embeddings and the rest only generation, each in arrival order;
`ibs` is the engine's IBS with a cost model known: it starts decode chains first while the
batch is thin (`--thin-batch`) and runs a mixed step as two when the cost model says two cost
less (`ibs-cost` is the same); `ibs-paper` is Algorithm 2 as published (neither). The token
budget defaults to the cost model's (`sched.costmodel.ridge_budget`), the chunk to a quarter of
it.
`--workload shared-prefix` runs the bench's groups sharing a prefix (`--groups`,
`--prompts-per-group`, `--prefix-len`, `--suffix-len`; outputs from `--gen-output`, the mix
from `--embed-frac`), with `--control` also the same lengths with nothing shared;
`--prefix-caching on,off` runs every policy with the cache on and off; `--batching
fcfs,lpm,feather,feather-bandit` runs every policy with each batch-forming policy
(`sched.batching`; rows '<policy>+<batching>' when more than one); `--router
least-tokens,prefix-affinity` (with `--replicas` >= 2) runs every policy behind each router
(`sched.router`; prefix affinity remembers each replica's `--num-pages` digests and gives way
at `--load-ratio` x the least load + `--load-slack` tokens). Every flag is checked
before any simulation runs: a bad value, a request that can never fit (`--max-model-len`,
`--num-pages`) or a `--json` path that cannot be written is a `parser.error` (exit status 2)
naming the flag, the value and the limit. Out: one table row per policy, batching policy,
caching setting and workload on stdout (throughput per type, p50/p99 latency and TTFT,
average budget fill, embedding share of scheduled tokens, prefix cache hit rate, the requests
routed by prefix affinity) and, with `--json PATH`, the same numbers as JSON:
`{"config": {...}, "results": {row name: SimResult}}`. Imports no jax.

The argument types shared with the other commands live in `sim.options`.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import math

from hetero_jax.sched import BATCHING, EMBED, GENERATE, POLICIES, SchedulerConfig
from hetero_jax.sched.policies import COST_AWARE_IBS
from hetero_jax.sched.router import ROUTERS, RouterConfig
from hetero_jax.sched.costmodel import HARDWARE, MODELS, StepCost, load_cost_model, ridge_budget
from hetero_jax.sim.options import DefaultsHelpFormatter, int_range, name_list, on_off, \
    output_file, real_range, write_json
from hetero_jax.sim.report import format_table
from hetero_jax.sim.simulate import SimConfig, simulate
from hetero_jax.sim.workload import ARRIVALS, ORDERS, WORKLOADS, LengthDist, WorkloadConfig

LIMITS = dict(budget=(1, 1 << 20), chunk=(1, 1 << 20), max_num_seqs=(1, 100_000),
              max_chunk_seqs=(1, 100_000), page_size=(1, 1 << 16), num_pages=(2, 10_000_000),
              max_model_len=(1, 1 << 24), replicas=(1, 1024), embed_replicas=(1, 1023),
              requests=(1, 10_000_000), clients=(1, 1_000_000), groups=(1, 1_000_000),
              prompts_per_group=(1, 1_000_000), prefix_len=(0, 1 << 24), suffix_len=(1, 1 << 24),
              load_slack=(0, 1 << 40))
LENGTH_SPECS = "128, 96,224, 96:0.55,224:0.45 or 64-256"
PAPER_IBS = "ibs-paper"  # Algorithm 2 as published: no thin-batch lead, no cost-aware split
IBS_ROWS = ("ibs", COST_AWARE_IBS, PAPER_IBS)  # rows that run the ibs policy


def length_spec(text: str) -> str:
    """An argparse type: a length spec `LengthDist.parse` takes, with weights >= 0 and a
    positive sum; returns the text (parsed again where the workload is built)."""
    try:
        dist = LengthDist.parse(text)
    except ValueError:
        dist = None
    if dist is None or any(not w >= 0 for w in dist.weights) or (
            dist.weights and not 0 < sum(dist.weights) < math.inf):
        raise argparse.ArgumentTypeError(
            f"bad length spec {text!r}: expected {LENGTH_SPECS}, lengths >= 1, lo <= hi, "
            "weights >= 0 with a positive sum")
    return text


def router_list(text: str) -> tuple:
    """An argparse type: comma-separated router names, each once."""
    parts = text.split(",")
    bad = next((p for i, p in enumerate(parts) if p not in ROUTERS or p in parts[:i]), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(f"bad value {text!r}: {bad!r} is not a router, or "
                                         f"comes twice; expected {' or '.join(ROUTERS)}")
    return tuple(parts)


def longest(dist: LengthDist) -> int:
    """The longest length `dist` can draw."""
    if dist.span:
        return dist.span[1]
    weights = dist.weights or (1.0,) * len(dist.values)
    return max(v for v, w in zip(dist.values, weights) if w > 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetero-jax sim", formatter_class=DefaultsHelpFormatter,
                                description="Run scheduling "
                                "policies against a cost model and print what they give.")
    p.add_argument("--policy", default="ibs",
                   help=f"comma-separated policies, or 'all' ({', '.join(POLICIES)}, and "
                   f"dedicated when --replicas >= 2); ibs (= {COST_AWARE_IBS}) splits a mixed "
                   "step when the cost model says two steps cost less and leads with generation "
                   f"prefill while the batch is thin; {PAPER_IBS}: Algorithm 2 as published "
                   "(not in 'all')")
    p.add_argument("--cost", default="roofline:h200",
                   help=f"roofline:<{'|'.join(HARDWARE)}> or a cost model JSON file")
    p.add_argument("--model", default="mistral-7b", choices=list(MODELS), help="roofline model")
    s = p.add_argument_group("scheduler")
    ints = {name: int_range(*limits) for name, limits in LIMITS.items()}
    s.add_argument("--budget", type=ints["budget"], default=None,
                   help="token budget per step (default: the cost model's, ridge_budget)")
    s.add_argument("--chunk", type=ints["chunk"], default=None,
                   help="chunk size (default: a quarter of the budget)")
    s.add_argument("--thin-batch", type=real_range(0, 1), default=SchedulerConfig.thin_batch,
                   help="ibs: generation prefill first below this x --max-num-seqs running "
                   "generations")
    s.add_argument("--max-num-seqs", type=ints["max_num_seqs"], default=64,
                   help="sequences per step (and pooler slots)")
    s.add_argument("--max-chunk-seqs", type=ints["max_chunk_seqs"], default=8,
                   help="multi-token items per step")
    s.add_argument("--page-size", type=ints["page_size"], default=16, help="tokens per KV page")
    s.add_argument("--num-pages", type=ints["num_pages"], default=16384,
                   help="KV pages per replica (page 0 is scratch)")
    s.add_argument("--max-model-len", type=ints["max_model_len"], default=4096,
                   help="longest sequence (prompt + output)")
    s.add_argument("--replicas", type=ints["replicas"], default=1,
                   help="scheduler replicas behind the router")
    s.add_argument("--embed-replicas", type=ints["embed_replicas"], default=None,
                   help="dedicated: replicas that serve only embeddings (default: half)")
    s.add_argument("--router", type=router_list, default=None,
                   help="least-tokens (the default), prefix-affinity, or both comma-separated "
                   "(rows '<policy> @<router>'); needs --replicas >= 2")
    s.add_argument("--load-ratio", type=real_range(1), default=None,
                   help="prefix-affinity gives way when its replica's load exceeds this x "
                   f"the least load + --load-slack (default {RouterConfig.load_ratio})")
    s.add_argument("--load-slack", type=ints["load_slack"], default=None,
                   help=f"tokens; see --load-ratio (default {RouterConfig.load_slack})")
    s.add_argument("--prefix-caching", type=on_off, default="on",
                   help="on, off or on,off (side by side: each policy twice; the off rows "
                   "are <policy>/no-cache)")
    s.add_argument("--batching", type=name_list(BATCHING, "batching policy"), default="fcfs",
                   help="batch-forming policies, comma-separated, each with every policy (rows "
                   f"'<policy>+<batching>' when more than one): {','.join(BATCHING)}")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="mixed", choices=WORKLOADS,
                   help="mixed: independent requests; shared-prefix: groups sharing a prefix")
    w.add_argument("--requests", type=ints["requests"], default=500,
                   help="requests in the run (mixed; shared-prefix runs --groups x "
                   "--prompts-per-group)")
    w.add_argument("--embed-frac", type=real_range(0, 1), default=0.2,
                   help="fraction of the requests (shared-prefix: of each group's) that are "
                   "embeddings")
    w.add_argument("--gen-prompt", type=length_spec, default="128",
                   help=f"length spec: {LENGTH_SPECS}")
    w.add_argument("--gen-output", type=length_spec, default="256",
                   help="generated tokens per generation request (length spec)")
    w.add_argument("--embed-len", type=length_spec, default="96:0.55,224:0.45",
                   help="embedding input length (length spec)")
    w.add_argument("--groups", type=ints["groups"], default=8,
                   help="shared-prefix: groups of requests that share a prefix")
    w.add_argument("--prompts-per-group", type=ints["prompts_per_group"], default=16,
                   help="shared-prefix: requests per group")
    w.add_argument("--prefix-len", type=ints["prefix_len"], default=512,
                   help="shared-prefix: tokens of the prefix a group shares")
    w.add_argument("--suffix-len", type=ints["suffix_len"], default=32,
                   help="shared-prefix: tokens of each request's own suffix")
    w.add_argument("--control", action="store_true", help="shared-prefix: also run the same "
                   "lengths with nothing shared (rows '<policy> unshared')")
    w.add_argument("--arrival", default="poisson", choices=ARRIVALS,
                   help="poisson: open-loop arrivals at --rate; closed: --clients, each waiting "
                   "for its last request; burst: every request at time 0")
    w.add_argument("--rate", type=real_range(0, open_lo=True), default=20.0,
                   help="requests/s (poisson)")
    w.add_argument("--clients", type=ints["clients"], default=32, help="closed-loop clients")
    w.add_argument("--async-scheduling", choices=["on", "off"], default="off",
                   help="closed: a client's next request joins the step after next, as in the "
                   "engine, which schedules its next step while one runs")
    w.add_argument("--order", default="mixed", choices=ORDERS,
                   help="the order of embedding and generation requests in the workload")
    w.add_argument("--seed", type=int, default=0, help="workload lengths and arrival times")
    p.add_argument("--json", metavar="PATH", type=output_file,
                   help="also write the results as JSON")
    return p


def _policies(parser, args) -> tuple:
    """(policy names, embedding replicas of `dedicated`), or `parser.error`."""
    known = list(POLICIES) + [COST_AWARE_IBS, PAPER_IBS, "dedicated"]
    every = list(POLICIES) + (["dedicated"] if args.replicas >= 2 else [])
    policies = every if args.policy == "all" else list(dict.fromkeys(args.policy.split(",")))
    for name in policies:
        if name not in known:
            parser.error(f"argument --policy: unknown policy {name!r}; expected one of "
                         f"{', '.join(known)} or all")
    split = args.replicas // 2 if args.embed_replicas is None else args.embed_replicas
    if "dedicated" in policies and not 0 < split < args.replicas:
        parser.error(f"dedicated needs --replicas >= 2 and 0 < --embed-replicas < --replicas "
                     f"(one device per type at least); got --replicas {args.replicas}, "
                     f"--embed-replicas {split}")
    return policies, split


def _fit_problem(args, workload: WorkloadConfig) -> str | None:
    """Why some request of the workload could never run, or None."""
    n_embed = workload.num_embed
    if workload.name == "shared-prefix":
        prompt = embed = workload.prefix_len + workload.suffix_len
    else:
        prompt, embed = longest(workload.gen_prompt), longest(workload.embed_len)
    longest_seq = {}  # kind -> (tokens, how they add up)
    if n_embed < workload.size:
        output = longest(workload.gen_output)
        longest_seq["a generation request"] = (prompt + output, f"{prompt} + {output} = ")
    if n_embed:
        longest_seq["an embedding"] = (embed, "")
    for what, (tokens, sum_) in longest_seq.items():
        if tokens > args.max_model_len:
            return (f"{what} of up to {sum_}{tokens} tokens does not fit --max-model-len "
                    f"{args.max_model_len}")
        pages = -(-tokens // args.page_size)
        if pages > args.num_pages - 1:
            return (f"{what} of up to {tokens} tokens needs {pages} KV pages of "
                    f"{args.page_size} tokens; --num-pages {args.num_pages} holds "
                    f"{args.num_pages - 1} (page 0 is scratch)")
    return None


def _workload(parser, args) -> WorkloadConfig:
    """The `WorkloadConfig` of the flags, or `parser.error` when they do not make one."""
    shared_prefix = args.workload == "shared-prefix"
    if args.control and not shared_prefix:
        parser.error("--control needs --workload shared-prefix (the control is its "
                     "workload with nothing shared)")
    size, most = args.groups * args.prompts_per_group, LIMITS["requests"][1]
    if shared_prefix and size > most:
        parser.error(f"--groups {args.groups} x --prompts-per-group {args.prompts_per_group} "
                     f"= {size} requests; at most {most}")
    return WorkloadConfig(
        name=args.workload, num_requests=args.requests, embed_frac=args.embed_frac,
        gen_prompt=LengthDist.parse(args.gen_prompt), gen_output=LengthDist.parse(args.gen_output),
        embed_len=LengthDist.parse(args.embed_len), arrival=args.arrival, rate=args.rate,
        clients=args.clients, order=args.order, seed=args.seed, groups=args.groups,
        prompts_per_group=args.prompts_per_group, prefix_len=args.prefix_len,
        suffix_len=args.suffix_len)


def _configs(parser, args, cost) -> tuple:
    """(row names, one `SimConfig` each), or `parser.error` naming what cannot run. A row per
    policy, batching policy (with more than one, `<policy>+<batching>`), prefix caching setting
    (with both, the off rows are `<policy>/no-cache`) and, with `--control`, workload
    (`<policy> unshared`: the control)."""
    policies, split = _policies(parser, args)
    workload = _workload(parser, args)
    problem = _fit_problem(args, workload)
    if problem:
        parser.error(problem)
    sched = SchedulerConfig(
        token_budget=args.budget, chunk_size=args.chunk, max_num_seqs=args.max_num_seqs,
        max_chunk_seqs=args.max_chunk_seqs, page_size=args.page_size, num_pages=args.num_pages,
        max_model_len=args.max_model_len, thin_batch=args.thin_batch)
    workloads = [("", workload)] + (
        [(" unshared", dataclasses.replace(workload, shared=False))] if args.control else [])
    both = len(args.prefix_caching) > 1
    routers = _routers(parser, args)
    names, configs = [], []
    for name, batching in itertools.product(policies, args.batching):
        row = f"{name}+{batching}" if len(args.batching) > 1 else name
        for caching in args.prefix_caching:
            policy_sched = dataclasses.replace(
                sched, policy="ibs" if name in IBS_ROWS else {"dedicated": "fcfs"}.get(name, name),
                prefix_caching=caching, batching=batching,
                step_cost=StepCost(cost, args.page_size) if name in IBS_ROWS else None)
            if name == PAPER_IBS:
                policy_sched = dataclasses.replace(policy_sched, step_cost=None, thin_batch=0.0)
            for (suffix, wl), (at, router) in itertools.product(workloads, routers):
                names.append(f"{row}{'/no-cache' if both and not caching else ''}{suffix}{at}")
                configs.append(SimConfig(policy_sched, wl, args.replicas,
                                         split if name == "dedicated" else 0, router,
                                         async_scheduling=args.async_scheduling == "on"))
    return names, configs


def _routers(parser, args) -> list:
    """[(row suffix, RouterConfig)] of `--router`, or `parser.error`."""
    for flag, value in (("--load-ratio", args.load_ratio), ("--load-slack", args.load_slack)):
        if value is not None and "prefix-affinity" not in (args.router or ()):
            parser.error(f"argument {flag}: bounds the prefix-affinity router; it needs "
                         "--router prefix-affinity")
    if args.router is None:
        return [("", None)]
    if args.replicas < 2:
        parser.error(f"argument --router: routes between replicas; it needs --replicas >= 2 "
                     f"(got {args.replicas})")
    bound = {k: v for k, v in (("load_ratio", args.load_ratio), ("load_slack", args.load_slack))
             if v is not None}
    return [(f" @{name}" if len(args.router) > 1 else "",
             RouterConfig(name, args.num_pages - 1, **bound)) for name in args.router]


def _sizes(args, cost) -> None:
    """--budget and --chunk, where not given, from the cost model (`ridge_budget`)."""
    if args.budget is None:
        args.budget = ridge_budget(cost)
    if args.chunk is None:
        args.chunk = max(args.budget // 4, 1)
    if args.chunk > args.budget:
        raise ValueError(f"--chunk {args.chunk} exceeds --budget {args.budget}")


def _cost_model(parser, args):
    """The cost model `--cost` names, or `parser.error` saying why it cannot be loaded."""
    try:
        return load_cost_model(args.cost, args.model)
    except (OSError, ValueError) as e:
        parser.error(f"argument --cost: {e}")
    except (KeyError, AttributeError, TypeError) as e:
        parser.error(f"argument --cost: {args.cost!r} is not a cost model JSON file "
                     f"({type(e).__name__}: {e})")


# (header, row key, format): latencies in milliseconds
COLUMNS = [
    ("policy", "policy", "{}"), ("gen req/s", "gen_rps", "{:.2f}"),
    ("gen tok/s", "gen_tps", "{:.0f}"), ("emb req/s", "emb_rps", "{:.2f}"),
    ("gen p50 ms", "gen_p50", "{:.1f}"), ("gen p99 ms", "gen_p99", "{:.1f}"),
    ("TTFT p50 ms", "ttft_p50", "{:.1f}"), ("TTFT p99 ms", "ttft_p99", "{:.1f}"),
    ("emb p50 ms", "emb_p50", "{:.1f}"), ("emb p99 ms", "emb_p99", "{:.1f}"),
    ("fill", "fill", "{:.0%}"), ("emb tokens", "emb_share", "{:.1%}"),
    ("hit rate", "hit_rate", "{:.1%}"), ("affinity", "affinity", "{:.0%}"),
    ("steps", "steps", "{}"),
    ("preempted", "preemptions", "{}"),
]


def _ms(x):
    return None if x is None else 1e3 * x


def _affinity(routing: dict):
    """The share of requests the router sent by prefix affinity (None: no such router)."""
    total = sum(routing.get(k, 0) for k in ("least_tokens", "affinity", "overloaded"))
    return routing["affinity"] / total if routing.get("affinity") or \
        routing.get("overloaded") else None


def table_row(name: str, r) -> dict:
    """A `SimResult` as one row of `COLUMNS`."""
    g, e = r.per_type[GENERATE], r.per_type[EMBED]
    return dict(policy=name, gen_rps=g["throughput_rps"], gen_tps=g["tokens_per_s"],
                emb_rps=e["throughput_rps"], gen_p50=_ms(g["latency_p50_s"]),
                gen_p99=_ms(g["latency_p99_s"]), ttft_p50=_ms(g["ttft_p50_s"]),
                ttft_p99=_ms(g["ttft_p99_s"]), emb_p50=_ms(e["latency_p50_s"]),
                emb_p99=_ms(e["latency_p99_s"]), fill=r.avg_budget_fill,
                emb_share=r.embed_token_share, hit_rate=r.cache_hit_rate,
                affinity=_affinity(r.routing), steps=r.steps,
                preemptions=r.preemptions)


def sim_main(argv=None) -> dict:
    """Entry point of `hetero-jax sim`; returns {row name: SimResult}."""
    parser = build_parser()
    args = parser.parse_args(argv)
    cost = _cost_model(parser, args)
    try:
        _sizes(args, cost)
    except ValueError as e:
        parser.error(str(e))
    names, configs = _configs(parser, args, cost)
    results = {name: simulate(cfg, cost) for name, cfg in zip(names, configs)}
    wl = configs[0].workload
    what = f"{wl.size} requests" if wl.name == "mixed" else (
        f"{wl.groups} groups x {wl.prompts_per_group} requests sharing a {wl.prefix_len}-token "
        f"prefix, each with a {wl.suffix_len}-token suffix")
    print(f"cost model: {cost.describe()}; {what}, {args.arrival} arrivals, "
          f"{args.replicas} replica(s), budget {args.budget}, chunk {args.chunk}")
    print(format_table([table_row(n, r) for n, r in results.items()], COLUMNS))
    print("latencies from arrival; TTFT: to the first generated token; fill: scheduled tokens /\n"
          "token budget, mean over steps; emb tokens: the embeddings' share of scheduled tokens;\n"
          "hit rate: tokens found in the prefix cache / full-page tokens looked up at admission\n"
          "(- : cache off); affinity: requests routed to the replica holding their prefix")
    if args.json:
        write_json(args.json, {"config": vars(args),
                               "results": {n: r.to_dict() for n, r in results.items()}}, indent=2)
    return results


if __name__ == "__main__":
    sim_main()
