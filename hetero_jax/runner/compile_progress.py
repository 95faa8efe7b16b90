"""Compiling made visible, and kept out of the progress bars' time per row.

In: each build of a new step variant (`ExecutableCache` calls its `on_build` hook before the
build), and the seconds an engine has spent compiling so far (`EngineStats.compile_s`, or an
executable cache's `seconds`). Out: one line per build on stderr, "compiling step variant k/N
(first run only; cached after)" (or "loading ... from the compile cache" for one the
persistent cache is known to hold), written through `tqdm.write` so a bar on screen stays whole
(`CompileNotice`); and tqdm bars whose elapsed time, rate and ETA leave those seconds out
(`BarClock`): a cold run's first rows no longer read as 33 s/row because 141 s of compiling
landed on them. Imports no jax.
"""
from __future__ import annotations

import sys
from collections.abc import Callable

NOTICE = "compiling step variant {k}/{n} (first run only; cached after)"
LOADING = "loading step variant {k}/{n} from the compile cache"


def to_stderr(line: str) -> None:
    """Write `line` on stderr above any tqdm bar there."""
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stderr)


class CompileNotice:
    """An `ExecutableCache.on_build` hook: numbers the builds it sees, k of N. N is every
    variant the engine's configuration allows (a run builds the ones its steps need, usually
    a few), or, after `expect(n)`, the n variants a warm-up is about to build."""

    def __init__(self, total: int, write: Callable[[str], None] = to_stderr):
        self.total, self.write = total, write
        self.shown = 0  # builds announced since the start or the last `expect`

    def expect(self, n: int) -> None:
        """Number the next n builds 1..n (a warm-up's)."""
        self.total, self.shown = n, 0

    def __call__(self, key: tuple, loading: bool = False) -> None:
        """Announce the build of `key`; `loading`: the persistent cache is known to hold it."""
        self.shown += 1
        self.write((LOADING if loading else NOTICE).format(k=self.shown,
                                                           n=max(self.total, self.shown)))


class BarClock:
    """Keeps compile seconds out of a tqdm `bar`: `update(n)` moves the bar's start (and its
    last print, from which tqdm's smoothed rate measures) later by the compile seconds
    `compile_s()` gained since the previous update, at most the time that passed (replicas
    compile side by side, and their seconds add up), then advances the bar by n.
    `serving_s()` is the time since the start less the seconds so moved."""

    def __init__(self, bar, compile_s: Callable[[], float], clock: Callable[[], float]):
        self.bar, self.compile_s, self.clock = bar, compile_s, clock
        self.start = self.last = clock()
        self.seen, self.left_out = compile_s(), 0.0

    def update(self, n: int) -> None:
        now, compiled = self.clock(), self.compile_s()
        shift = min(compiled - self.seen, now - self.last)
        self.seen, self.last, self.left_out = compiled, now, self.left_out + shift
        if shift > 0 and not self.bar.disable:  # a disabled bar keeps no times
            self.bar.start_t += shift
            self.bar.last_print_t += shift
        self.bar.update(n)

    def serving_s(self) -> float:
        return self.clock() - self.start - self.left_out
