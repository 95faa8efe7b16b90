"""A sliding-window UCB bandit over batch-forming arms (Feather's `feather-bandit`).

In: `choose()` at the start of each round returns an arm index; `reward(arm, value)` at its
end reports what the round measured (any value >= 0; feather-bandit's is
`held_back_efficiency`, its tokens per second over what it would have made holding nothing
back, with `marginal_cost` the seconds a token adds to a step). Out: the arm to play.
Plain Python; imports no jax.

Only the last `window` rounds count (SW-UCB, Garivier and Moulines 2011), so the bandit
follows a workload that changes. Rewards are normalised by the pooled standard deviation of
the rewards within each arm in the window (the noise of one round's measurement, floored at
1% of the best mean), which makes it the UCB of Gaussian rewards of unit variance: an
exploration constant of about 1 is right whatever the units (tokens/s on a CPU or a GPU). An
arm not played within the window is played first (in arm order), so each arm is tried at
least once per window; otherwise the arm with the largest `mean / sd + c * sqrt(2 ln(min(t,
window)) / n)` (ties: the earlier arm).

Conservative (Wu et al. 2016, "Conservative Bandits"), when given a `baseline` arm (feather-
bandit's `any` loss at the largest cap: fcfs): the baseline is played first, and another arm
only while the window's rewards plus that arm's lower confidence bound (0 for an arm not
played in the window) stay at least `1 - margin` of what the baseline's mean would have
earned over those rounds and this one; else the baseline plays. Exploring then costs about
`margin` of the baseline's measured reward (on synthetic rewards where the baseline is best:
1.6-1.8% against plain UCB's 4.2-4.5%); it bounds only what the reward can see.
"""
from __future__ import annotations

import collections
import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Arm:
    """A batch-forming arm: admit while the prefix loss stays within `loss_limit` chunks
    (None: any loss, no homogeneity asked), at most `cap` generation requests running
    (None: up to max_num_seqs)."""

    loss_limit: int | None
    cap: int | None

    def __str__(self) -> str:
        return (f"loss<={'any' if self.loss_limit is None else self.loss_limit},"
                f"cap={'max' if self.cap is None else self.cap}")


# Loss limits only: in the simulator (H200 roofline, llama-3-8b) no cap arm
# (8, 16 running) was ever the best, and exploring them cost 3-13% of fcfs's throughput on
# short runs; give them with FeatherConfig(arms=...) or `hetero-jax bench --arms`.
DEFAULT_ARMS = tuple(Arm(loss, None) for loss in (0, 2, None))


def make_arms(pairs) -> tuple:
    """(loss_limit, cap) pairs (or `Arm`s) -> a tuple of `Arm`s; ValueError naming a bad one."""
    if isinstance(pairs, (str, bytes)):
        raise ValueError(f"bandit arms {pairs!r} must be (loss_limit, cap) pairs, not a string")
    arms = []
    for pair in pairs:
        try:
            loss, cap = (pair.loss_limit, pair.cap) if isinstance(pair, Arm) else pair
        except (TypeError, ValueError):
            raise ValueError(f"bad bandit arm {pair!r}: expected (loss_limit, cap)") from None
        for name, value, lo in (("loss_limit", loss, 0), ("cap", cap, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < lo):
                raise ValueError(f"bad bandit arm {pair!r}: {name}={value!r} must be None or "
                                 f"an integer >= {lo}")
        arms.append(Arm(loss, cap))
    if not arms:
        raise ValueError("the bandit has no arms: give at least one (loss_limit, cap) pair")
    if len(set(arms)) != len(arms):
        raise ValueError(f"bandit arms {pairs!r} repeat an arm")
    return tuple(arms)


class SlidingWindowUCB:
    def __init__(self, num_arms: int, window: int = 64, c: float = 1.0,
                 baseline: int | None = None, margin: float = 0.03):
        if num_arms < 1:
            raise ValueError(f"num_arms={num_arms}: the bandit has no arms")
        if window < num_arms:
            raise ValueError(f"window={window} must hold every one of the {num_arms} arms")
        if baseline is not None and not 0 <= baseline < num_arms:
            raise ValueError(f"baseline={baseline} is not an arm index in [0, {num_arms})")
        if not 0 <= margin < 1:
            raise ValueError(f"margin={margin!r} must be in [0, 1)")
        self.num_arms, self.window, self.c = num_arms, window, c
        self.baseline, self.margin = baseline, margin
        self.history: collections.deque = collections.deque(maxlen=window)  # (arm, raw)
        self.t = 0
        self.last: int | None = None

    def choose(self) -> int:
        counts, means, sd = self.stats()
        log_t = math.log(max(min(self.t, self.window), 1))
        unplayed = [a for a in range(self.num_arms) if counts[a] == 0]
        if self.baseline in unplayed:
            arm = self.baseline
        elif unplayed:
            arm = unplayed[0]
        else:
            arm = max(range(self.num_arms), key=lambda a: (
                means[a] / sd + self.c * math.sqrt(2 * log_t / counts[a]), -a))
        if self.baseline is not None and arm != self.baseline:
            lower = max(means[arm] - self.c * sd * math.sqrt(2 * log_t / counts[arm]), 0.0) \
                if counts[arm] else 0.0
            earned = sum(value for _, value in self.history) + lower
            if earned < (1 - self.margin) * (len(self.history) + 1) * means[self.baseline]:
                arm = self.baseline
        self.last = arm
        return arm

    def reward(self, arm: int, value: float) -> None:
        assert 0 <= arm < self.num_arms, f"{arm=} outside [0, {self.num_arms})"
        assert value >= 0 and math.isfinite(value), f"{value=} must be finite and >= 0"
        self.history.append((arm, value))
        self.t += 1

    def stats(self) -> tuple:
        """(plays per arm, mean raw reward per arm (0 where unplayed), the pooled within-arm
        standard deviation) over the window."""
        counts, sums, squares = [0] * self.num_arms, [0.0] * self.num_arms, [0.0] * self.num_arms
        for arm, value in self.history:
            counts[arm] += 1
            sums[arm] += value
            squares[arm] += value * value
        means = [s / n if n else 0.0 for s, n in zip(sums, counts)]
        top = max(means, default=0.0) or 1.0
        spread = sum(q - n * m * m for q, n, m in zip(squares, counts, means))
        dof = sum(counts) - sum(n > 0 for n in counts)
        sd = math.sqrt(max(spread, 0.0) / dof) if dof > 0 else top
        return counts, means, max(sd, 0.01 * top)


def marginal_cost(samples) -> float:
    """Seconds one more token adds to a step: the least-squares slope of (tokens, seconds)
    over `samples`, within [0, the mean seconds per token]; 0 while the tokens never vary."""
    n = len(samples)
    if n < 2:
        return 0.0
    mean_t = sum(t for t, _ in samples) / n
    mean_s = sum(s for _, s in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    if var <= 0 or mean_t <= 0:
        return 0.0
    slope = sum((t - mean_t) * (s - mean_s) for t, s in samples) / var
    return min(max(slope, 0.0), mean_s / mean_t)


def held_back_efficiency(tokens: float, seconds: float, held: int, per_token: float) -> float:
    """A round's tokens per second over what it would have made running the `held` decodes it
    held back too (each costing `per_token` seconds more): 1 when it held nothing; above 1
    only where the smaller batch was faster per token than the full one would have been."""
    return (tokens / seconds) * (seconds + per_token * held) / (tokens + held)
