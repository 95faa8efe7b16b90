"""How sure the bench is: run order, bootstrap intervals over repeats, noise verdicts.

In: each contender's per-repeat numbers (requests/s of the runs, in round order). Out: the
order the runs go in (`run_order`: interleaved rounds, never one contender's repeats in a
block), a bootstrap confidence interval of a contender's mean (`bootstrap_interval`), one of
the ratio of two contenders' means resampled by round (`ratio_interval`: runs of one round
ran side by side, so a slow spell of the machine hits both and the pairing removes it), and
whether a difference lies inside that interval's noise (`inside_noise`). Plain Python with a
seeded `random.Random`, so the same runs always give the same interval; imports no jax.
"""
from __future__ import annotations

import random
import statistics

RESAMPLES = 2000
LEVEL = 0.95


def run_order(n: int, repeats: int) -> list:
    """Contender indices in run order: `repeats` rounds of every contender (interleaved, not
    AAA BBB), never one contender twice in a row. Two contenders alternate (ABAB); from three
    on, round r starts at contender r mod n (ABC BCA CAB), so no contender always runs first
    or always follows the same one."""
    shift = 1 if n > 2 else 0
    return [(shift * r + i) % n for r in range(repeats) for i in range(n)]


def _quantiles(values: list, level: float) -> tuple:
    ordered = sorted(values)
    tail = (1 - level) / 2
    lo = ordered[int(tail * (len(ordered) - 1))]
    hi = ordered[int(round((1 - tail) * (len(ordered) - 1)))]
    return lo, hi


def bootstrap_interval(values: list, level: float = LEVEL, resamples: int = RESAMPLES,
                       seed: int = 0) -> tuple | None:
    """(lo, hi): the percentile bootstrap interval of the mean of `values` (resampled with
    replacement); None with fewer than two values."""
    if len(values) < 2:
        return None
    rng = random.Random(seed)
    means = [statistics.fmean(rng.choices(values, k=len(values))) for _ in range(resamples)]
    return _quantiles(means, level)


def ratio_interval(a: list, b: list, level: float = LEVEL, resamples: int = RESAMPLES,
                   seed: int = 0) -> tuple | None:
    """(lo, hi): the bootstrap interval of mean(a) / mean(b), resampling rounds (a[i] and
    b[i] ran in round i); None with fewer than two rounds or a zero mean."""
    assert len(a) == len(b), f"{len(a)=} rounds against {len(b)=}"
    if len(a) < 2:
        return None
    rng, rounds = random.Random(seed), range(len(a))
    ratios = []
    for _ in range(resamples):
        pick = rng.choices(rounds, k=len(a))
        den = sum(b[i] for i in pick)
        if den <= 0:
            return None
        ratios.append(sum(a[i] for i in pick) / den)
    return _quantiles(ratios, level)


def inside_noise(interval: tuple | None) -> bool | None:
    """Whether a ratio's interval holds 1 (no difference the repeats can tell); None without
    an interval."""
    return None if interval is None else interval[0] <= 1.0 <= interval[1]


def rounds_within(a: list, b: list, tolerance: float) -> int:
    """Rounds in which a[i] / b[i] lies within 1 +- `tolerance` (an A/A run's check)."""
    return sum(abs(x / y - 1) <= tolerance for x, y in zip(a, b) if y > 0)
