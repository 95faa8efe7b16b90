"""The step-shape rule: how one step's sizes pad to the compiled buckets (plain Python, no jax).

In: the bucket lists of a resolved `EngineConfig` (`Buckets`) and a step's sizes (tokens,
sequences, multi-token items, pages per sequence, a cascade plan). Out: the variant key
`(T, S, Sc, pages_per_seq, second_pages)`. One rule, two readers: the runner packs a step under
the key of its items (`step_key`; `runner/batch.pack_batch` reads it off its arrays through
`key_of_step`) and `EngineConfig.variants()`
enumerates every key the rule can give (`Buckets.variants`), so warm-up compiles exactly the
reachable steps. `pad_to_bucket` is the one bucketing helper of the package.
"""
from __future__ import annotations

import dataclasses
import itertools

from hetero_jax.sched.output import DECODE


def pad_to_bucket(n: int, buckets: tuple) -> int:
    """Smallest bucket >= n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def powers_of_two(lo: int, hi: int, factor: int = 2) -> tuple:
    """lo, lo * factor, ... below hi, then hi."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= factor
    return tuple(out) + (hi,)


def default_seq_buckets(max_num_seqs: int) -> tuple:
    """The sequence buckets `EngineConfig` uses unless given: powers of two from
    min(8, max_num_seqs) up to max_num_seqs."""
    return powers_of_two(min(8, max_num_seqs), max_num_seqs)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The bucket lists of a resolved `EngineConfig` (each sorted, the last one the limit)."""

    tokens: tuple  # T
    seqs: tuple  # S
    pages: tuple  # pages_per_seq (and second_pages)
    chunk_seqs: tuple  # Sc

    def step(self, num_tokens: int, num_seqs: int, num_chunks: int) -> tuple:
        """(T, S, Sc) of a step of `num_seqs` sequences holding `num_tokens` tokens, of which
        `num_chunks` are multi-token items; the chunk group (the first Sc sequences) never
        outgrows the step."""
        s = pad_to_bucket(num_seqs, self.seqs)
        return (pad_to_bucket(num_tokens, self.tokens), s,
                min(pad_to_bucket(num_chunks, self.chunk_seqs), s))

    def variants(self, token_budget: int, chunk_size: int, max_num_seqs: int,
                 max_chunk_seqs: int, cascade: bool) -> list:
        """Every key `step_key` can give, and no other: a step holds d decode tokens and c
        chunks (0 <= c <= max_chunk_seqs, d + c <= max_num_seqs) of 1..chunk_size tokens each,
        at most token_budget in all. `second_pages` is the chunk group's page bucket in a step
        with chunks: the smallest bucket when all of them fit it (below pages_per_seq only
        with decodes past them), else pages_per_seq. With `cascade`, decode-only steps of at
        least two sequences add every (pages after the shared ones, shared pages) pair."""
        steps = set()  # (T, S, Sc, whether decodes may run past the chunk group)
        for c in range(min(max_chunk_seqs, max_num_seqs) + 1):
            for d in range(0 if c else 1, max_num_seqs - c + 1):
                lo, hi = d + c, min(token_budget, d + c * chunk_size)
                if lo > hi:
                    continue
                t_lo, s, sc = self.step(lo, d + c, c)
                t_hi = self.step(hi, d + c, c)[0]
                steps.update((t, s, sc, c > 0 and c + d > sc)
                             for t in self.tokens if t_lo <= t <= t_hi)
        low = self.pages[0]
        out = {(t, s, sc, p, 0 if sc == 0 else pc) for t, s, sc, beside in steps
               for p in self.pages for pc in {p, low if beside else p}}
        if cascade:
            decode_only = {self.step(n, n, 0)[:2]
                           for n in range(2, min(max_num_seqs, token_budget) + 1)}
            out.update((t, s, 0, p, ps) for t, s in decode_only
                       for p, ps in itertools.product(self.pages, self.pages))
        return sorted(out)


def step_key(items: list, buckets: Buckets, page_size: int, plan: tuple | None = None) -> tuple:
    """The variant (T, S, Sc, pages_per_seq, second_pages) that holds `items` (`ScheduledItem`s
    sorted by kind); with a cascade `plan` (`sched.tiles.plan_tiles`, decode-only steps) Sc is
    0, second_pages the tiles' shared page bucket and pages_per_seq the pages after them."""
    return key_of_step(sum(it.num_tokens for it in items), sum(it.kind != DECODE for it in items),
                       [-(-(it.start + it.num_tokens) // page_size) for it in items], buckets,
                       plan)


def key_of_step(tokens: int, chunks: int, pages, buckets: Buckets,
                plan: tuple | None = None) -> tuple:
    """`step_key` of a step of `tokens` tokens whose items (`chunks` multi-token ones first)
    reach `pages` KV pages each (a sequence of ints, one per item)."""
    t, s, sc = buckets.step(tokens, len(pages), chunks)
    if plan is not None:
        rest = max(n - off for n, off in zip(pages, plan[1]))
        shared = max(n for _, n in plan[0])
        return (t, s, 0, pad_to_bucket(rest, buckets.pages),
                pad_to_bucket(shared, buckets.pages))
    p, low = pad_to_bucket(max(pages), buckets.pages), buckets.pages[0]
    # the chunk group is the first Sc sequences: the chunks and any decodes padding it out
    return (t, s, sc, p, (low if max(pages[:sc]) <= low else p) if sc else 0)
