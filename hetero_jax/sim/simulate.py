"""Discrete-event simulation of the host scheduler against a cost model instead of a model.

In: a `SimConfig` (scheduler config and policy, workload, replicas) and a cost model. Events
(arrivals, step completions) run in time order on one heap; once every event due at a time
has run, each idle replica with work starts a step: `schedule()`, whose duration the cost
model gives. An arrival goes where `sched.router` sends it (`SimConfig.router`: least
remaining tokens, uncomputed input plus outputs still to generate, by default; or prefix
affinity over the digests of its prompt's full pages, bounded by that load) among the
replicas that serve its type: every replica, or with `embed_replicas = k > 0` the dedicated
split, k replicas for embeddings and the rest for generation (the paper's static split over
disjoint devices). At a step's end a fake runner
samples token 7 for every sampling item (sims never stop early: generation runs to its
`max_tokens`) and `update()` advances the requests. In a closed loop a client submits its next
request when its last one finishes; with `SimConfig.async_scheduling` that request first
reaches a step after the next one, as in the engine, which scheduled its next step while this
one ran. Out: a `SimResult` with throughput per
type, p50/p99 latency and TTFT, average budget fill, the embedding share of the scheduled
tokens and the prefix cache's hit rate.

Prefix caching (`SchedulerConfig.prefix_caching`) is the scheduler's own: every request
carries the workload's token ids and one chain seed, so a request hits the pages of another
exactly where their tokens agree. A hit moves the request's first scheduled token past its
cached pages, so the cost model, which sees only scheduled items, charges nothing for cached
tokens' FLOPs and weights, and still charges the attention reads over them (an item's context
is its start plus its tokens). With `SimConfig.cascade` a decode-only step whose sequences
share cached pages reads them once per tile, as the engine's cascade attention does
(`sched/tiles.py`); the result counts the KV tokens read, the steps that used cascade, the
mean decode batch and the share of decode steps whose sequences all start on one KV page
(one prefix group: `homogeneous_decode_share`), and what the same steps would cost had their
attention read no KV at all (`kv_free_s`: the floor under any sharing of KV reads, cascade's
included). The fake runner reports the cost model's step time, so the `feather-bandit`
batching policy learns from simulated tokens per second. Imports no jax.

Locality (`SimConfig.l2_kv_tokens` > 0; off by default): the paper's mechanism for a plain
kernel, a batch whose sequences share a prefix keeping that prefix's KV in the GPU's L2. What
it assumes: a step's attention reads each layer's KV in one pass; the first read of a page
comes from HBM; a later read of a page that another sequence of the step read too comes from
L2 with probability min(1, L2's KV share / the layer's pages read more than once), so a
shared prefix hits while the step's shared prefixes fit, and pages read once only stream
through (no kernel order or eviction by them is modelled). Those reads count as saved, like
cascade's, so `kv_read_tokens` is then what HBM served (`served_by_l2`).
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools

from hetero_jax.sched import (DECODE, EMBED, GENERATE, Request, RunnerOutput, SampledToken,
                              Scheduler, SchedulerConfig)
from hetero_jax.sched.costmodel import StepShape
from hetero_jax.sched.hashing import chain_seed, extend_hashes
from hetero_jax.sched.router import Router, RouterConfig
from hetero_jax.sched.tiles import CascadeSettings
from hetero_jax.sim.report import percentile
from hetero_jax.sim.workload import WorkloadConfig, arrival_times, request_specs


@dataclasses.dataclass(frozen=True)
class SimConfig:
    scheduler: SchedulerConfig = SchedulerConfig()
    workload: WorkloadConfig = WorkloadConfig()
    replicas: int = 1
    embed_replicas: int = 0  # > 0: the dedicated split (that many embedding-only replicas)
    router: RouterConfig | None = None  # None: least tokens
    cascade: CascadeSettings | None = None  # None: plain attention (every sequence reads all)
    # closed loop: a client's next request joins the step after next, as in the engine with
    # async scheduling (the next step was scheduled while this one ran)
    async_scheduling: bool = False
    # KV tokens of one layer that the L2 holds (the share of the L2 left to KV, over a token's
    # KV bytes in one layer); 0: no locality, every read is HBM's (module docstring)
    l2_kv_tokens: int = 0


@dataclasses.dataclass
class _Replica:
    sched: Scheduler
    kinds: tuple = (EMBED, GENERATE)  # the request types routed here
    busy: bool = False


@dataclasses.dataclass
class _Totals:
    steps: int = 0
    tokens: int = 0
    embed_tokens: int = 0
    fill: float = 0.0
    busy_s: float = 0.0
    preemptions: int = 0
    kv_read_tokens: int = 0
    cascade_steps: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    homogeneous_decode_steps: int = 0
    kv_free_s: float = 0.0


class Simulation:
    def __init__(self, cfg: SimConfig, cost_model):
        assert cfg.replicas >= 1, f"{cfg.replicas=} must be >= 1"
        k = cfg.embed_replicas
        assert k == 0 or 0 < k < cfg.replicas, (
            f"{cfg.embed_replicas=} must leave at least one of {cfg.replicas=} for generation")
        self.cfg, self.cost = cfg, cost_model
        kinds = [(EMBED, GENERATE)] * cfg.replicas if k == 0 else (
            [(EMBED,)] * k + [(GENERATE,)] * (cfg.replicas - k))
        self.replicas = [_Replica(Scheduler(cfg.scheduler), kind) for kind in kinds]
        self.specs = request_specs(cfg.workload)
        self.events: list = []
        self._seq = itertools.count()
        self.done: list = []
        self.totals = _Totals()
        self._issued = 0
        self._cache_seed = chain_seed("hetero-jax sim", cfg.scheduler.page_size)
        self._late = 0  # async scheduling: requests to issue (now) once the next steps start
        self.router = Router(cfg.replicas, cfg.router)

    def run(self) -> "SimResult":
        wl = self.cfg.workload
        times = arrival_times(wl)
        if wl.arrival == "closed":
            times = [0.0] * min(wl.clients, len(self.specs))
        for t in times:
            self._issue(t)
        now = 0.0
        while self.events:
            now = self.events[0][0]
            while self.events and self.events[0][0] == now:  # everything due now, then steps
                _, _, kind, data = heapq.heappop(self.events)
                if kind == "arrive":
                    replica = self.replicas[self._route(data)]
                    data.arrival_time = now
                    replica.sched.add(data)
                else:
                    self._step_done(*data, now)
            for replica in self.replicas:
                self._start(replica, now)
            for _ in range(self._late):  # submitted meanwhile: they wait for the step after
                self._issue(now)
            self._late = 0
        return dataclasses.replace(SimResult.collect(self, now), **self._locality())

    def _locality(self) -> dict:
        """The KV read, cascade steps, mean decode batch and replica 0's batching stats."""
        tot = self.totals
        return dict(kv_read_tokens=tot.kv_read_tokens, cascade_steps=tot.cascade_steps,
                    mean_decode_batch=tot.decode_tokens / max(tot.decode_steps, 1),
                    homogeneous_decode_share=tot.homogeneous_decode_steps
                    / max(tot.decode_steps, 1), kv_free_s=tot.kv_free_s,
                    batching=self.replicas[0].sched.batching.stats())

    def _route(self, req: Request) -> int:
        """The router's replica for an arriving request (loads: remaining tokens)."""
        eligible = [i for i, r in enumerate(self.replicas) if req.kind in r.kinds]
        loads = [0] * len(self.replicas)
        for i in eligible:
            loads[i] = _remaining(self.replicas[i].sched)
        hashes = []
        if self.router.config.policy == "prefix-affinity":  # the pages a lookup may hit
            page = self.cfg.scheduler.page_size
            cap = (req.num_tokens - 1) // page
            hashes = extend_hashes(req.block_hashes, req.prompt_token_ids[:cap * page], page,
                                   req.cache_seed)[:cap]
        return self.router.route(hashes, loads, eligible)

    def _issue(self, t: float) -> None:
        spec = self.specs[self._issued]
        req = Request(self._issued, list(spec.token_ids), spec.max_tokens, kind=spec.kind,
                      cache_seed=self._cache_seed)
        self._issued += 1
        self._push(t, "arrive", req)

    def _push(self, t: float, kind: str, data) -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, data))

    def _start(self, replica: _Replica, now: float) -> None:
        if replica.busy or not replica.sched.has_work():
            return
        out = replica.sched.schedule()
        assert out.items, "the scheduler produced an empty step while requests are pending"
        page = self.cfg.scheduler.page_size
        shape = StepShape.from_output(out, page, self.cfg.cascade)
        tot = self.totals
        tot.cascade_steps += shape.shared_kv_tokens > 0
        if self.cfg.l2_kv_tokens:
            repeated, reused = page_reuse(out.items, page)
            shape = served_by_l2(shape, page * repeated, page * reused, self.cfg.l2_kv_tokens)
        dt = self.cost.step_time(shape)
        tot.kv_free_s += self.cost.step_time(without_kv_reads(shape))
        tot.kv_read_tokens += shape.kv_read_tokens
        tot.decode_steps += shape.decode_tokens > 0
        tot.homogeneous_decode_steps += one_prefix_group(out.items)
        tot.decode_tokens += shape.decode_tokens
        tot.steps += 1
        tot.tokens += out.num_tokens
        tot.embed_tokens += out.tokens_of(EMBED)
        tot.fill += out.num_tokens / self.cfg.scheduler.token_budget
        tot.busy_s += dt
        tot.preemptions += len(out.preempted)
        replica.busy = True
        self._push(now + dt, "step", (replica, out, dt))

    def _step_done(self, replica: _Replica, out, dt: float, now: float) -> None:
        sampled = {it.request_id: SampledToken(7, 0.0) for it in out.items if it.samples}
        for req in replica.sched.update(out, RunnerOutput(sampled, dt), now):
            self.done.append(req)
            if (self.cfg.workload.arrival == "closed"
                    and self._issued + self._late < len(self.specs)):
                if self.cfg.async_scheduling:
                    self._late += 1
                else:
                    self._issue(now)
        replica.busy = False


def without_kv_reads(shape: StepShape) -> StepShape:
    """`shape` with every context read shared away: the step as no attention scheme can
    undercut it (its weights, FLOPs and KV writes stay), the floor of what sharing can save."""
    return dataclasses.replace(shape, shared_kv_tokens=shape.context_tokens)


def page_reuse(items: list, page_size: int) -> tuple:
    """(repeated reads, reused pages) of a step's attention: the page reads beyond the first
    read of each page (a page that k of its sequences read, a shared prefix, counts k - 1),
    and how many distinct pages are read more than once (the working set that L2 would have
    to hold for those repeats to hit)."""
    reads = collections.Counter(itertools.chain.from_iterable(
        it.pages[:-(-(it.start + it.num_tokens) // page_size)] for it in items))
    reused = [n for n in reads.values() if n > 1]
    return sum(reused) - len(reused), len(reused)


def served_by_l2(shape: StepShape, repeated_tokens: int, reused_tokens: int,
                 l2_kv_tokens: int) -> StepShape:
    """`shape` with the repeated reads (`repeated_tokens`, less those cascade already saved)
    that L2 serves counted as saved: all of them while the reused pages (`reused_tokens` of
    KV, the shared prefixes) fit in `l2_kv_tokens`, that fraction of them when they do not."""
    repeats = repeated_tokens - shape.shared_kv_tokens
    if repeats <= 0:
        return shape
    served = int(repeats * min(1.0, l2_kv_tokens / reused_tokens))
    return dataclasses.replace(shape, shared_kv_tokens=shape.shared_kv_tokens + served)


def one_prefix_group(items: list) -> bool:
    """Whether a step's decodes all start on the same KV page: one prefix group (shared
    cached pages), the batch Feather wants; False without decodes."""
    first = {it.pages[0] if it.pages else ("own", it.request_id) for it in items
             if it.kind == DECODE}
    return len(first) == 1


def _remaining(sched: Scheduler) -> int:
    outputs = sum(r.max_tokens - len(r.output_token_ids) for r in sched.requests.values()
                  if r.kind == GENERATE)
    return sum(sched.pending.values()) + outputs


@dataclasses.dataclass
class SimResult:
    makespan_s: float
    steps: int
    avg_budget_fill: float
    embed_token_share: float
    busy_s: float
    preemptions: int
    per_type: dict  # kind -> metrics
    scheduled_tokens: int  # every step's tokens: what the cost model charged for
    cache_query_tokens: int  # full-page tokens that admissions looked up in the prefix cache
    cache_hit_tokens: int  # of those, the ones found (and so never scheduled)
    cache_hit_rate: float | None  # hit / query tokens; None when nothing was looked up
    routing: dict = dataclasses.field(default_factory=dict)  # the router's RoutingStats
    kv_read_tokens: int = 0  # KV tokens the attention read from HBM (less L2's: l2_kv_tokens)
    cascade_steps: int = 0  # steps that read shared pages once per tile
    mean_decode_batch: float = 0.0  # decode tokens per step that has any
    homogeneous_decode_share: float = 0.0  # of the steps with decodes: one prefix group's
    kv_free_s: float = 0.0  # the same steps' summed cost had their attention read no KV
    batching: dict = dataclasses.field(default_factory=dict)  # replica 0's batching stats

    @classmethod
    def collect(cls, sim: Simulation, end: float) -> "SimResult":
        tot = sim.totals
        per_type = {}
        for kind in (GENERATE, EMBED):
            reqs = [r for r in sim.done if r.kind == kind]
            lat = [r.finish_time - r.arrival_time for r in reqs]
            first = [(r.first_token_time if kind == GENERATE else r.finish_time) - r.arrival_time
                     for r in reqs]
            tokens = sum(len(r.output_token_ids) if kind == GENERATE else r.num_tokens
                         for r in reqs)
            per_type[kind] = {
                "completed": len(reqs),
                "throughput_rps": len(reqs) / end if end else 0.0,
                "tokens_per_s": tokens / end if end else 0.0,
                "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99),
                "ttft_p50_s": percentile(first, 50), "ttft_p99_s": percentile(first, 99)}
        page = sim.cfg.scheduler.page_size
        query = page * sum(r.sched.cache_stats().query_pages for r in sim.replicas)
        hit = page * sum(r.sched.cache_stats().hit_pages for r in sim.replicas)
        return cls(end, tot.steps, tot.fill / max(tot.steps, 1),
                   tot.embed_tokens / max(tot.tokens, 1), tot.busy_s, tot.preemptions, per_type,
                   tot.tokens, query, hit, hit / query if query else None,
                   dataclasses.asdict(sim.router.stats))

    @property
    def requests_per_s(self) -> float:
        """Requests of both types completed per second."""
        return sum(t["throughput_rps"] for t in self.per_type.values())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def simulate(cfg: SimConfig, cost_model) -> SimResult:
    return Simulation(cfg, cost_model).run()
