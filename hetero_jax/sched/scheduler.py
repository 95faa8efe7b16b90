"""The host-side scheduler: which tokens of which requests run in the next step.

Flow: the engine `add`s requests; each step it calls `schedule() -> SchedulerOutput` (plain
data: the step's decoder items sorted by kind, embedding chunks, then prefill chunks, then
decode tokens, a separate encoder's whole inputs, and the cascade plan of the step's decodes
when `cfg.cascade` is set, `tiles.py`), runs the model, and calls
`update(scheduler_output, runner_output, now)`, which advances the requests, stamps their
first-output and finish times and returns the ones that finished (or, to schedule the next
step while this one runs, `advance` at once and `settle` on the results: advance.py).
Imports no jax.

Every policy shares one step structure under a per-step token budget:
1. running decodes first (one token each; homogeneous embedding steps skip them);
2. then chunks of at most `chunk_size` from the candidate streams of the plan's request types
   (per type: running requests with uncomputed input in admission order, then the waiting
   queue in arrival order); the policy (policies.py) picks the type of each next chunk;
3. the policy may run part of the step built and leave the rest, admitted, for the next
   (the cost-aware IBS, when `step_cost` says two steps cost less than the mixed one).
At most `max_chunk_seqs` multi-token items (embedding and prefill chunks) run per step.
The batching policy (`batching.py`, `cfg.batching`) orders the waiting generation requests
of step 2 and picks which running decodes of step 1 run (fcfs: arrival order, all of them;
lpm and feather: by shared prefix).

The scheduler owns every allocation. Pages: an embedding request gets the pages of its whole
input (and a pooler slot) when it is admitted, so it never waits for pages once running; it
frees both as soon as its last chunk has run. A generation request grows its pages chunk by
chunk; when they run out, the newest running generation request is preempted (pages freed,
recomputed later from token 0, put back in the waiting queue in arrival order), possibly the
requester itself. Nothing is lost. Callers read the pool through `cache_stats()` and clear
its prefix cache with `reset_prefix_cache()`, never through the pool itself.

With a separate encoder (`encoder_max_seqs > 0`) an embedding request needs no pages or slot:
it runs whole (a bidirectional encoder cannot be chunked) as one of at most `encoder_max_seqs`
encoder items, its tokens counted against the same budget, so the policy shares each step
between the two models. An input longer than the budget left may still run as the step's
first multi-token item (and then the only one), so that no input waits forever.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math

from hetero_jax.sched.advance import Ahead, advance, settle
from hetero_jax.sched.allocators import CacheStats, PagePool, SlotAllocator
from hetero_jax.sched.batching import FeatherConfig, make_batching
from hetero_jax.sched.output import (DECODE, EMBED, KIND_ORDER, PREFILL, RunnerOutput,
                                     ScheduledItem, SchedulerOutput)
from hetero_jax.sched.policies import Plan, make_policy
from hetero_jax.sched.prefix import PrefixCache
from hetero_jax.sched.request import GENERATE, REQUEST_KINDS, Request, Status
from hetero_jax.sched.tiles import CascadeSettings

SCHEDULED, SKIPPED, BLOCKED = "scheduled", "skipped", "blocked"  # outcomes of one selection


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    token_budget: int = 256
    chunk_size: int = 64
    max_num_seqs: int = 32  # also the number of pooler slots
    max_chunk_seqs: int = 4  # multi-token items per step (a static shape of the step)
    page_size: int = 16
    num_pages: int = 1024
    max_model_len: int = 2048
    policy: str = "fcfs"  # ibs | fcfs | homogeneous
    encoder_max_seqs: int = 0  # > 0: embeddings run whole on a separate encoder, this many a step
    prefix_caching: bool = False  # look up and register full pages (prefix.py)
    batching: str = "fcfs"  # fcfs | lpm | feather | feather-bandit: admissions, decodes
    feather: FeatherConfig = FeatherConfig()  # the knobs of feather and feather-bandit
    step_cost: object = None  # ibs: SchedulerOutput -> seconds; splits a step when two cost less
    cascade: CascadeSettings | None = None  # plan the decodes' cascade tiles (None: never)
    thin_batch: float = 0.5  # ibs: generation prefill first below this x max_num_seqs running


@dataclasses.dataclass
class _Entry:
    """One request's share of the step being built."""

    request: Request
    kind: str
    start: int
    num_tokens: int

    @property
    def multi(self) -> bool:
        return self.kind != DECODE


@dataclasses.dataclass
class _Step:
    """The step being built: entries so far and what is left of the per-step limits."""

    budget: int
    chunks_left: int
    encoder_left: int
    entries: dict = dataclasses.field(default_factory=dict)  # request_id -> _Entry
    preempted: list = dataclasses.field(default_factory=list)

    @property
    def has_room(self) -> bool:
        return self.budget > 0 and (self.chunks_left > 0 or self.encoder_left > 0)

    @property
    def has_multi(self) -> bool:
        return any(e.multi for e in self.entries.values())

    def add(self, entry: _Entry, on_encoder: bool = False) -> None:
        self.entries[entry.request.request_id] = entry
        self.budget -= entry.num_tokens
        if on_encoder:
            self.encoder_left -= 1
        else:
            self.chunks_left -= entry.multi

    def drop(self, request_id) -> None:
        entry = self.entries.pop(request_id, None)
        if entry is not None:  # only decoder entries of generation requests are dropped
            self.budget += entry.num_tokens
            self.chunks_left += entry.multi


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        assert 0 <= cfg.thin_batch <= 1, f"{cfg.thin_batch=} must be in [0, 1]"
        self.policy = make_policy(cfg.policy, cfg.step_cost,  # lead: one step's chunks
                                  math.ceil(cfg.thin_batch * cfg.max_num_seqs), cfg.max_chunk_seqs)
        self.batching = make_batching(cfg)  # batching.py: generation admissions and decodes
        self.pages = PagePool(cfg.num_pages, cfg.prefix_caching)
        self.prefix = PrefixCache(self.pages, cfg.page_size)
        self.slots = SlotAllocator(cfg.max_num_seqs)
        self.waiting = {kind: collections.deque() for kind in REQUEST_KINDS}  # arrival order
        self.running: list = []  # admission order; the newest generation one is preempted first
        self.requests: dict = {}  # request_id -> Request, until it finishes
        self.pending = dict.fromkeys(REQUEST_KINDS, 0)  # uncomputed input tokens per type
        self._arrival: dict = {}  # request_id -> arrival number
        self._admission: dict = {}  # request_id -> admission number
        self._counter = itertools.count()

    @property
    def on_encoder(self) -> bool:
        """Whether embedding requests run on a separate encoder."""
        return self.cfg.encoder_max_seqs > 0

    # -- interface ---------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request; raises ValueError (not an assert: it holds under `python -O`)
        when it could never run under this configuration."""
        rid = request.request_id
        problem = None
        if request.kind not in REQUEST_KINDS:
            problem = f"unknown kind {request.kind!r}"
        elif rid in self.requests:
            problem = "is already queued"
        elif request.num_tokens == 0:
            problem = "has no tokens"
        elif not (request.is_embed and self.on_encoder):
            problem = self._decoder_problem(request)
        if problem:
            raise ValueError(f"request {rid} {problem}")
        request.status = Status.WAITING
        self.requests[rid] = request
        self._arrival[rid] = next(self._counter)
        self.waiting[request.kind].append(request)
        self.pending[request.kind] += request.num_pending
        if request.kind == GENERATE:
            self.batching.add(request)

    def _decoder_problem(self, request: Request) -> str | None:
        cfg, total = self.cfg, request.num_tokens
        if not request.is_embed:
            if request.max_tokens < 1:
                return f"has max_tokens={request.max_tokens} < 1"
            total = min(total + request.max_tokens, cfg.max_model_len)
        if request.num_tokens > cfg.max_model_len:
            return f"has {request.num_tokens} tokens > max_model_len={cfg.max_model_len}"
        need = -(-total // cfg.page_size)
        if need >= cfg.num_pages:
            return f"needs {need} KV pages, the cache has {cfg.num_pages - 1}"
        return None

    def has_work(self) -> bool:
        return bool(self.running) or any(self.waiting.values())

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def cache_stats(self) -> CacheStats:
        """The KV page pool's free pages and prefix-cache counters, as a snapshot."""
        return self.pages.stats()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; running requests keep their pages (`PagePool.reset`)."""
        self.pages.reset()

    def abort(self, request_id, reason: str = "abort") -> None:
        """Drop a request wherever it is (it finishes with `reason`); its pages and pooler
        slot go back at once."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if req.status is Status.WAITING:
            self.waiting[req.kind].remove(req)
        self.pending[req.kind] -= req.num_pending
        self._finish(req, reason)

    def schedule(self) -> SchedulerOutput:
        cfg = self.cfg
        step = _Step(cfg.token_budget, cfg.max_chunk_seqs, cfg.encoder_max_seqs)
        self.batching.begin_step()
        gens = sum(r.kind == GENERATE for r in self.running)
        for plan in self.policy.plans(dict(self.pending), gens):
            self._run_plan(plan, step)
            if step.entries:
                self.policy.chose(plan)
                break
        entries = sorted(step.entries.values(), key=lambda e: KIND_ORDER[e.kind])
        decoder, encoder = [], []
        for e in entries:
            (encoder if e.request.is_embed and self.on_encoder else decoder).append(
                self._snapshot(e))
        out = self.policy.split(SchedulerOutput(decoder, step.preempted, encoder))
        if self.cfg.cascade is not None:
            out.cascade = self.cfg.cascade.plan(out.items, cfg.page_size)
        self._check(out)
        return out

    def update(self, out: SchedulerOutput, runner_out: RunnerOutput,
               now: float | None = None) -> list:
        """Advance the scheduled requests; stamp the time `now` of their first output and
        finish; returns the requests that finished this step (`advance` then `settle`)."""
        return settle(self, advance(self, out), runner_out, now)

    def advance(self, out: SchedulerOutput) -> Ahead:
        """The first half of `update`, before the step's results (`advance.py`)."""
        return advance(self, out)

    def settle(self, ahead: Ahead, runner_out: RunnerOutput, now: float | None = None) -> list:
        """The second half of `update`, on the step's results (`advance.py`)."""
        return settle(self, ahead, runner_out, now)

    # -- one step ----------------------------------------------------------------------------
    def _run_plan(self, plan: Plan, step: _Step) -> None:
        if plan.decodes:
            self._schedule_decodes(step)
        streams = {kind: self._candidates(kind, step) for kind in plan.kinds}
        heads = {kind: next(stream, None) for kind, stream in streams.items()}
        weights = {kind: self.pending[kind] for kind in plan.kinds}
        while step.has_room:
            live = {kind: head for kind, head in heads.items() if head is not None}
            if not live:
                return
            kind = self.policy.pick(live, weights)
            req = live[kind][1]
            outcome = self._try_chunk(req, step)
            if outcome == SCHEDULED:
                weights[kind] -= step.entries[req.request_id].num_tokens
            else:
                self.policy.undo(kind)
            if outcome == BLOCKED:
                if self.policy.strict:
                    return
                heads[kind] = None
            else:
                heads[kind] = next(streams[kind], None)

    def _schedule_decodes(self, step: _Step) -> None:
        decoding = [r for r in self.running if r.is_decoding and r.request_id not in step.entries]
        room = self.cfg.page_size  # a decode needs a new page only where its last one is full
        for req in self.batching.decodes(decoding):  # batching.py: which of them run
            if step.budget <= 0:
                return
            if req.status is Status.RUNNING and (req.num_computed_tokens < len(req.pages) * room
                                                 or self._reserve(req, 1, step)):
                step.entries[req.request_id] = _Entry(req, DECODE, req.num_computed_tokens, 1)
                step.budget -= 1  # `step.add` of a one-token item, spelt out: once per decode

    def _candidates(self, kind: str, step: _Step):
        """(order key, request) of the requests of `kind` that may get a chunk, in order:
        running ones, then the waiting queue (the caller stops at a BLOCKED one; one held back
        for an in-flight prefix page is SKIPPED)."""
        for req in list(self.running):  # the step's decodes are in step.entries already
            if (req.kind == kind and req.request_id not in step.entries
                    and req.status is Status.RUNNING and not req.is_decoding):
                yield (0, self._admission[req.request_id]), req
        queue = self.waiting[kind]
        for req in self.batching.order(queue) if kind == GENERATE else list(queue):
            if step.preempted:  # no admissions once this step has preempted
                return
            yield (1, self._arrival[req.request_id]), req

    def _try_chunk(self, req: Request, step: _Step) -> str:
        """Schedule the next chunk of `req`: SCHEDULED, SKIPPED (it was preempted) or BLOCKED."""
        if req.is_embed and self.on_encoder:
            return self._try_encoder(req, step)
        if step.chunks_left <= 0:
            return BLOCKED
        if req.status is Status.WAITING:
            if step.preempted or len(self.running) >= self.cfg.max_num_seqs:
                return BLOCKED
            outcome = self._admit_with_pages(req, step)
            if outcome != SCHEDULED:
                return outcome
        elif not self._reserve(req, min(req.num_remaining, self.cfg.chunk_size, step.budget),
                               step):
            return SKIPPED
        n = min(req.num_remaining, self.cfg.chunk_size, step.budget)
        step.add(_Entry(req, EMBED if req.is_embed else PREFILL, req.num_computed_tokens, n))
        return SCHEDULED

    def _admit_with_pages(self, req: Request, step: _Step) -> str:
        """Admit a waiting request onto the decoder: its cached prefix (a hit takes a reference
        on each page), fresh pages for its first chunk (an embedding: its whole input) and, for
        an embedding, a pooler slot. Nothing changes when it cannot be admitted."""
        hit = self.prefix.lookup(req)
        if hit is None:
            return SKIPPED  # its next page is in flight: admitted once that is registered
        cached = len(hit) * self.cfg.page_size
        n = min(req.num_tokens - cached, self.cfg.chunk_size, step.budget)
        need = -(-(req.num_tokens if req.is_embed else cached + n) // self.cfg.page_size)
        if not self.pages.can_take(hit, need - len(hit)):
            return BLOCKED
        self.pages.touch(hit)
        req.pages = hit + self.pages.allocate(need - len(hit))
        if req.is_embed:
            req.pool_slot = self.slots.allocate()
            assert req.pool_slot is not None, "no pooler slot with a sequence slot free"
        before = req.num_pending
        req.num_computed_tokens = cached
        self.pending[req.kind] += req.num_pending - before
        self.prefix.admitted(req, hit)
        self._admit(req)
        return SCHEDULED

    def _try_encoder(self, req: Request, step: _Step) -> str:
        """A whole input on the separate encoder, if it fits the budget left (or nothing
        multi-token is in the step yet) and an encoder row is free."""
        n = req.num_tokens
        if step.encoder_left <= 0 or (n > step.budget and step.has_multi):
            return BLOCKED
        self._admit(req, holds_a_sequence=False)
        step.add(_Entry(req, EMBED, 0, n), on_encoder=True)
        return SCHEDULED

    def _admit(self, req: Request, holds_a_sequence: bool = True) -> None:
        """Waiting head -> RUNNING; on the decoder it joins `running` (a sequence slot)."""
        self.waiting[req.kind].remove(req)
        req.status = Status.RUNNING
        if holds_a_sequence:
            self.running.append(req)
        if req.kind == GENERATE:
            self.batching.admitted(req)
        self._admission[req.request_id] = next(self._counter)

    @staticmethod
    def _snapshot(e: _Entry) -> ScheduledItem:
        req, outs = e.request, e.request.output_token_ids
        end = e.start + e.num_tokens
        # a decode's one token is the request's last, which it sampled (positional: this runs
        # once per item per step)
        ids = (outs[-1],) if e.kind == DECODE else tuple(req.token_ids(e.start, e.num_tokens))
        return ScheduledItem(req.request_id, e.kind, e.start, e.num_tokens,
                             end == len(req.prompt_token_ids) + len(outs), ids, tuple(req.pages),
                             req.knobs, len(outs), req.pool_slot, req.num_cached_tokens)

    def _check(self, out: SchedulerOutput) -> None:
        cfg, items = self.cfg, out.items
        assert out.decoder_tokens <= cfg.token_budget, f"{out.decoder_tokens=} > {cfg.token_budget=}"
        if out.num_tokens > cfg.token_budget:  # one oversize encoder input, alone
            assert len(out.encoder_items) == 1 and all(it.kind == DECODE for it in items), (
                f"{out.num_tokens=} > {cfg.token_budget=} beyond one lone encoder input")
        assert len(items) <= cfg.max_num_seqs, f"{len(items)=} > {cfg.max_num_seqs=}"
        chunks = sum(it.kind != DECODE for it in items)
        assert chunks <= cfg.max_chunk_seqs, f"{chunks=} > {cfg.max_chunk_seqs=}"
        assert len(out.encoder_items) <= cfg.encoder_max_seqs, f"{len(out.encoder_items)=}"
        assert all(it.num_tokens >= 1 for it in items), "an item has no tokens"

    # -- pages and request state -------------------------------------------------------------
    def _reserve(self, req: Request, n: int, step: _Step) -> bool:
        """Pages for n more tokens of a running request, preempting the newest ones if needed."""
        while not self._grow_pages(req, req.num_computed_tokens + n):
            victim = next(r for r in reversed(self.running) if r.kind == GENERATE)
            self._preempt(victim, step)
            if victim is req:
                return False
        return True

    def _grow_pages(self, req: Request, num_tokens: int) -> bool:
        need = -(-num_tokens // self.cfg.page_size) - len(req.pages)
        if need <= 0:
            return True
        new = self.pages.allocate(need)
        if new is None:
            return False
        req.pages.extend(new)
        return True

    def _preempt(self, req: Request, step: _Step) -> None:
        step.drop(req.request_id)
        step.preempted.append(req.request_id)
        before = req.num_pending
        self.running.remove(req)
        self.pages.free(req.pages)
        self.prefix.released(req)
        self.batching.preempted(req)
        req.pages, req.num_computed_tokens = [], 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.pending[req.kind] += req.num_pending - before
        queue, arrival = self.waiting[req.kind], self._arrival[req.request_id]
        pos = next((i for i, r in enumerate(queue) if self._arrival[r.request_id] > arrival),
                   len(queue))
        queue.insert(pos, req)

    def _finish(self, req: Request, reason: str) -> None:
        """Free what the request holds and forget it."""
        if req.kind == GENERATE:
            self.batching.removed(req)
        if req in self.running:
            self.running.remove(req)
        self.pages.free(req.pages)
        self.prefix.released(req)
        req.pages = []
        if req.pool_slot is not None:
            self.slots.free(req.pool_slot)
            req.pool_slot = None
        req.status, req.finish_reason = Status.FINISHED, reason
        self.requests.pop(req.request_id, None)
        self._arrival.pop(req.request_id, None)
        self._admission.pop(req.request_id, None)
