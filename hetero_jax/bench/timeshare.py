"""Time slices: the in-process contenders' closed loops served at once, one engine at a time.

Whole runs interleaved (ABAB) leave the host's speed free to move between one run and the
next: on this 2-core host one contender's runs spread 1.25-1.44 requests/s at identical
steps, and an A/A round's ratio had an sd of 5.8%. With `--slice-s S` a round runs every
contender's closed loop together over one event loop, and a `TimeShare` lets one engine step
at a time, in turns of about S seconds: the step that begins past S is the last of the turn
and drains (`Engine.step(drain=True)`: nothing of it is left on the device), then the next
engine that has work takes its turn. A slow spell of the machine then falls on every
contender within a few turns. Each contender is timed on its own clock, the sum of its turns
(`own_time` maps a wall time onto it): its requests/s, latencies and CPU seconds leave the
others' turns out. A paused closed loop is frozen, not drained: its requests wait, neither
served nor timed, until its next turn.

What it costs a contender: one step a turn runs without the host overlap (one in 4-8 at
half-second turns on the small preset, whose steps take 65-140 ms), and its own client
coroutines may run on the event loop in another's turn (they submit the next request when one
ends). A contender whose engine has no work passes its turn on at once.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time


class TimeShare:
    """Turns of about `slice_s` seconds of the machine for named engines (`engine(name, e)`
    wraps one so that it steps only in its turns); `clock` and `cpu` are injectable clocks."""

    def __init__(self, slice_s: float, clock=time.perf_counter, cpu=time.process_time):
        self.slice_s = slice_s
        self._clock, self._cpu = clock, cpu
        self._cond = threading.Condition()
        self._holder = None  # whose turn it is (None: nobody's, the next to step takes it)
        self._waiting: list = []  # names that asked for a turn, in order
        self._start: dict = {}  # name -> (wall, cpu) at the start of its open turn
        self.turns = collections.defaultdict(list)  # name -> [(start, end)] of closed turns
        self.cpu_s = collections.defaultdict(float)  # name -> process CPU seconds in its turns
        # name -> (variants, seconds) its steps compiled: engines that share one executable
        # cache (`bench.cli.share_compiled_steps`) all count every compile in their stats
        self.compiled = collections.defaultdict(lambda: (0, 0.0))

    @property
    def waiting(self) -> tuple:
        """The names waiting for a turn, in the order they asked."""
        with self._cond:
            return tuple(self._waiting)

    def engine(self, name: str, engine) -> "SharedEngine":
        return SharedEngine(self, name, engine)

    def step(self, name: str, engine):
        """One step of `engine` in `name`'s turn (waits for it); the turn ends after a step
        begun past `slice_s` (drained) or one that leaves the engine idle. What the step
        compiled (`engine.stats`, which a step brings up to date) is `name`'s."""
        self._acquire(name)
        engine.count_compiles()  # up to date with a cache other engines compiled into
        compiles, seconds = engine.stats.compiles, engine.stats.compile_s
        try:
            drain = self._clock() - self._start[name][0] >= self.slice_s
            out = engine.step(drain=drain)
        except BaseException:
            self._release(name)
            raise
        n, s = self.compiled[name]  # the step brought its stats up to date
        self.compiled[name] = (n + engine.stats.compiles - compiles,
                               s + engine.stats.compile_s - seconds)
        if drain or not engine.has_work():
            self._release(name)
        return out

    def own_time(self, name: str, t: float) -> float:
        """Seconds of `name`'s turns before wall time `t`: its own clock."""
        turns = self.turns[name] + ([(self._start[name][0], float("inf"))]
                                    if name in self._start else [])
        return sum(max(0.0, min(end, t) - start) for start, end in turns)

    def _acquire(self, name: str) -> None:
        with self._cond:
            if name in self._start:  # its turn goes on
                return
            while self._holder not in (None, name):
                if name not in self._waiting:
                    self._waiting.append(name)
                self._cond.wait()
            if name in self._waiting:
                self._waiting.remove(name)
            self._holder = name
            self._start[name] = (self._clock(), self._cpu())

    def _release(self, name: str) -> None:
        """End `name`'s turn; the first one waiting has the next."""
        with self._cond:
            wall0, cpu0 = self._start.pop(name)
            self.turns[name].append((wall0, self._clock()))
            self.cpu_s[name] += self._cpu() - cpu0
            self._holder = self._waiting.pop(0) if self._waiting else None
            self._cond.notify_all()


class SharedEngine:
    """An engine that steps only in its turns of a `TimeShare`; all else is the engine's."""

    def __init__(self, share: TimeShare, name: str, engine):
        self._share, self._name, self._engine = share, name, engine

    def step(self):
        return self._share.step(self._name, self._engine)

    def __getattr__(self, attr):
        return getattr(self._engine, attr)


def on_own_clock(share: TimeShare, name: str, records: list) -> list:
    """`bench.loop.Record`s with their times on `name`'s own clock."""
    def own(t):
        return None if t is None else share.own_time(name, t)
    return [dataclasses.replace(r, submit=own(r.submit), done=own(r.done),
                                first_token=own(r.first_token)) for r in records]
