"""The host-side scheduler: which tokens of which requests run in the next step.

Flow: the engine `add`s requests; each step it calls `schedule() -> SchedulerOutput` (plain
data: the step's items sorted by kind, embedding chunks, then prefill chunks, then decode
tokens), runs the model, and calls `update(scheduler_output, runner_output)`, which advances
the requests and returns the ones that finished. Imports no jax.

Every policy shares one step structure under a per-step token budget:
1. running decodes first (one token each; homogeneous embedding steps skip them);
2. then chunks of at most `chunk_size` from the candidate streams of the plan's request types
   (per type: running requests with uncomputed input in admission order, then the waiting
   queue in arrival order); the policy (policies.py) picks the type of each next chunk.
At most `max_chunk_seqs` multi-token items (embedding and prefill chunks) run per step.

Pages: an embedding request gets the pages of its whole input when it is admitted, so it never
waits for pages once running; it frees them as soon as its last chunk has run. A generation
request grows its pages chunk by chunk; when they run out, the newest running generation
request is preempted (pages freed, recomputed later from token 0, put back in the waiting queue
in arrival order), possibly the requester itself. Nothing is lost.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools

from hetero_jax.sched.output import (DECODE, EMBED, KIND_ORDER, PREFILL, RunnerOutput,
                                     SampledToken, ScheduledItem, SchedulerOutput)
from hetero_jax.sched.pages import PageAllocator
from hetero_jax.sched.policies import Plan, make_policy
from hetero_jax.sched.request import GENERATE, REQUEST_KINDS, Request, Status

__all__ = ["DECODE", "EMBED", "PREFILL", "RunnerOutput", "SampledToken", "ScheduledItem",
           "Scheduler", "SchedulerConfig", "SchedulerOutput"]

SCHEDULED, SKIPPED, BLOCKED = "scheduled", "skipped", "blocked"  # outcomes of one selection


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    token_budget: int = 256
    chunk_size: int = 64
    max_num_seqs: int = 32
    max_chunk_seqs: int = 4  # multi-token items per step (a static shape of the step)
    page_size: int = 16
    num_pages: int = 1024
    max_model_len: int = 2048
    policy: str = "fcfs"  # ibs | fcfs | homogeneous


@dataclasses.dataclass
class _Step:
    """The step being built: items so far and what is left of the per-step limits."""

    budget: int
    chunks_left: int
    items: dict = dataclasses.field(default_factory=dict)  # request_id -> ScheduledItem
    preempted: list = dataclasses.field(default_factory=list)

    @property
    def has_room(self) -> bool:
        return self.budget > 0 and self.chunks_left > 0

    def add(self, item: ScheduledItem) -> None:
        self.items[item.request.request_id] = item
        self.budget -= item.num_tokens
        self.chunks_left -= item.kind != DECODE

    def drop(self, request_id) -> None:
        item = self.items.pop(request_id, None)
        if item is not None:
            self.budget += item.num_tokens
            self.chunks_left += item.kind != DECODE


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.policy = make_policy(cfg.policy)
        self.pages = PageAllocator(cfg.num_pages)
        self.waiting = {kind: collections.deque() for kind in REQUEST_KINDS}  # arrival order
        self.running: list = []  # admission order; the newest generation one is preempted first
        self.requests: dict = {}  # request_id -> Request, until it finishes
        self.pending = dict.fromkeys(REQUEST_KINDS, 0)  # uncomputed input tokens per type
        self._arrival: dict = {}  # request_id -> arrival number
        self._admission: dict = {}  # request_id -> admission number
        self._counter = itertools.count()

    # -- interface ---------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        cfg, rid = self.cfg, request.request_id
        assert request.kind in REQUEST_KINDS, f"request {rid}: unknown kind {request.kind!r}"
        assert rid not in self.requests, f"request id {rid} is already queued"
        assert request.num_tokens > 0, f"request {rid} has no tokens"
        total = request.num_tokens
        if not request.is_embed:
            assert request.max_tokens >= 1, f"request {rid}: {request.max_tokens=} must be >= 1"
            total = min(total + request.max_tokens, cfg.max_model_len)
        assert request.num_tokens <= cfg.max_model_len, (
            f"request {rid} has {request.num_tokens} tokens > {cfg.max_model_len=}")
        need = -(-total // cfg.page_size)
        assert need < cfg.num_pages, (
            f"request {rid} needs {need} pages, the cache has {cfg.num_pages - 1}")
        request.status = Status.WAITING
        self.requests[rid] = request
        self._arrival[rid] = next(self._counter)
        self.waiting[request.kind].append(request)
        self.pending[request.kind] += request.num_pending

    def has_work(self) -> bool:
        return bool(self.running) or any(self.waiting.values())

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def abort(self, request_id) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
        else:
            self.waiting[req.kind].remove(req)
        self.pending[req.kind] -= req.num_pending
        self._finish(req, "abort")

    def schedule(self) -> SchedulerOutput:
        step = _Step(self.cfg.token_budget, self.cfg.max_chunk_seqs)
        decoding = any(r.is_decoding for r in self.running)
        for plan in self.policy.plans(dict(self.pending), decoding):
            self._run_plan(plan, step)
            if step.items:
                self.policy.chose(plan)
                break
        items = sorted(step.items.values(), key=lambda it: KIND_ORDER[it.kind])
        out = SchedulerOutput(items, step.preempted)
        self._check(out)
        return out

    def update(self, out: SchedulerOutput, runner_out: RunnerOutput) -> list:
        """Advance the scheduled requests; returns the requests that finished this step."""
        finished = []
        for item in out.items:
            req = item.request
            if req.status is not Status.RUNNING:
                continue  # aborted after it was scheduled
            assert item.start == req.num_computed_tokens, (
                f"request {req.request_id}: {item.start=} != {req.num_computed_tokens=}")
            before = req.num_pending
            req.num_computed_tokens = item.start + item.num_tokens
            reason = None
            if item.kind == EMBED:
                if item.ends:
                    req.embedding = runner_out.embeddings.get(req.request_id)
                    reason = "embedded"
            elif item.samples:
                reason = self._append(req, runner_out.sampled[req.request_id])
            self.pending[req.kind] += req.num_pending - before
            if reason:
                self.running.remove(req)
                self._finish(req, reason)
                finished.append(req)
        return finished

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
                weights[kind] -= step.items[req.request_id].num_tokens
            else:
                self.policy.undo(kind)
            if outcome == BLOCKED:
                if self.policy.strict:
                    return
                heads[kind] = None
            else:
                heads[kind] = next(streams[kind], None)

    def _schedule_decodes(self, step: _Step) -> None:
        for req in list(self.running):
            if step.budget <= 0:
                return
            if (req.status is Status.RUNNING and req.is_decoding
                    and req.request_id not in step.items and self._reserve(req, 1, step)):
                step.add(ScheduledItem(req, DECODE, req.num_computed_tokens, 1))

    def _candidates(self, kind: str, step: _Step):
        """(order key, request) of the requests of `kind` that may get a chunk, in order.

        The waiting head is yielded until it is admitted, so the caller stops at a BLOCKED one.
        """
        for req in list(self.running):
            if (req.kind == kind and req.status is Status.RUNNING and not req.is_decoding
                    and req.request_id not in step.items):
                yield (0, self._admission[req.request_id]), req
        queue = self.waiting[kind]
        while queue and not step.preempted:  # no admissions once this step has preempted
            yield (1, self._arrival[queue[0].request_id]), queue[0]

    def _try_chunk(self, req: Request, step: _Step) -> str:
        """Schedule the next chunk of `req`: SCHEDULED, SKIPPED (it was preempted) or BLOCKED."""
        n = min(req.num_remaining, self.cfg.chunk_size, step.budget)
        if req.status is Status.WAITING:
            if step.preempted or len(self.running) >= self.cfg.max_num_seqs:
                return BLOCKED
            if not self._grow_pages(req, req.num_tokens if req.is_embed else n):
                return BLOCKED
            assert self.waiting[req.kind].popleft() is req, f"request {req.request_id} not at head"
            req.status = Status.RUNNING
            self.running.append(req)
            self._admission[req.request_id] = next(self._counter)
        elif not self._reserve(req, n, step):
            return SKIPPED
        step.add(ScheduledItem(req, EMBED if req.is_embed else PREFILL, req.num_computed_tokens, n))
        return SCHEDULED

    def _check(self, out: SchedulerOutput) -> None:
        cfg, items = self.cfg, out.items
        assert out.num_tokens <= cfg.token_budget, f"{out.num_tokens=} > {cfg.token_budget=}"
        assert len(items) <= cfg.max_num_seqs, f"{len(items)=} > {cfg.max_num_seqs=}"
        chunks = sum(it.kind != DECODE for it in items)
        assert chunks <= cfg.max_chunk_seqs, f"{chunks=} > {cfg.max_chunk_seqs=}"
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
        req.pages, req.num_computed_tokens = [], 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.pending[req.kind] += req.num_pending - before
        queue, arrival = self.waiting[req.kind], self._arrival[req.request_id]
        pos = next((i for i, r in enumerate(queue) if self._arrival[r.request_id] > arrival),
                   len(queue))
        queue.insert(pos, req)

    def _append(self, req: Request, tok: SampledToken) -> str | None:
        req.output_token_ids.append(tok.token_id)
        req.output_logprobs.append(tok)
        if tok.token_id in req.stop_token_ids:
            return "stop"
        if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.cfg.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        self.pages.free(req.pages)
        req.pages = []
        req.status, req.finish_reason = Status.FINISHED, reason
        self.requests.pop(req.request_id, None)
        self._arrival.pop(req.request_id, None)
        self._admission.pop(req.request_id, None)
