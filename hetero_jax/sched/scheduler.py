"""The host-side scheduler: which tokens of which requests run in the next step.

Flow: the engine `add`s requests; each step it calls `schedule() -> SchedulerOutput` (plain
data: the step's items sorted by kind, prefill chunks before decode tokens), runs the model,
and calls `update(scheduler_output, runner_output)`, which advances the requests and returns
the ones that finished. Imports no jax.

Policy `fcfs`: continuous batching with chunked prefill under a per-step token budget. Running
decodes are served first (one token each); the remaining budget goes to prefill chunks of at
most `chunk_size` in arrival order. When KV pages run out, the newest running request is
preempted (its pages freed, recomputed later from token 0); nothing is dropped.
"""
from __future__ import annotations

import collections
import dataclasses

from hetero_jax.sched.pages import PageAllocator
from hetero_jax.sched.request import Request, Status

PREFILL, DECODE = "prefill", "decode"
KIND_ORDER = {PREFILL: 0, DECODE: 1}


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    token_budget: int = 256
    chunk_size: int = 64
    max_num_seqs: int = 32
    max_chunk_seqs: int = 4  # multi-token items per step (a static shape of the step)
    page_size: int = 16
    num_pages: int = 1024
    max_model_len: int = 2048
    policy: str = "fcfs"


@dataclasses.dataclass(frozen=True)
class ScheduledItem:
    request: Request
    kind: str  # PREFILL | DECODE
    start: int  # first token position of this item
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this item ends at the request's last token, so a new token is sampled."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclasses.dataclass
class SchedulerOutput:
    items: list  # [ScheduledItem], sorted by kind
    preempted: list  # request ids preempted while scheduling this step

    @property
    def num_tokens(self) -> int:
        return sum(it.num_tokens for it in self.items)


@dataclasses.dataclass
class SampledToken:
    token_id: int
    logprob: float
    top_token_ids: tuple = ()
    top_logprobs: tuple = ()


@dataclasses.dataclass
class RunnerOutput:
    sampled: dict  # request_id -> SampledToken, for every item that samples
    step_time: float = 0.0


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        assert cfg.policy == "fcfs", f"unknown scheduler policy {cfg.policy!r}"
        self.cfg = cfg
        self.pages = PageAllocator(cfg.num_pages)
        self.waiting: collections.deque = collections.deque()
        self.running: list = []  # admission order; the last one is preempted first
        self.requests: dict = {}

    # -- interface ---------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        need = -(-min(request.num_tokens + request.max_tokens, self.cfg.max_model_len)
                 // self.cfg.page_size)
        assert need < self.cfg.num_pages, (
            f"request {request.request_id} needs {need} pages, the cache has {self.cfg.num_pages - 1}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "abort")

    def schedule(self) -> SchedulerOutput:
        budget = self.cfg.token_budget
        items, preempted = [], []
        for req in list(self.running):
            if req.is_decoding and req in self.running and budget > 0:
                if self._reserve(req, 1, preempted):
                    items.append(ScheduledItem(req, DECODE, req.num_computed_tokens, 1))
                    budget -= 1
        chunks = 0
        for req in list(self.running):
            if (not req.is_decoding and req in self.running and budget > 0
                    and chunks < self.cfg.max_chunk_seqs):
                n = min(req.num_remaining, self.cfg.chunk_size, budget)
                if self._reserve(req, n, preempted):
                    items.append(ScheduledItem(req, PREFILL, req.num_computed_tokens, n))
                    budget -= n
                    chunks += 1
        while (self.waiting and budget > 0 and chunks < self.cfg.max_chunk_seqs
               and len(self.running) < self.cfg.max_num_seqs):
            item = self._admit(self.waiting[0], budget)
            if item is None:
                break
            req = self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            items.append(item)
            budget -= item.num_tokens
            chunks += 1
        items.sort(key=lambda it: KIND_ORDER[it.kind])
        out = SchedulerOutput(items, preempted)
        assert out.num_tokens <= self.cfg.token_budget, f"{out.num_tokens=} > {self.cfg.token_budget=}"
        assert len(items) <= self.cfg.max_num_seqs, f"{len(items)=} > {self.cfg.max_num_seqs=}"
        return out

    def update(self, out: SchedulerOutput, runner_out: RunnerOutput) -> list:
        """Advance the scheduled requests; returns the requests that finished this step."""
        finished = []
        for item in out.items:
            req = item.request
            if req.status is not Status.RUNNING:
                continue  # aborted meanwhile
            req.num_computed_tokens = item.start + item.num_tokens
            if item.samples:
                reason = self._append(req, runner_out.sampled[req.request_id])
                if reason:
                    self.running.remove(req)
                    self._finish(req, reason)
                    finished.append(req)
        return finished

    # -- helpers -----------------------------------------------------------------------------
    def _admit(self, req: Request, budget: int) -> ScheduledItem | None:
        """A first chunk for a waiting request, or None when its pages are not free."""
        n = min(req.num_remaining, self.cfg.chunk_size, budget)
        if not self._grow_pages(req, req.num_computed_tokens + n):
            return None
        return ScheduledItem(req, PREFILL, req.num_computed_tokens, n)

    def _reserve(self, req: Request, n: int, preempted: list) -> bool:
        """Pages for n more tokens of a running request, preempting the newest ones if needed."""
        while not self._grow_pages(req, req.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
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

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pages.free(req.pages)
        req.pages, req.num_computed_tokens = [], 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

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
