"""Budget packing with atomic vs chunked embeddings under FCFS (the paper's Table 8).

A step-level model, no time and no model: an arrival-ordered stream of requests, always
backlogged, `--gen-frac` of them generation (`--prefill` prompt tokens, then `--decode`
output tokens advanced `--decode-step` tokens per step) and the rest embeddings (`--embed-lengths`,
the longer one with probability `--embed-long-frac`). Every step has `--budget` tokens and
is built like the `fcfs` scheduler builds it: running decodes first, then running chunks
(prefill or embedding, at most `--chunk` tokens each), then new requests in arrival order.
- chunked: an embedding advances in chunks of at most `--chunk` tokens, like a prefill.
- atomic: an embedding runs whole in one step; when it does not fit in what is left of the
  budget it waits at the head of the queue (`--atomic-wait block`, strict FCFS) or lets the
  requests behind it pass (`--atomic-wait skip`, vLLM's rule for a request it cannot chunk).
`--max-seqs` caps running generation requests (0: no cap).

Queues. `--queues shared` (the default) is the paper's FCFS: one stream, so requests finish
in the arrival mix and every step's tokens are `gen_throughput * (prefill + decode) +
embed_throughput * mean embedding length`: generation throughput is proportional to budget
fill, and chunking, which raises fill, raises generation throughput by the same factor (with
the defaults x1.9 both). Generation throughput stays unchanged only where generation is not
queued behind embeddings: `--queues split` keeps each type in its own arrival-ordered queue
and serves generation first (running chunks, then new requests up to `--max-seqs`), then
embeddings (running chunks, then new ones) in what is left, as a generation engine at its
sequence cap would; there `--gen-frac` is unused, and atomic and chunked differ only in the
embeddings that fill the leftover budget.

Prints and (with `--json PATH`) writes `{"atomic": {...}, "chunked": {...}}`, each with
`budget_fill` (mean fraction of the budget used per step), `gen_throughput` and
`embed_throughput` (finished requests per step), and tokens per step of each type; steps
before `--warmup` are left out.

    python scripts/packing_sim.py --budget 256 --chunk 64 --gen-frac 0.8 --json out.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random


@dataclasses.dataclass
class Req:
    embed: bool
    todo: int  # input tokens not yet computed
    decode: int  # output tokens not yet generated (0 for an embedding)


def new_request(rng: random.Random, args, cls: str = "all") -> Req:
    """The next request of the stream of `cls`: all (the `--gen-frac` mix), gen or embed."""
    if cls == "gen" or (cls == "all" and rng.random() < args.gen_frac):
        return Req(False, args.prefill, args.decode)
    short, long_ = args.embed_lengths
    return Req(True, long_ if rng.random() < args.embed_long_frac else short, 0)


def _take(r: Req, n: int, used: dict) -> int:
    r.todo -= n
    used["embed" if r.embed else "gen"] += n
    return n


def run_step(running: list, queues: dict, args, atomic: bool, next_req) -> dict:
    """One step: returns the tokens it scheduled per type; admits from `queues` in place.

    `queues` maps a class (`all`, or `gen` then `embed`) to its arrival-ordered queue; after
    the decodes, each class in turn gets its running chunks, then admits from its queue.
    """
    budget = args.budget
    used = {"gen": 0, "embed": 0}
    for r in running:  # decodes first
        if not r.embed and r.todo == 0 and budget > 0:
            n = min(args.decode_step, r.decode, budget)
            r.decode, budget, used["gen"] = r.decode - n, budget - n, used["gen"] + n
    num_gen = sum(not r.embed for r in running)
    for cls, queue in queues.items():
        for r in running:  # running chunks of the class, in admission order
            if r.todo > 0 and budget > 0 and cls in ("all", "embed" if r.embed else "gen"):
                budget -= _take(r, min(args.chunk, r.todo, budget), used)
        i = 0
        while budget > 0:  # then new requests of the class in arrival order
            if i == len(queue):
                queue.append(next_req(cls))
            r = queue[i]
            if not r.embed and args.max_seqs and num_gen >= args.max_seqs:
                break
            if r.embed and atomic and r.todo > budget:
                if args.atomic_wait == "block":
                    break
                i += 1
                continue
            budget -= _take(r, r.todo if (r.embed and atomic) else min(args.chunk, r.todo, budget),
                            used)
            num_gen += not r.embed
            running.append(queue.pop(i))
    return used


def simulate(args, atomic: bool) -> dict:
    rng = random.Random(args.seed)
    running = []
    queues = {"all": []} if args.queues == "shared" else {"gen": [], "embed": []}
    totals = dict(fill=0.0, gen=0, embed=0, gen_tokens=0, embed_tokens=0)
    for step in range(args.warmup + args.steps):
        used = run_step(running, queues, args, atomic, lambda cls: new_request(rng, args, cls))
        done = [r for r in running if r.todo == 0 and r.decode == 0]
        running[:] = [r for r in running if r.todo > 0 or r.decode > 0]
        if step < args.warmup:
            continue
        totals["fill"] += (used["gen"] + used["embed"]) / args.budget
        totals["gen_tokens"] += used["gen"]
        totals["embed_tokens"] += used["embed"]
        totals["gen"] += sum(not r.embed for r in done)
        totals["embed"] += sum(r.embed for r in done)
    n = args.steps
    return {"budget_fill": totals["fill"] / n, "gen_throughput": totals["gen"] / n,
            "embed_throughput": totals["embed"] / n, "gen_tokens_per_step": totals["gen_tokens"] / n,
            "embed_tokens_per_step": totals["embed_tokens"] / n, "steps": n}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--gen-frac", type=float, default=0.8)
    p.add_argument("--embed-lengths", default="96,224", help="short,long")
    p.add_argument("--embed-long-frac", type=float, default=0.45)
    p.add_argument("--prefill", type=int, default=128)
    p.add_argument("--decode", type=int, default=256)
    p.add_argument("--decode-step", type=int, default=8)
    p.add_argument("--atomic-wait", choices=("block", "skip"), default="block")
    p.add_argument("--max-seqs", type=int, default=0, help="cap on running generation requests")
    p.add_argument("--queues", choices=("shared", "split"), default="shared",
                   help="shared: one arrival-ordered queue (FCFS); split: a generation queue "
                   "served first, then an embedding queue (needs --max-seqs)")
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    args.embed_lengths = tuple(int(x) for x in args.embed_lengths.split(","))
    if len(args.embed_lengths) != 2 or min(args.embed_lengths) < 1:
        p.error("--embed-lengths takes two positive lengths: short,long")
    if max(args.embed_lengths) > args.budget:
        p.error("an atomic embedding longer than --budget could never run")
    if args.queues == "split" and not args.max_seqs:
        p.error("--queues split needs --max-seqs: uncapped generation would take every step")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = {"atomic": simulate(args, atomic=True), "chunked": simulate(args, atomic=False)}
    mix = (f"{args.gen_frac:.0%} generation" if args.queues == "shared" else
           f"split queues, generation first, at most {args.max_seqs} running")
    print(f"budget {args.budget}, chunk {args.chunk}, {mix} "
          f"({args.prefill} prefill + {args.decode} decode at {args.decode_step}/step), "
          f"embeddings {args.embed_lengths} ({args.embed_long_frac:.0%} long), "
          f"atomic wait: {args.atomic_wait}, {args.steps} steps")
    print(f"{'':8s} {'budget fill':>11s} {'gen req/step':>12s} {'emb req/step':>12s} "
          f"{'gen tok/step':>12s} {'emb tok/step':>12s}")
    for name, r in results.items():
        print(f"{name:8s} {r['budget_fill']:11.1%} {r['gen_throughput']:12.4f} "
              f"{r['embed_throughput']:12.4f} {r['gen_tokens_per_step']:12.1f} "
              f"{r['embed_tokens_per_step']:12.1f}")
    a, c = results["atomic"], results["chunked"]
    print(f"chunked/atomic: fill x{c['budget_fill'] / a['budget_fill']:.2f}, generation "
          f"throughput {100 * (c['gen_throughput'] / a['gen_throughput'] - 1):+.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
