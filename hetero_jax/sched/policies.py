"""Scheduling policies: which request type gets the next chunk of a step.

The `Scheduler` (scheduler.py) owns the requests, the pages and the step; it reserves budget
for running decodes, keeps one arrival-ordered candidate stream per request type (running
requests with uncomputed input first, then the waiting queue) and handles preemption. A policy
answers only these questions, so all policies share that structure:

- `plans(pending, gens)`: which plans to try for this step, in order, until one schedules
  something. A `Plan` says whether running decodes run and which types may get chunks.
- `pick(heads, weights)`: at each selection, which type's head gets the next chunk. `heads`
  maps each type that can still be served this step to `(order_key, request)`; `weights` maps
  it to its uncomputed input tokens not yet scheduled. When the head cannot run after all
  (no pages or sequence slot, or it was preempted), the scheduler calls `undo(kind)`: the
  selection did not happen; a `strict` policy (one queue) then ends the step's chunks.
- `split(out)`: the built step, as it runs (every policy but the cost-aware IBS returns it).

Policies: `ibs` (the paper's Algorithm 2), `fcfs` (Unified-Hetero) and `homogeneous`
(Unified-Homo). `dedicated` is an engine mode (two engines), not a scheduling policy. With a
step-cost model (`SchedulerConfig.step_cost`: a plain `SchedulerOutput -> seconds` callable,
such as `sched.costmodel.StepCost`), `ibs` is `CostAwareIbsPolicy`: when the model says the
step's embedding items and generation items cost less as two steps than as one, one part
runs now and the other waits for the next step.
"""
from __future__ import annotations

import dataclasses

from hetero_jax.sched.output import SchedulerOutput
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

    def plans(self, pending: dict, gens: int) -> list:
        """`pending`: uncomputed input tokens per type; `gens`: generation requests holding
        a sequence slot (running: prefilling or decoding)."""
        return [HETERO]

    def pick(self, heads: dict, weights: dict) -> str:
        raise NotImplementedError

    def undo(self, kind: str) -> None:
        """The head of `kind` picked last could not run: that selection did not happen."""

    def chose(self, plan: Plan) -> None:
        """Told which plan produced the step."""

    def split(self, out: SchedulerOutput) -> SchedulerOutput:
        """The step to run, given the one built (items left out wait, admitted, for a later
        step)."""
        return out


class FcfsPolicy(Policy):
    """Unified-Hetero: one arrival-ordered queue of both types (the earliest head goes next)."""

    name = "fcfs"
    strict = True

    def pick(self, heads: dict, weights: dict) -> str:
        return min(heads, key=lambda kind: heads[kind][0])


class IbsPolicy(Policy):
    """The paper's Algorithm 2: types share the chunk budget in proportion to their backlog,
    led, while the decode batch is thin, by generation prefill.

    Credits persist across steps while both types have uncomputed input; when one type has
    none, both restart from zero and the other type takes every selection. A type whose head
    cannot run this step (pages, sequence slots) keeps its credit and yields the rest of the
    step to the other type; a selection with one type left leaves the credits alone.

    Thin batch (`thin_seqs` > 0, not in the paper): while fewer than `thin_seqs` generation
    requests hold a sequence slot, a generation head takes the selection whatever the
    credits, so decode chains (the critical path of a burst) start first. These selections
    leave the credits alone, and at most `max_lead` of them in a row pass over a live
    embedding head (the lead, restored by each embedding selection): an embedding waits at
    most Algorithm 2's bound plus `max_lead` selections.
    """

    name = "ibs"

    def __init__(self, thin_seqs: int = 0, max_lead: int = 4):
        assert thin_seqs >= 0 and max_lead >= 0, f"{thin_seqs=} and {max_lead=} must be >= 0"
        self.credits = Credits(REQUEST_KINDS)
        self.thin_seqs, self.max_lead = thin_seqs, max_lead
        self.lead = max_lead  # thin-batch selections left before an embedding is served
        self.led = False  # whether the last selection was a thin-batch one
        self._gens = 0  # generation requests holding a slot, counting this step's admissions
        self._contested = False
        self._undo: tuple = ()  # (lead, gens) before the last selection

    def plans(self, pending: dict, gens: int) -> list:
        if not all(pending[kind] > 0 for kind in REQUEST_KINDS):
            self.credits.reset()
        self._gens = gens
        return [HETERO]

    def pick(self, heads: dict, weights: dict) -> str:
        self._undo = (self.lead, self._gens)
        self.led = (GENERATE in heads and self._gens < self.thin_seqs
                    and (EMBED not in heads or self.lead > 0))
        self._contested = len(heads) > 1 and not self.led
        if self.led:
            kind = GENERATE
            self.lead -= EMBED in heads
        elif not self._contested:
            kind = next(iter(heads))
        else:
            kind = self.credits.pick({kind: weights[kind] for kind in heads})
        if kind == EMBED:
            self.lead = self.max_lead
        elif heads[GENERATE][0][0] == 1:  # a waiting request: admitted if it runs
            self._gens += 1
        return kind

    def undo(self, kind: str) -> None:
        self.lead, self._gens = self._undo
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

    def plans(self, pending: dict, gens: int) -> list:
        gen, emb = Plan(True, (GENERATE,)), Plan(False, (EMBED,))
        gen_work = pending[GENERATE] > 0 or gens > 0
        if pending[EMBED] > 0 and (self.last == GENERATE or not gen_work):
            return [emb, gen]
        return [gen, emb]

    def pick(self, heads: dict, weights: dict) -> str:
        (kind,) = heads
        return kind

    def chose(self, plan: Plan) -> None:
        self.last = plan.kinds[0]


def cheaper_split(out: SchedulerOutput, step_cost) -> dict | None:
    """{EMBED: embedding items, GENERATE: prefill and decode items} of `out`'s decoder step,
    each a `SchedulerOutput`, when `step_cost` (`SchedulerOutput -> seconds`) of the two is
    less than that of the mixed step; None when the step holds one type or mixing costs no
    more (a tie keeps the mixed step)."""
    parts = {EMBED: [it for it in out.items if it.kind == EMBED],
             GENERATE: [it for it in out.items if it.kind != EMBED]}
    if not all(parts.values()):
        return None
    parts = {kind: SchedulerOutput(items, []) for kind, items in parts.items()}
    two = sum(step_cost(part) for part in parts.values())
    return parts if two < step_cost(SchedulerOutput(out.items, [])) else None


class CostAwareIbsPolicy(IbsPolicy):
    """IBS that runs a mixed step as two when the step-cost model says two are cheaper.

    The step is built as IBS builds it. When `cheaper_split` finds the embedding part and the
    generation part (prefill chunks and decodes) cheaper apart, one part runs and the other
    waits, its requests admitted, for a later step. The part kept is the type the last split
    deferred (so the kept type alternates from split to split), else the type of the step's
    first selection (the one the credits favour), except that the embedding part runs where
    keeping the generation part would keep thin-batch selections whose lead only the deferred
    embedding selection restored (then more than `max_lead` of them would pass a live
    embedding in a row; the hypothesis test found it). The deferred type's selections did not
    happen: the credits go back to where they stood before its first selection of the step,
    as when IBS finds a type's head cannot run (it keeps its credit and the other type's later
    selections are uncontested). So IBS's bound on how long a backlogged type waits holds over
    the selections that ran; so does the thin-batch lead, restored with the credits.
    """

    def __init__(self, step_cost, thin_seqs: int = 0, max_lead: int = 4):
        super().__init__(thin_seqs, max_lead)
        self.step_cost = step_cost
        self.owed = None  # the type the last split deferred, until a step runs it
        self.splits = 0  # steps split so far
        # (type, (credits, lead) before it, whether it led over an embedding) per selection
        self._picks: list = []

    def plans(self, pending: dict, gens: int) -> list:
        self._picks = []
        return super().plans(pending, gens)

    def pick(self, heads: dict, weights: dict) -> str:
        before = dict(self.credits.acc), self.lead
        kind = super().pick(heads, weights)
        self._picks.append((kind, before, self.led and EMBED in heads))
        return kind

    def undo(self, kind: str) -> None:
        super().undo(kind)
        self._picks.pop()

    def split(self, out: SchedulerOutput) -> SchedulerOutput:
        parts = cheaper_split(out, self.step_cost)
        if parts is None:
            if self.owed in {EMBED if it.kind == EMBED else GENERATE for it in out.items}:
                self.owed = None
            return out
        keep = self.owed or self._picks[0][0]  # a mixed step holds an embedding selection
        replay = self._replay(EMBED if keep == GENERATE else GENERATE)
        if keep == GENERATE and replay is not None and replay[1] < 0:
            # the generation part led over an embedding on a lead that only the embedding
            # selection now deferred gave back: the embedding part runs instead
            keep, replay = EMBED, self._replay(GENERATE)
        self.owed = GENERATE if keep == EMBED else EMBED
        self.splits += 1
        if replay is not None:
            self.credits.acc, self.lead = replay
        return SchedulerOutput(parts[keep].items, out.preempted, out.encoder_items)

    def _replay(self, deferred: str) -> tuple | None:
        """(credits, lead) with `deferred`'s selections of this step taken back: as before
        its first one, then the lead replayed over the other type's later selections; None
        when it made none."""
        first = next((i for i, (kind, _, _) in enumerate(self._picks) if kind == deferred),
                     None)
        if first is None:
            return None
        acc, lead = self._picks[first][1]
        for kind, _, over in self._picks[first:]:
            if kind != deferred:
                lead = self.max_lead if kind == EMBED else lead - over
        return acc, lead


POLICIES = {p.name: p for p in (IbsPolicy, FcfsPolicy, HomogeneousPolicy)}
COST_AWARE_IBS = "ibs-cost"  # the sim's and the bench's name for ibs with a step-cost model


def make_policy(name: str, step_cost=None, thin_seqs: int = 0, max_lead: int = 4) -> Policy:
    """The policy `name`; with `step_cost` (`SchedulerOutput -> seconds`, ibs only) the
    cost-aware IBS; ibs leads with generation prefill while fewer than `thin_seqs`
    generation requests run, at most `max_lead` selections in a row over an embedding (0:
    Algorithm 2 as published)."""
    if name == "dedicated":
        raise ValueError("'dedicated' is an engine mode (one embedding and one generation "
                         "engine), not a scheduling policy: build it with "
                         "hetero_jax.make_engine(name, EngineConfig(scheduler='dedicated')) or "
                         "hetero_jax.dedicated.DedicatedEngine; scheduling policies: "
                         + ", ".join(POLICIES))
    if name not in POLICIES:
        raise ValueError(f"unknown scheduler policy {name!r}; expected one of {', '.join(POLICIES)}")
    if step_cost is not None and (name != IbsPolicy.name or not callable(step_cost)):
        raise ValueError(f"a step-cost model (a callable, got {type(step_cost).__name__}) is for "
                         f"the {IbsPolicy.name!r} policy only, not {name!r}")
    if name != IbsPolicy.name:
        return POLICIES[name]()
    if step_cost is None:
        return IbsPolicy(thin_seqs, max_lead)
    return CostAwareIbsPolicy(step_cost, thin_seqs, max_lead)
