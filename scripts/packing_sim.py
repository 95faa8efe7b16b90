r"""Budget packing with atomic vs chunked embeddings under FCFS (the paper's Table 8).

A step-level model, steps and no model (`--step-ms` only converts rates): an arrival-ordered
stream of requests, always backlogged (or arriving at fixed rates, below), `--gen-frac` of them
generation (`--prefill` prompt tokens, then `--decode` output tokens advanced `--decode-step`
tokens per step) and the rest embeddings (`--embed-lengths`, the longer one with probability
`--embed-long-frac`). Every step has `--budget` tokens and is built like the `fcfs` scheduler
builds it: running decodes first, then running chunks (prefill or embedding, at most `--chunk`
tokens each), then new requests in arrival order.
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

Arrivals. `--arrivals backlog` (the default) never runs dry: an empty queue takes the next
request of its stream. `--arrivals open` is an open loop: generation and embedding requests
arrive at `--gen-rate` and `--embed-rate` requests/s (`--step-ms` a step; `--process poisson`,
seeded, or `fixed` intervals), into the one queue in arrival order or each into its own; a
step admits only what has arrived. What the engine keeps up with then finishes at its arrival
rate, atomic or chunked, so generation throughput cannot move, and fill can differ only by
requests one mode never finishes: per step, `fill * budget = gen_throughput * (prefill +
decode) + embed_throughput * mean length of the embeddings finished`. With `--atomic-wait
skip`, an atomic embedding longer than the decodes ever leave (one of `--budget` tokens, while
a decode always runs) waits for ever; chunking serves those few requests and their many
tokens: the paper's Table 8 (docs/results.md: the command, and how its rates follow from the
table).

Prints and (with `--json PATH`) writes `{"atomic": {...}, "chunked": {...}}`, each with
`budget_fill` (mean fraction of the budget used per step), `gen_throughput` and
`embed_throughput` (finished requests per step; printed per second), and tokens per step of
each type; in the open loop also `gen_arrivals` and `embed_arrivals` (requests per step) and
`gen_waiting` and `embed_waiting` (queued at the end); steps before `--warmup` are left out.

    python scripts/packing_sim.py --budget 256 --chunk 64 --gen-frac 0.8 --json out.json
    python scripts/packing_sim.py --arrivals open --gen-rate 20 --embed-rate 10 \
        --embed-lengths 96,256 --atomic-wait skip
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
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


class OpenArrivals:
    """Requests arriving at fixed rates, per class its own stream of arrival times (in steps).

    `poisson`: exponential gaps of mean 1 / rate; `fixed`: gaps of exactly 1 / rate. `arrive`
    appends the requests arriving during a step to their queue, in arrival order.
    """

    def __init__(self, args):
        self.args, self.rng = args, random.Random(args.seed)
        per_step = args.step_ms / 1000
        self.rates = {c: r * per_step for c, r in (("gen", args.gen_rate),
                                                  ("embed", args.embed_rate)) if r > 0}
        self.next_t = {c: self._gap(c) for c in self.rates}

    def _gap(self, cls: str) -> float:
        rate = self.rates[cls]
        return self.rng.expovariate(rate) if self.args.process == "poisson" else 1 / rate

    def arrive(self, step: int, queues: dict) -> dict:
        """Appends the arrivals before `step + 1` to `queues`; returns their count per class."""
        events = []
        for cls in self.rates:
            while self.next_t[cls] < step + 1:
                events.append((self.next_t[cls], cls))
                self.next_t[cls] += self._gap(cls)
        for _, cls in sorted(events):
            queues["all" if "all" in queues else cls].append(new_request(self.rng, self.args, cls))
        return {cls: sum(c == cls for _, c in events) for cls in ("gen", "embed")}


def run_step(running: list, queues: dict, args, atomic: bool, next_req) -> dict:
    """One step: returns the tokens it scheduled per type; admits from `queues` in place.

    `queues` maps a class (`all`, or `gen` then `embed`) to its arrival-ordered queue; after
    the decodes, each class in turn gets its running chunks, then admits from its queue. A
    backlogged queue that runs dry takes `next_req(cls)`; an open-loop one (`next_req` None)
    ends the class's admissions.
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
                if next_req is None:
                    break
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
    """`args.warmup + args.steps` steps; the per-step means of the last `args.steps`."""
    rng = random.Random(args.seed)
    running = []
    queues = {"all": []} if args.queues == "shared" else {"gen": [], "embed": []}
    arrivals = OpenArrivals(args) if args.arrivals == "open" else None
    next_req = None if arrivals else (lambda cls: new_request(rng, args, cls))
    totals = dict(fill=0.0, gen=0, embed=0, gen_tokens=0, embed_tokens=0, gen_arrivals=0,
                  embed_arrivals=0)
    for step in range(args.warmup + args.steps):
        came = arrivals.arrive(step, queues) if arrivals else {"gen": 0, "embed": 0}
        used = run_step(running, queues, args, atomic, next_req)
        done = [r for r in running if r.todo == 0 and r.decode == 0]
        running[:] = [r for r in running if r.todo > 0 or r.decode > 0]
        if step < args.warmup:
            continue
        totals["fill"] += (used["gen"] + used["embed"]) / args.budget
        totals["gen_tokens"] += used["gen"]
        totals["embed_tokens"] += used["embed"]
        totals["gen"] += sum(not r.embed for r in done)
        totals["embed"] += sum(r.embed for r in done)
        totals["gen_arrivals"] += came["gen"]
        totals["embed_arrivals"] += came["embed"]
    n, waiting = args.steps, [r for q in queues.values() for r in q]
    out = {"budget_fill": totals["fill"] / n, "gen_throughput": totals["gen"] / n,
           "embed_throughput": totals["embed"] / n,
           "gen_tokens_per_step": totals["gen_tokens"] / n,
           "embed_tokens_per_step": totals["embed_tokens"] / n, "steps": n}
    if arrivals:
        out.update(gen_arrivals=totals["gen_arrivals"] / n,
                   embed_arrivals=totals["embed_arrivals"] / n,
                   gen_waiting=sum(not r.embed for r in waiting),
                   embed_waiting=sum(r.embed for r in waiting))
    return out


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
    p.add_argument("--arrivals", choices=("backlog", "open"), default="backlog",
                   help="backlog: always backlogged; open: --gen-rate and --embed-rate")
    p.add_argument("--gen-rate", type=float, help="open loop: generation requests/s")
    p.add_argument("--embed-rate", type=float, help="open loop: embedding requests/s")
    p.add_argument("--process", choices=("poisson", "fixed"), default="poisson",
                   help="open loop: Poisson or fixed-interval arrivals")
    p.add_argument("--step-ms", type=float, default=10.0,
                   help="step time: turns requests/s into requests per step and back")
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
    _check_rates(p, args)
    return args


def _check_rates(p, args) -> None:
    """The open loop's rates: finite, not negative, not both zero; a positive step time."""
    if not (math.isfinite(args.step_ms) and args.step_ms > 0):
        p.error(f"--step-ms must be a positive number of milliseconds, got {args.step_ms}")
    rates = {"--gen-rate": args.gen_rate, "--embed-rate": args.embed_rate}
    if args.arrivals == "backlog":
        given = [flag for flag, rate in rates.items() if rate is not None]
        if given:
            p.error(f"{given[0]} needs --arrivals open (a backlogged queue has no rate)")
        return
    for flag, rate in rates.items():
        if rate is None:
            p.error(f"--arrivals open needs {flag} (requests/s)")
        if not (math.isfinite(rate) and rate >= 0):
            p.error(f"{flag} must be a finite rate >= 0 requests/s, got {rate}")
    if args.gen_rate == args.embed_rate == 0:
        p.error("--gen-rate 0 and --embed-rate 0: no request would ever arrive")


def _change(c: dict, a: dict, key: str, ratio: bool = False) -> str:
    """Chunked's `key` against atomic's, as a ratio or in percent; `n/a` where atomic's is 0."""
    if not a[key]:
        return "n/a (atomic 0)"
    return f"x{c[key] / a[key]:.2f}" if ratio else f"{100 * (c[key] / a[key] - 1):+.1f}%"


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = {"atomic": simulate(args, atomic=True), "chunked": simulate(args, atomic=False)}
    mix = (f"{args.gen_frac:.0%} generation" if args.queues == "shared" else
           f"split queues, generation first, at most {args.max_seqs} running")
    if args.arrivals == "open":
        mix = (f"{args.process} arrivals, {args.gen_rate:g} generation + {args.embed_rate:g} "
               f"embedding requests/s at {args.step_ms:g} ms/step, "
               + ("one queue" if args.queues == "shared" else mix))
    print(f"budget {args.budget}, chunk {args.chunk}, {mix} "
          f"({args.prefill} prefill + {args.decode} decode at {args.decode_step}/step), "
          f"embeddings {args.embed_lengths} ({args.embed_long_frac:.0%} long), "
          f"atomic wait: {args.atomic_wait}, {args.steps} steps")
    print(f"{'':8s} {'budget fill':>11s} {'gen req/s':>10s} {'emb req/s':>10s} "
          f"{'gen tok/step':>12s} {'emb tok/step':>12s} {'emb waiting':>11s}")
    per_s = 1000 / args.step_ms
    for name, r in results.items():
        print(f"{name:8s} {r['budget_fill']:11.1%} {r['gen_throughput'] * per_s:10.2f} "
              f"{r['embed_throughput'] * per_s:10.2f} {r['gen_tokens_per_step']:12.1f} "
              f"{r['embed_tokens_per_step']:12.1f} {r.get('embed_waiting', '-'):>11}")
    a, c = results["atomic"], results["chunked"]
    print(f"chunked/atomic: fill {_change(c, a, 'budget_fill', ratio=True)}, generation throughput "
          f"{_change(c, a, 'gen_throughput')}, embedding {_change(c, a, 'embed_throughput')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
