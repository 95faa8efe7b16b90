"""Property tests of the host scheduler under every policy, driven by a fake runner (no jax).

Random workloads (both types, random lengths, arrival steps, stop tokens) and random limits
(budget, chunk size, sequence caps, a KV cache tight enough to preempt) check that: the budget
and the per-step caps are never exceeded; within a type, first scheduling follows arrival
order; every request finishes with exactly the tokens an unpreempted run produces; no page
leaks; and IBS never starves a backlogged queue (Algorithm 2's bound, plus at most max_lead
selections that lead with generation prefill while the batch is thin). "ibs+cost" is the cost-aware IBS under a
step cost that splits a mixed step now always, now when token padding makes two steps cheaper.
"""
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from hetero_jax.sched import DECODE, EMBED, GENERATE, KIND_ORDER, POLICIES, Scheduler, Status
from hetero_jax.sched.costmodel import LinearCostModel, StepCost
from tests.sched_fakes import config, drive, emb, expected_tokens, gen

MAX_MODEL_LEN = 96
STEP_COSTS = (lambda out: 1 + len(out.items) ** 2,  # two parts always cost less
              StepCost(LinearCostModel(0.2, (("tokens", 0.01),), token_buckets=(4, 8, 16, 32, 64,
                                                                              128))))


@st.composite
def scenarios(draw, policies=tuple(POLICIES) + ("ibs+cost",)):
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    specs = draw(st.lists(st.tuples(
        st.sampled_from([EMBED, GENERATE]), st.integers(1, 64), st.integers(1, 12),
        st.integers(0, 12), st.booleans()), min_size=1, max_size=12))
    requests, arrivals = [], {}
    for rid, (kind, length, max_tokens, arrival, stops) in enumerate(specs):
        stop = {3 + (rid * 7919 + 31 * 2) % 997} if stops else ()  # stops at the third token
        req = emb(rid, length) if kind == EMBED else gen(rid, length, max_tokens, stop)
        requests.append(req)
        arrivals.setdefault(arrival, []).append(req)
    largest = max(-(-min(len(r.prompt_token_ids) + r.max_tokens, MAX_MODEL_LEN) // page_size)
                  for r in requests)
    policy = draw(st.sampled_from(policies))
    step_cost = draw(st.sampled_from(STEP_COSTS)) if policy == "ibs+cost" else None
    cfg = config(policy=policy.split("+")[0], step_cost=step_cost,
                 token_budget=draw(st.integers(1, 96)),
                 chunk_size=draw(st.integers(1, 48)), max_num_seqs=draw(st.integers(1, 8)),
                 max_chunk_seqs=draw(st.integers(1, 4)), page_size=page_size,
                 num_pages=largest + 1 + draw(st.integers(0, 2 * largest)),
                 max_model_len=MAX_MODEL_LEN, thin_batch=draw(st.sampled_from([0.0, 0.5, 1.0])))
    return cfg, requests, arrivals


def check_step(sched, out, first_order):
    cfg = sched.cfg
    assert out.num_tokens <= cfg.token_budget, f"{out.num_tokens=} > {cfg.token_budget=}"
    assert sum(it.kind != DECODE for it in out.items) <= cfg.max_chunk_seqs
    assert len(out.items) <= cfg.max_num_seqs
    assert [KIND_ORDER[it.kind] for it in out.items] == sorted(KIND_ORDER[it.kind] for it in out.items)
    assert len({it.request_id for it in out.items}) == len(out.items)
    for it in out.items:
        assert 1 <= it.num_tokens <= (1 if it.kind == DECODE else cfg.chunk_size)
        assert it.kind != EMBED or not it.samples, "an embedding chunk samples"
        first_order[EMBED if it.kind == EMBED else GENERATE].setdefault(it.request_id, None)


def check_state(sched):
    held = [p for r in sched.running for p in r.pages]
    assert len(held) == len(set(held)), "a page is held twice"
    assert len(held) + sched.pages.num_free == sched.cfg.num_pages - 1, "pages leaked"
    for kind, queue in sched.waiting.items():
        assert all(r.pages == [] and r.num_computed_tokens == 0 for r in queue)
        total = sum(r.num_pending for r in sched.requests.values() if r.kind == kind)
        assert sched.pending[kind] == total, f"{kind}: {sched.pending[kind]=} != {total=}"
    for r in sched.running:
        if r.kind == EMBED:  # an embedding holds the pages of its whole input until it ends
            assert len(r.pages) == -(-r.num_tokens // sched.cfg.page_size)


@settings(max_examples=500, deadline=None)
@given(scenarios())
def test_every_request_finishes_within_the_limits_and_loses_nothing(scenario):
    cfg, requests, arrivals = scenario
    sched = Scheduler(cfg)
    first_order = {EMBED: {}, GENERATE: {}}

    def on_step(step, out, finished):
        check_step(sched, out, first_order)
        check_state(sched)
    drive(sched, arrivals, max_steps=20_000, on_step=on_step)
    arrival_order = sorted(requests, key=lambda r: min(s for s, rs in arrivals.items() if r in rs))
    for kind in (EMBED, GENERATE):
        want = [r.request_id for r in arrival_order if r.kind == kind]
        assert list(first_order[kind]) == want, f"{kind} first scheduled out of arrival order"
    for r in requests:
        assert r.status is Status.FINISHED and r.pages == []
        if r.kind == EMBED:
            assert (r.finish_reason, r.embedding) == ("embedded", ("vec", r.request_id))
            assert r.num_computed_tokens == r.num_tokens and r.output_token_ids == []
        else:
            want = expected_tokens(r)[:MAX_MODEL_LEN - len(r.prompt_token_ids)]
            assert r.output_token_ids == want, f"request {r.request_id} lost or changed tokens"
            assert r.finish_reason in ("stop", "length")
    assert not sched.has_work() and not sched.requests and sched.pending == {EMBED: 0, GENERATE: 0}
    assert sched.pages.num_free == cfg.num_pages - 1


class PickLog:
    """(weights of the contested types, chosen type, whether it led over a live embedding) of
    every selection that was served. A thin-batch selection (the policy's `led`) leaves the
    credits alone, so it is logged as uncontested.

    When the cost-aware IBS defers a type's part of a step, that type's selections of the step
    were not served, and the other type's selections after its first one were uncontested (as
    after a head that cannot run).
    """

    def __init__(self, policy):
        self.policy = policy
        self.entries, self._step = [], 0
        self._wrapped = policy.plans, policy.pick, policy.undo, policy.split
        policy.plans, policy.pick, policy.undo, policy.split = (self.plans, self.pick,
                                                                self.undo, self.split)

    def plans(self, pending, gens):
        self._step = len(self.entries)
        return self._wrapped[0](pending, gens)

    def pick(self, heads, weights):
        kind = self._wrapped[1](heads, weights)
        led = self.policy.led
        contested = [kind] if led else heads
        self.entries.append(({k: weights[k] for k in contested}, kind, led and EMBED in heads))
        return kind

    def undo(self, kind):
        self._wrapped[2](kind)
        self.entries.pop()

    def split(self, out):
        ran = self._wrapped[3](out)
        if len(ran.items) < len(out.items):
            deferred = GENERATE if ran.items[0].kind == EMBED else EMBED
            step = self.entries[self._step:]
            first = next((i for i, (_, k, _) in enumerate(step) if k == deferred), len(step))
            self.entries[self._step:] = step[:first] + [({k: w[k]}, k, led)
                                                        for w, k, led in step[first:]
                                                        if k != deferred]
        return ran


@settings(max_examples=300, deadline=None)
@given(scenarios(policies=("ibs", "ibs+cost")))
def test_ibs_never_starves_a_backlogged_queue(scenario):
    """While both types have work, a type waits at most (W0 + W) / (2 w) + 1 selections.

    With credits x and -x, a contested selection not given to type t raises x by its weight
    w_t, and t wins once 2x >= w_other - w_t; t's last win left x >= -W0 / 2 (W0: the total
    weight then). A type whose head could not run, or whose part of a step the cost-aware IBS
    deferred, is not contested, and keeps its credit. Thin-batch selections are not contested
    either; at most max_lead of them run in a row while an embedding head is live.
    """
    cfg, requests, arrivals = scenario
    check_no_starvation(cfg, requests, arrivals)


def test_a_split_step_does_not_lead_on_the_lead_of_the_embedding_it_defers():
    """Found by the property above: three thin-batch prefills pass a live embedding (the
    lead, 3, spent); the next step's selections are generation (contested), the embedding
    (lead restored) and a thin-batch prefill; the cost model splits the step. Keeping the
    generation part would defer the embedding whose selection gave that prefill its lead:
    four thin-batch selections in a row. The embedding part runs instead."""
    cfg = config(policy="ibs", token_budget=3, chunk_size=1, max_num_seqs=3, max_chunk_seqs=3,
                 page_size=1, num_pages=12, max_model_len=96, prefix_caching=False,
                 step_cost=lambda out: 1 + len(out.items) ** 2, thin_batch=1.0)
    requests = [emb(i, 1) for i in range(9)] + [gen(9, 1, 1), gen(10, 2, 1), gen(11, 10, 1)]
    check_no_starvation(cfg, requests, {0: requests})


def check_no_starvation(cfg, requests, arrivals) -> None:
    sched = Scheduler(cfg)
    log = PickLog(sched.policy)
    drive(sched, arrivals, max_steps=20_000)
    for t in (EMBED, GENERATE):
        debt, run, min_w, max_w = 0, 0, math.inf, 0
        for weights, kind, _ in log.entries:
            if len(weights) < 2:
                continue
            if kind == t:
                debt, run, min_w, max_w = sum(weights.values()), 0, math.inf, 0
            else:
                run, min_w = run + 1, min(min_w, weights[t])
                max_w = max(max_w, sum(weights.values()))
                bound = math.ceil((debt + max_w) / (2 * min_w)) + 1
                assert run <= bound, f"{t} waited {run} > {bound} contested selections"
    led = 0
    for _, kind, over_embedding in log.entries:
        led = 0 if kind == EMBED else led + over_embedding
        assert led <= sched.policy.max_lead, f"{led=} thin-batch selections passed an embedding"
    assert all(r.finish_reason for r in requests)

