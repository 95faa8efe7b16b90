"""The bench's statistics (bench/stats.py, jax-free): run order by counting, bootstrap
intervals and noise verdicts on injected values, and the rows they reach (no wall clock)."""
import itertools

import pytest

from hetero_jax.bench.cli import add_ratios, median_run
from hetero_jax.bench.stats import (bootstrap_interval, inside_noise, ratio_interval,
                                    rounds_within, run_order)


@pytest.mark.parametrize("n,repeats", [(1, 1), (2, 5), (3, 3), (5, 4)])
def test_runs_are_interleaved_rounds_not_blocks(n, repeats):
    order = run_order(n, repeats)
    assert sorted(order) == sorted(list(range(n)) * repeats)
    rounds = [order[r * n:(r + 1) * n] for r in range(repeats)]
    assert all(sorted(rnd) == list(range(n)) for rnd in rounds), "a round misses a contender"
    assert [rnd[0] for rnd in rounds] == [r % n if n > 2 else 0 for r in range(repeats)]
    if n > 1:  # never one contender twice in a row (no blocks)
        assert all(a != b for a, b in itertools.pairwise(order))
    assert run_order(2, 3) == [0, 1, 0, 1, 0, 1]  # ABAB


def test_bootstrap_interval_of_the_mean():
    assert bootstrap_interval([5.0]) is None
    assert bootstrap_interval([2.0, 2.0, 2.0]) == (2.0, 2.0)
    lo, hi = bootstrap_interval([1.0, 2.0, 3.0, 4.0])
    assert 1.0 <= lo < 2.5 < hi <= 4.0  # around the mean, inside the range
    assert bootstrap_interval([1.0, 2.0, 3.0, 4.0]) == (lo, hi), "not reproducible"
    wide = bootstrap_interval([1.0, 2.0, 3.0, 4.0], level=0.99)
    assert wide[0] <= lo and hi <= wide[1]


def test_ratio_interval_pairs_the_rounds():
    """A slow round slows both contenders: paired by round the ratio stays 1.1 exactly."""
    base = [10.0, 5.0, 10.0, 6.0]  # rounds 2 and 4 on a busy machine
    assert ratio_interval([1.1 * x for x in base], base) == pytest.approx((1.1, 1.1))
    assert inside_noise(ratio_interval(base, base)) is True
    assert inside_noise(ratio_interval([1.1 * x for x in base], base)) is False
    noisy = ratio_interval([10.0, 12.0, 9.0, 11.0], [11.0, 10.0, 10.0, 10.5])
    assert noisy[0] < 1.0 < noisy[1] and inside_noise(noisy)
    assert ratio_interval([1.0], [1.0]) is None and inside_noise(None) is None
    with pytest.raises(AssertionError):
        ratio_interval([1.0, 2.0], [1.0])


def test_rounds_within_counts_an_aa_runs_agreement():
    assert rounds_within([1.0, 1.02, 1.05, 0.96], [1.0, 1.0, 1.0, 1.0], 0.03) == 2


def test_rows_carry_the_interval_and_the_noise_verdict():
    runs = {"ibs": [10.0, 8.0, 10.0], "fcfs": [11.0, 8.8, 11.0], "homogeneous": [10.1, 7.9, 9.9]}
    rows = [dict(median_run([dict(requests_per_s=v, requests=10, requests_per_cpu_s=v / 2)
                             for v in vs]), scheduler=name, ratio="9:1")
            for name, vs in runs.items()]
    assert rows[0]["requests_per_s_runs"] == [10.0, 8.0, 10.0], "runs not in round order"
    assert rows[0]["requests_per_cpu_s_runs"] == [5.0, 4.0, 5.0]
    assert rows[0]["requests_per_s_ci"][0] <= 28 / 3 <= rows[0]["requests_per_s_ci"][1]
    add_ratios(rows)
    by = {r["scheduler"]: r for r in rows}
    assert "vs_ibs_ci" not in by["ibs"]
    assert by["fcfs"]["vs_ibs_ci"] == pytest.approx((1.1, 1.1))
    assert by["fcfs"]["noise"] == "outside" and by["homogeneous"]["noise"] == "inside"
    assert by["homogeneous"]["rounds_within_3pct"] == 3
    add_ratios(rows, "fcfs")  # an A/A run compares with its first contender
    assert by["ibs"]["vs_ibs_ci"] == pytest.approx((1 / 1.1, 1 / 1.1))
