"""Batching policies on a burst with nothing to share, run the way a user tries an engine.

Issue 31's done-when: "a run tried as a user would (small preset, 32 unique 300-token prompts
at once, 48 greedy tokens each, best of two runs after a short warm-up) gave the bandit 0.75x
FCFS". One engine per `--batching` policy (the defaults otherwise: prefix caching and cascade
on), one warm-up `generate` each on other prompts of the same shapes, then `--runs` rounds in
which every engine runs `generate` on the same 32 fresh prompts in turn (the order rotates);
prints each policy's best and median wall seconds and its best against the first policy's.

    python scripts/bench_user_burst.py --batching fcfs,feather-bandit --runs 2
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import time

from hetero_jax import Engine, EngineConfig, SamplingParams


def prompts(rng: random.Random, n: int, length: int) -> list:
    """`n` prompts of `length` random letters and spaces (the small preset's byte tokenizer:
    `length` tokens each): no two share a first KV page, so nothing is shared."""
    return ["".join(rng.choices(string.ascii_lowercase + " ", k=length)) for _ in range(n)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batching", default="fcfs,feather-bandit")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    policies = args.batching.split(",")
    engines = {p: Engine.from_preset(args.preset, seed=0, config=EngineConfig(batching=p))
               for p in policies}
    for engine in engines.values():  # warm-up: compile this burst's shapes
        engine.generate(prompts(rng, args.prompts, args.prompt_len), params, use_tqdm=False)
    walls: dict = {p: [] for p in policies}
    tokens: dict = {p: [] for p in policies}
    for run in range(args.runs):
        batch = prompts(rng, args.prompts, args.prompt_len)
        for p in policies[run % len(policies):] + policies[:run % len(policies)]:
            t0 = time.perf_counter()
            out = engines[p].generate(batch, params, use_tqdm=False)
            walls[p].append(time.perf_counter() - t0)
            tokens[p].append([o.token_ids for o in out])
    first = policies[0]
    result = {p: dict(best_s=min(w), median_s=statistics.median(w), walls=w,
                      x_first=min(walls[first]) / min(w),
                      same_tokens=tokens[p] == tokens[first])
              for p, w in walls.items()}
    for p, r in result.items():
        print(f"{p:>16}: best {r['best_s']:.2f} s, median {r['median_s']:.2f} s of "
              f"{args.runs}; {r['x_first']:.2f}x {first} (best against best); same tokens "
              f"as {first}: {r['same_tokens']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
