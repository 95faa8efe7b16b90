"""Scheduling policies: which request type gets the next chunk of a step.

The `Scheduler` (scheduler.py) owns the requests, the pages and the step; it reserves budget
for running decodes, keeps one arrival-ordered candidate stream per request type (running
requests with uncomputed input first, then the waiting queue) and handles preemption. A policy
answers only two questions, so all policies share that structure:

- `plans(pending, decoding)`: which plans to try for this step, in order, until one schedules
  something. A `Plan` says whether running decodes run and which types may get chunks.
- `pick(heads, weights)`: at each selection, which type's head gets the next chunk. `heads`
  maps each type that can still be served this step to `(order_key, request)`; `weights` maps
  it to its uncomputed input tokens not yet scheduled. When the head cannot run after all
  (no pages or sequence slot, or it was preempted), the scheduler calls `undo(kind)`: the
  selection did not happen; a `strict` policy (one queue) then ends the step's chunks.

Policies: `ibs` (the paper's Algorithm 2), `fcfs` (Unified-Hetero) and `homogeneous`
(Unified-Homo). `dedicated` is an engine mode (two engines), not a scheduling policy.
"""
from __future__ import annotations

import dataclasses

from hetero_jax.sched.request import EMBED, GENERATE, REQUEST_KINDS


@dataclasses.dataclass(frozen=True)
class Plan:
    decodes: bool  # reserve budget for running decodes first
    kinds: tuple  # request types that may get chunks


HETERO = Plan(decodes=True, kinds=REQUEST_KINDS)


class Credits:
    """Persistent credits (smooth weighted round robin) over the types of `kinds`.

    Each `pick(weights)` adds every weight to its accumulator, picks the largest (ties go to
    the earlier type in `kinds`) and subtracts the sum of the weights from it. With fixed
    weights the count of picks of a type after k picks stays within one of k * w / sum(w).
    """

    def __init__(self, kinds: tuple = REQUEST_KINDS):
        self.kinds = kinds
        self.acc = dict.fromkeys(kinds, 0)
        self._before = dict(self.acc)

    def reset(self) -> None:
        self.acc = dict.fromkeys(self.kinds, 0)

    def undo(self) -> None:
        """Forget the last pick (its selection could not be served)."""
        self.acc = dict(self._before)

    def pick(self, weights: dict) -> str:
        assert all(w > 0 for w in weights.values()), f"{weights=} must be positive"
        self._before = dict(self.acc)
        for kind, w in weights.items():
            self.acc[kind] += w
        best = max(weights, key=lambda k: (self.acc[k], -self.kinds.index(k)))
        self.acc[best] -= sum(weights.values())
        return best


class Policy:
    """Heterogeneous steps; per-type arrival order; the base for every policy."""

    name = ""
    strict = False  # True: one queue; a head that cannot be admitted ends the step's chunks

    def plans(self, pending: dict, decoding: bool) -> list:
        return [HETERO]

    def pick(self, heads: dict, weights: dict) -> str:
        raise NotImplementedError

    def undo(self, kind: str) -> None:
        """The head of `kind` picked last could not run: that selection did not happen."""

    def chose(self, plan: Plan) -> None:
        """Told which plan produced the step."""


class FcfsPolicy(Policy):
    """Unified-Hetero: one arrival-ordered queue of both types (the earliest head goes next)."""

    name = "fcfs"
    strict = True

    def pick(self, heads: dict, weights: dict) -> str:
        return min(heads, key=lambda kind: heads[kind][0])


class IbsPolicy(Policy):
    """The paper's Algorithm 2: types share the chunk budget in proportion to their backlog.

    Credits persist across steps while both types have uncomputed input; when one type has
    none, both restart from zero and the other type takes every selection. A type whose head
    cannot run this step (pages, sequence slots) keeps its credit and yields the rest of the
    step to the other type; a selection with one type left leaves the credits alone.
    """

    name = "ibs"

    def __init__(self):
        self.credits = Credits(REQUEST_KINDS)
        self._contested = False

    def plans(self, pending: dict, decoding: bool) -> list:
        if not all(pending[kind] > 0 for kind in REQUEST_KINDS):
            self.credits.reset()
        return [HETERO]

    def pick(self, heads: dict, weights: dict) -> str:
        self._contested = len(heads) > 1
        if not self._contested:
            return next(iter(heads))
        return self.credits.pick({kind: weights[kind] for kind in heads})

    def undo(self, kind: str) -> None:
        if self._contested:
            self.credits.undo()


class HomogeneousPolicy(Policy):
    """Unified-Homo: a step holds one type, alternating while both have work.

    A generation step runs decodes and generation prefill chunks; an embedding step runs
    embedding chunks only. If the preferred step schedules nothing, the other type runs.
    """

    name = "homogeneous"

    def __init__(self):
        self.last = EMBED

    def plans(self, pending: dict, decoding: bool) -> list:
        gen, emb = Plan(True, (GENERATE,)), Plan(False, (EMBED,))
        gen_work = pending[GENERATE] > 0 or decoding
        if pending[EMBED] > 0 and (self.last == GENERATE or not gen_work):
            return [emb, gen]
        return [gen, emb]

    def pick(self, heads: dict, weights: dict) -> str:
        (kind,) = heads
        return kind

    def chose(self, plan: Plan) -> None:
        self.last = plan.kinds[0]


POLICIES = {p.name: p for p in (IbsPolicy, FcfsPolicy, HomogeneousPolicy)}


def make_policy(name: str) -> Policy:
    if name == "dedicated":
        raise ValueError("'dedicated' is an engine mode (one embedding and one generation "
                         "engine), not a scheduling policy: build it with "
                         "hetero_jax.make_engine(name, EngineConfig(scheduler='dedicated')) or "
                         "hetero_jax.dedicated.DedicatedEngine; scheduling policies: "
                         + ", ".join(POLICIES))
    if name not in POLICIES:
        raise ValueError(f"unknown scheduler policy {name!r}; expected one of {', '.join(POLICIES)}")
    return POLICIES[name]()
