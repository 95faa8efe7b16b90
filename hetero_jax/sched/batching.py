"""Batch-forming policies: which waiting generation request is admitted next, which running
decodes run (`SchedulerConfig(batching=...)`, independent of `policy=`, which still picks
embedding vs generation chunks).

In: the `Scheduler` tells a policy every change of its generation requests on the decoder
(`add`, `admitted`, `preempted`, `removed`) and every step (`begin_step`, `step_done` with the
step's output and measured time); it asks `order(queue)` for the waiting generation requests
in the order to try (lazily: each admission may re-rank the rest) and `decodes(reqs)` for the
running decodes of this step. Out: those orders and `stats()` (the arm and its mean reward).
Plain Python; imports no jax.

- `fcfs`: arrival order, every decode runs (the engine as it was).
- `lpm`: SGLang's longest prefix match: waiting requests by the length of their prompt's
  longest prefix held by a running request (a `RadixTree` over token ids), longest first,
  ties by arrival, matched once per step; arrival order past `LPM_FALLBACK` waiting.
- `feather`: the Chunked Hash Tree's ranking (`cht.py`): the request with the fewest chunks
  missing from the running batch first (re-ranked after each admission; arrival order while
  no waiting request shares a chunk with the batch). Past the batch's floor a request is
  admitted only while the prefix loss (the running batch's common chunks it would lose) stays
  within `loss_limit` and, while some waiting request shares with the batch and has not been
  offered this step, it shares too.
  The floor starts at `floor` and grows to the batch size with each admission that shares
  with the batch and loses nothing; at most `cap` generation requests run. Decodes: when the
  running batch has no common prefix, the largest group of decodes sharing a first chunk
  runs, topped up to the floor in admission order (with `homogeneous`, not topped up: every
  decode step holds one prefix group); the others wait with their pages (when no two decodes
  share a chunk, all run). Aging: a request that waited `aging_steps` steps for
  admission, or a decode that has not run for that long, goes first whatever the limits, so
  nothing starves.
- `feather-bandit`: `feather` whose (loss_limit, cap) arm a sliding-window UCB bandit
  (`bandit.py`) picks per round of `round_steps` steps. A round's reward is its tokens per
  second (every token its steps carried: decodes, prefill and embedding chunks; step times
  without compiling) over the tokens per second it would have made running, beside them,
  what its arm held back: the decodes it left waiting and the requests fcfs would have
  admitted, one token each, at the marginal cost of a token (the slope of the last 256 steps'
  times against their tokens). So a round that held nothing scores 1, and one that held
  something scores above 1 only where the smaller batch ran faster per token than the full
  one would have (a shared prefix's KV read once). Plain tokens per second could not see
  that cost: it falls on later rounds, whose batches the held requests stretch (4 groups in
  a 32-request burst: 222-234 steps against fcfs's 71, the held rounds scoring the same
  tokens/s as fcfs's). A round in which no arm could have decided anything (nothing waiting
  past the floor, the running batch one request or sharing one prefix, none over a cap)
  rewards nothing, and the window (64 rounds) forgets a load phase that is over. The bandit
  is conservative about the `any` arm at the largest cap (fcfs's batches): it plays first,
  and the others only within `margin` of its reward (`bandit.py`).
"""
from __future__ import annotations

import collections
import dataclasses

from hetero_jax.sched.bandit import (DEFAULT_ARMS, Arm, SlidingWindowUCB, held_back_efficiency,
                                     make_arms, marginal_cost)
from hetero_jax.sched.cht import ChunkedHashTree
from hetero_jax.sched.output import DECODE
from hetero_jax.sched.radix import LPM_FALLBACK, RadixTree

BATCHING = ("fcfs", "lpm", "feather", "feather-bandit")
STEP_MEMORY = 256  # feather-bandit: steps its fit of a token's marginal cost remembers


@dataclasses.dataclass(frozen=True)
class FeatherConfig:
    chunk_pages: int = 4  # KV pages per chunk of the hash tree (64 tokens at 16 per page)
    loss_limit: int | None = 2  # chunks of the common prefix an admission may lose (None: any)
    cap: int | None = None  # generation requests running at most (None: max_num_seqs)
    floor: int = 4  # batch size below which any request is admitted
    aging_steps: int = 1024  # waiting this many steps forces a request (or a decode) in
    arms: tuple = DEFAULT_ARMS  # feather-bandit: (loss_limit, cap) pairs
    window: int = 64  # feather-bandit: rounds the bandit remembers
    round_steps: int = 4  # feather-bandit: steps per round (one arm each)
    exploration: float = 1.0  # feather-bandit: the UCB constant c
    # feather-bandit: the share of the fcfs arm's (any loss, no cap) reward exploring may
    # cost (conservative UCB, `bandit.py`); None, or no such arm: plain UCB
    margin: float | None = 0.03
    # decodes: only the largest group sharing a first chunk runs (and aged ones), never
    # topped up to the floor, so every decode step is prefix-homogeneous (a fixed arm's choice)
    homogeneous: bool = False

    def __post_init__(self):
        for name, lo in (("chunk_pages", 1), ("floor", 1), ("aging_steps", 1), ("window", 1),
                         ("round_steps", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"{name}={value!r} must be an integer >= {lo}")
        if not isinstance(self.homogeneous, bool):
            raise ValueError(f"homogeneous={self.homogeneous!r} must be True or False")
        (arm,) = make_arms([(self.loss_limit, self.cap)])  # raises naming a bad value
        object.__setattr__(self, "arms", make_arms(self.arms))
        if len(self.arms) > self.window:
            raise ValueError(f"window={self.window} must hold every one of the "
                             f"{len(self.arms)} bandit arms")
        if not (isinstance(self.exploration, (int, float)) and 0 <= self.exploration < 1e9):
            raise ValueError(f"exploration={self.exploration!r} must be a number >= 0")
        if self.margin is not None and not (isinstance(self.margin, (int, float))
                                            and 0 <= self.margin < 1):
            raise ValueError(f"margin={self.margin!r} must be None or a number in [0, 1)")


class FcfsBatching:
    """Arrival order; every running decode runs."""

    name = "fcfs"

    def __init__(self, cfg=None):
        self.step = 0

    def add(self, req) -> None:
        """A new waiting generation request."""

    def admitted(self, req) -> None:
        """It joined the running batch."""

    def preempted(self, req) -> None:
        """It went back to the waiting queue (pages freed)."""

    def removed(self, req) -> None:
        """It finished or was aborted, waiting or running."""

    def begin_step(self) -> None:
        self.step += 1

    def order(self, queue):
        return iter(list(queue))

    def decodes(self, reqs: list) -> list:
        return reqs

    def step_done(self, out, step_time: float) -> None:
        """The step `out` ran in `step_time` seconds (0 when the runner did not time it)."""

    def stats(self) -> dict:
        return {"batching": self.name}


class LpmBatching(FcfsBatching):
    name = "lpm"

    def __init__(self, cfg=None):
        super().__init__(cfg)
        self.tree = RadixTree()
        self.arrival: dict = {}  # request_id -> arrival number
        self.running: set = set()  # request ids whose prompts the tree holds
        self._count = 0

    def add(self, req) -> None:
        self.arrival[req.request_id] = self._count
        self._count += 1

    def admitted(self, req) -> None:
        self.tree.insert(req.prompt_token_ids)
        self.running.add(req.request_id)

    def preempted(self, req) -> None:
        self.tree.remove(req.prompt_token_ids)
        self.running.discard(req.request_id)

    def removed(self, req) -> None:
        if req.request_id in self.running:
            self.preempted(req)
        self.arrival.pop(req.request_id, None)

    def order(self, queue):
        if len(queue) > LPM_FALLBACK:
            return iter(list(queue))
        match = {r.request_id: self.tree.match(r.prompt_token_ids) for r in queue}
        return iter(sorted(queue, key=lambda r: (-match[r.request_id],
                                                 self.arrival[r.request_id])))


class FeatherBatching(FcfsBatching):
    name = "feather"

    def __init__(self, cfg):
        super().__init__(cfg)
        f = cfg.feather
        self.cfg, self.max_seqs = f, cfg.max_num_seqs
        self.cht = ChunkedHashTree(cfg.page_size, f.chunk_pages)
        self.arm = Arm(f.loss_limit, f.cap)
        self.floor = f.floor
        self.since: dict = {}  # waiting request_id -> step it (re)entered the queue, in that order
        self.last_run: dict = {}  # running request_id -> step its last decode was scheduled
        self.refused = False  # whether this step's arm, not the engine's limits, held admissions

    @property
    def cap(self) -> int:
        return self.arm.cap or self.max_seqs

    def begin_step(self) -> None:
        super().begin_step()
        self.refused = False

    def add(self, req) -> None:
        self.cht.add(req)
        self.since[req.request_id] = self.step

    def admitted(self, req) -> None:
        self.cht.admit(req)
        self.since.pop(req.request_id, None)
        self.last_run[req.request_id] = self.step

    def preempted(self, req) -> None:
        self.cht.preempt(req)
        self.last_run.pop(req.request_id, None)
        self.since.pop(req.request_id, None)
        self.since[req.request_id] = self.step  # at the end: `since` stays in step order
        self._maybe_reset_floor()

    def removed(self, req) -> None:
        self.cht.remove(req)
        self.since.pop(req.request_id, None)
        self.last_run.pop(req.request_id, None)
        self._maybe_reset_floor()

    def _maybe_reset_floor(self) -> None:
        if not self.cht.running:
            self.floor = self.cfg.floor

    def _aged(self, rid, table: dict) -> bool:
        return self.step - table[rid] >= self.cfg.aging_steps

    def order(self, queue):
        aged = []  # the front of `since`, the longest waiting first
        for rid in self.since:
            if not self._aged(rid, self.since):
                break
            aged.append(self.cht.waiting[rid])
        yield from aged  # whatever the cap and the loss
        tried = {r.request_id for r in aged}
        ranked, arrival = self.cht.ranked(), iter(list(queue))
        while True:
            best = self.cht.find_best()  # re-ranked after each admission
            if best is None:
                return
            # the fewest missing chunks, or arrival order when nothing shares with the batch
            req = next((r for r in (ranked if best.held > 0 else arrival)
                        if r.request_id not in tried and r.request_id in self.cht.waiting), None)
            if req is None:
                return
            # a request that shares with the batch waits and this step has not tried it (one
            # tried stays waiting when the scheduler held it back, as for a prefix page still
            # in flight: it does not hold the others back too)
            sharer = best.held > 0 and best.request.request_id not in tried
            tried.add(req.request_id)
            n, d, limit = len(self.cht.running), self.cht.describe(req), self.arm.loss_limit
            if n >= self.cap or (n >= self.floor and limit is not None and (
                    d.loss > limit or d.held < sharer)):  # lose, or start a group
                self.refused = n < self.max_seqs  # the arm's limits, not the engine's, held it
                return  # while others share with the batch
            yield req
            if req.request_id in self.cht.running and d.held > 0 and d.loss == 0:
                self.floor = max(self.floor, min(len(self.cht.running), self.cap))

    def decodes(self, reqs: list) -> list:
        if self.arm.loss_limit is None or len(reqs) <= 1 or self.cht.tip:
            chosen = reqs  # no homogeneity asked, or the whole batch shares a prefix
        else:
            group = {}
            for r in reqs:
                keys = self.cht.keys.get(r.request_id)
                group.setdefault(keys[0] if keys else ("own", r.request_id), []).append(r)
            lead = max(group.values(), key=len)  # ties: the earliest admitted
            if len(lead) == 1:  # no two decodes share a chunk: nothing to gain by waiting
                lead = reqs
            ids = {r.request_id for r in lead}
            aged = [r for r in reqs
                    if r.request_id not in ids and self._aged(r.request_id, self.last_run)]
            ids.update(r.request_id for r in aged)
            rest = [r for r in reqs if r.request_id not in ids]
            top_up = 0 if self.cfg.homogeneous else max(self.floor - len(lead) - len(aged), 0)
            chosen = aged + lead + rest[:top_up]
        chosen = chosen[:max(self.cap, sum(self._aged(r.request_id, self.last_run)
                                           for r in chosen))]
        for r in chosen:
            self.last_run[r.request_id] = self.step
        return chosen

    def stats(self) -> dict:
        return {"batching": self.name, "arm": str(self.arm), "floor": self.floor}


class FeatherBanditBatching(FeatherBatching):
    name = "feather-bandit"

    def __init__(self, cfg):
        super().__init__(cfg)
        f = cfg.feather
        self.arms = f.arms
        fcfs = Arm(None, None)
        baseline = self.arms.index(fcfs) if f.margin is not None and fcfs in self.arms else None
        self.bandit = SlidingWindowUCB(len(self.arms), f.window, f.exploration, baseline,
                                       f.margin or 0.0)
        self.arm_index = self.bandit.choose()
        self.arm = self.arms[self.arm_index]
        self._tokens = self._time = 0.0
        self._steps = self._held = 0
        self._contested = False  # whether the round's arm could have decided anything
        self._recent = collections.deque(maxlen=STEP_MEMORY)  # (tokens, seconds) per step
        self._min_cap = min((a.cap for a in self.arms if a.cap is not None), default=None)

    def begin_step(self) -> None:
        super().begin_step()
        running, least = len(self.cht.running), min(self.floor, self._min_cap or self.floor)
        self._contested |= (bool(self.cht.waiting) and running >= least) or (
            running > 1 and not self.cht.tip) or (
            self._min_cap is not None and running > self._min_cap)  # below: all arms admit

    def decodes(self, reqs: list) -> list:
        chosen = super().decodes(reqs)
        self._held += len(reqs) - len(chosen)
        return chosen

    def step_done(self, out, step_time: float) -> None:
        if self.refused:  # the requests fcfs would have admitted, one decode token each later
            room = self.max_seqs - len(self.cht.running)
            self._held += max(min(len(self.cht.waiting), room), 0)
        tokens, seconds = sum(it.num_tokens for it in out.items), step_time or 1.0
        self._recent.append((tokens, seconds))
        self._tokens += tokens
        self._time += seconds
        self._steps += 1
        if self._steps < self.cfg.round_steps:
            return
        if self._contested and self._tokens + self._held > 0:  # else nothing to learn
            self.bandit.reward(self.arm_index, held_back_efficiency(
                self._tokens, self._time, self._held, marginal_cost(self._recent)))
            self.arm_index = self.bandit.choose()
            self.arm = self.arms[self.arm_index]
        self._tokens = self._time = 0.0
        self._steps, self._held, self._contested = 0, 0, False

    def stats(self) -> dict:
        counts, means, _ = self.bandit.stats()
        best = max(range(len(self.arms)), key=lambda a: (means[a], -a))
        return {"batching": self.name, "arm": str(self.arm), "rounds": self.bandit.t,
                "mean_reward": means[self.arm_index] if counts[self.arm_index] else None,
                "plays": counts[self.arm_index], "best_arm": str(self.arms[best]),
                "best_mean_reward": means[best], "floor": self.floor}


POLICIES = {p.name: p for p in (FcfsBatching, LpmBatching, FeatherBatching,
                                FeatherBanditBatching)}


def check_batching(name) -> str:
    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(f"batching={name!r} is not a batching policy; expected one of "
                         f"{', '.join(BATCHING)}")
    return name


def make_batching(cfg):
    """The batching policy of a `SchedulerConfig` (its `batching` and `feather` fields)."""
    return POLICIES[check_batching(cfg.batching)](cfg)
