"""The prefix cache on the host (no jax): the page pool, lookups, holds and the hash chain.

In the spirit of vLLM's tests/v1/core/test_prefix_caching.py: hits while the owner runs and
after it finished, the exact eviction order, pages in use never evicted, a failed allocation
changing no count, salts and adapters isolating, reset, and a property over random
shared-prefix workloads with aborts and preemptions.
"""
import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero_jax.sched import EMBED, GENERATE, PagePool, Request, Scheduler, Status
from hetero_jax.sched.hashing import chain_seed, extend_hashes, page_hashes
from tests.sched_fakes import config, drive, expected_tokens, fake_runner

SEED = chain_seed("test model", "float32", 4)
PS = 4


def cached_gen(rid, tokens, max_tokens=3, seed=SEED):
    return Request(rid, list(tokens), max_tokens, kind=GENERATE, cache_seed=seed)


def cached_emb(rid, tokens, seed=SEED):
    return Request(rid, list(tokens), kind=EMBED, cache_seed=seed)


def caching_scheduler(**kw):
    cfg = dict(page_size=PS, num_pages=64, token_budget=64, chunk_size=16, max_model_len=64,
               prefix_caching=True)
    return Scheduler(config(**{**cfg, **kw}))


def step(sched):
    out = sched.schedule()
    return out, sched.update(out, fake_runner(out))


def check_pool(pool: PagePool):
    assert all(c >= 0 for c in pool.ref_count)
    for digest, page in pool.cached.items():
        assert pool.page_hash[page] == digest
    assert sum(h is not None for h in pool.page_hash) == pool.num_cached


# -- the hash chain ---------------------------------------------------------------------------
def test_chain_digests_cover_the_whole_prefix_and_the_seed():
    a = page_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, SEED)
    assert len(a) == 2, "only full pages are hashed"
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4, SEED)[0] == a[0]
    assert page_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4, SEED)[1] != a[1], "h_1 covers page 0 too"
    assert page_hashes([1, 2, 3, 4], 4, chain_seed("other"))[0] != a[0]
    assert chain_seed("ab", "c") != chain_seed("a", "bc")
    assert extend_hashes(a[:1], list(range(1, 10)), 4, SEED) == a, "incremental = one shot"


def test_hashing_ten_thousand_tokens_is_cheap():
    tokens = np.random.default_rng(0).integers(0, 32000, 10_000).tolist()
    best = min(_timed(lambda: page_hashes(tokens, 16, SEED)) for _ in range(5))
    assert best < 0.02, f"{best=}"  # ~0.6 ms measured; loose bound, not a benchmark


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- the pool ---------------------------------------------------------------------------------
def test_eviction_order_is_lru_with_the_deepest_pages_first():
    pool = PagePool(8, caching=True)
    a, b = pool.allocate(3), pool.allocate(2)
    for i, page in enumerate(a):
        pool.register(page, b"a%d" % i)
    pool.register(b[0], b"b0")  # b[1] holds nothing cached
    pool.free(a)
    pool.free(b)
    assert pool.num_free == 7 and pool.num_cached == 4
    # b's uncached page first (it went to the front), the never used ones (6, 7), then the
    # cached ones least recently freed first, each request's deepest page first
    order = [pool.allocate(1)[0] for _ in range(7)]
    assert order == [b[1], 6, 7, a[2], a[1], a[0], b[0]]
    assert pool.evictions == 4 and pool.num_cached == 0


def test_pages_in_use_are_never_handed_out_and_a_failed_allocation_takes_nothing():
    pool = PagePool(6, caching=True)
    held = pool.allocate(3)
    pool.register(held[0], b"x")
    assert pool.allocate(3) is None and pool.num_free == 2
    rest = pool.allocate(2)
    assert not set(rest) & set(held) and pool.lookup([b"x"]) == [held[0]]
    assert pool.ref_count[held[0]] == 1


def test_touch_takes_a_reference_and_a_cached_free_page_leaves_the_free_queue():
    pool = PagePool(4, caching=True)
    (page,) = pool.allocate(1)
    pool.register(page, b"p")
    pool.free([page])
    assert pool.num_free == 3 and pool.can_take([page], 2) and not pool.can_take([page], 3)
    pool.touch([page])
    assert pool.ref_count[page] == 1 and pool.num_free == 2
    assert page not in pool.allocate(2)


def test_reset_forgets_every_digest_but_leaves_held_pages_alone():
    pool = PagePool(4, caching=True)
    pages = pool.allocate(2)
    pool.register(pages[0], b"p")
    pool.reset()
    assert pool.lookup([b"p"]) == [] and pool.ref_count[pages[0]] == 1


def test_without_caching_nothing_is_registered():
    pool = PagePool(4, caching=False)
    (page,) = pool.allocate(1)
    pool.register(page, b"p")
    assert pool.lookup([b"p"]) == []


# -- the scheduler ----------------------------------------------------------------------------
def run_to_decode(sched, req):
    sched.add(req)
    while not req.output_token_ids:
        step(sched)


def test_a_hit_while_the_owner_runs_and_after_it_finished():
    sched = caching_scheduler()
    prompt = list(range(1, 19))  # 18 tokens: 4 full pages
    owner = cached_gen(0, prompt, max_tokens=5)
    run_to_decode(sched, owner)
    assert owner.status is Status.RUNNING
    early = cached_gen(1, prompt[:13] + [99, 98])  # shares 3 full pages
    sched.add(early)
    out, _ = step(sched)
    assert early.num_cached_tokens == 12 and early.pages[:3] == owner.pages[:3]
    assert all(sched.pages.ref_count[p] == 2 for p in owner.pages[:3])
    drive(sched, {})
    late = cached_gen(2, prompt)  # the whole prompt is cached: capped so one token runs
    sched.add(late)
    out, _ = step(sched)
    assert late.num_cached_tokens == 16 and out.items[0].start == 16
    drive(sched, {})
    assert late.output_token_ids == expected_tokens(late)
    assert sched.pages.queries == 3 and sched.pages.hit_pages == 3 + 4
    assert all(c == 0 for c in sched.pages.ref_count)


def test_a_fully_cached_page_aligned_prompt_still_runs_its_last_token():
    sched = caching_scheduler()
    prompt = list(range(1, 17))  # exactly 4 pages
    drive(sched, {0: [cached_gen(0, prompt)]})
    again = cached_gen(1, prompt)
    sched.add(again)
    out, _ = step(sched)
    assert again.num_cached_tokens == 12 and out.items[0].start == 12
    assert out.items[0].num_tokens == 4, "the last page is recomputed into a fresh page"


def test_the_same_prefix_twice_in_one_step_is_computed_once():
    sched = caching_scheduler(chunk_size=8, max_chunk_seqs=4)
    prompt = list(range(1, 34))  # 33 tokens: 8 full pages
    reqs = [cached_gen(i, prompt + [100 + i]) for i in range(4)]
    computed = []
    drive(sched, {0: reqs}, on_step=lambda s, out, fin: computed.extend(
        it.num_tokens for it in out.items if it.kind != "decode"))
    assert [r.num_cached_tokens for r in reqs] == [0, 32, 32, 32]
    assert sum(computed) == 34 + 3 * 2, "the 32 shared tokens ran once"
    assert all(r.output_token_ids == expected_tokens(r) for r in reqs)


def test_salts_and_adapters_isolate():
    prompt = list(range(1, 20))
    for other in (chain_seed("test model", "float32", 4, "tenant b"),
                  chain_seed("test model", "float32", 4, "adapter x", b"digest")):
        sched = caching_scheduler()
        drive(sched, {0: [cached_gen(0, prompt)]})
        req = cached_gen(1, prompt, seed=other)
        drive(sched, {0: [req]})
        assert req.num_cached_tokens == 0


def test_an_embedding_hits_pages_a_generation_wrote_and_holds_all_its_pages():
    sched = caching_scheduler()
    prompt = list(range(1, 23))
    drive(sched, {0: [cached_gen(0, prompt)]})
    req = cached_emb(1, prompt[:21])
    sched.add(req)
    out = sched.schedule()
    assert req.num_cached_tokens == 20 and len(req.pages) == 6
    assert out.items[0].first_chunk and out.items[0].start == 20


def test_a_failed_admission_changes_no_reference_count():
    sched = caching_scheduler(num_pages=8, max_model_len=28)
    prompt = list(range(1, 14))
    drive(sched, {0: [cached_gen(0, prompt, max_tokens=1)]})
    hog = cached_gen(1, [7] * 19, max_tokens=8)  # holds 5 of the 7 pages, its next token too
    run_to_decode(sched, hog)
    counts, cached = list(sched.pages.ref_count), sched.pages.lookup(big_hashes := page_hashes(
        prompt[:12], PS, SEED))
    assert len(cached) == 2 and len(big_hashes) == 3, "one cached page was evicted for the hog"
    big = cached_emb(2, prompt[:12] + [5] * 12)  # hits 2 cached pages, needs 6 in all
    sched.add(big)
    out = sched.schedule()
    assert big.status is Status.WAITING and sched.pages.ref_count == counts
    sched.update(out, fake_runner(out))
    drive(sched, {})
    assert big.status is Status.FINISHED


def test_preemption_leaves_cached_pages_for_the_recomputation():
    sched = caching_scheduler(num_pages=12, token_budget=64, max_model_len=40)
    a = cached_gen(0, list(range(1, 18)), max_tokens=20)
    b = cached_gen(1, list(range(50, 67)), max_tokens=20)
    trace = drive(sched, {0: [a, b]})
    assert sum(len(out.preempted) for _, out, _ in trace) >= 1
    assert max(a.num_cached_tokens, b.num_cached_tokens) > 0, "recomputed from what survived"
    assert a.output_token_ids == expected_tokens(a) and b.output_token_ids == expected_tokens(b)


@st.composite
def shared_prefix_workloads(draw):
    prefixes = [draw(st.lists(st.integers(1, 5), min_size=0, max_size=24)) for _ in range(3)]
    specs = draw(st.lists(st.tuples(
        st.sampled_from([EMBED, GENERATE]), st.integers(0, 2), st.integers(1, 12),
        st.integers(1, 6), st.integers(0, 8), st.sampled_from([None, None, "salt"]),
        st.booleans()), min_size=1, max_size=14))
    reqs, arrivals, aborts = [], {}, {}
    for rid, (kind, group, suffix, max_tokens, arrival, salt, abort) in enumerate(specs):
        tokens = prefixes[group] + [100 + rid] * suffix
        seed = chain_seed("m", salt)
        req = (cached_emb(rid, tokens, seed) if kind == EMBED
               else cached_gen(rid, tokens, max_tokens, seed))
        reqs.append(req)
        arrivals.setdefault(arrival, []).append(req)
        if abort:
            aborts.setdefault(arrival + draw(st.integers(0, 6)), []).append(rid)
    cfg = config(page_size=draw(st.sampled_from([1, 2, 4])), token_budget=draw(
        st.integers(4, 48)), chunk_size=draw(st.integers(1, 16)), max_num_seqs=draw(
        st.integers(1, 6)), max_chunk_seqs=draw(st.integers(1, 4)), max_model_len=48,
        num_pages=draw(st.integers(50, 90)), prefix_caching=True)
    return cfg, reqs, arrivals, aborts


@settings(max_examples=300, deadline=None)
@given(shared_prefix_workloads())
def test_random_shared_prefix_workloads_with_aborts_and_preemptions_lose_nothing(workload):
    cfg, reqs, arrivals, aborts = workload
    sched = Scheduler(cfg)

    def on_step(i, out, finished):
        for rid in aborts.get(i, ()):
            sched.abort(rid)
        held = [p for r in sched.running for p in r.pages]
        assert sum(sched.pages.ref_count) == len(held), "a reference without a holder"
        for r in sched.running:  # a page a request writes is its own
            for p in r.pages[r.num_computed_tokens // cfg.page_size:]:
                assert sched.pages.ref_count[p] == 1 and sched.pages.page_hash[p] is None
        check_pool(sched.pages)
    drive(sched, arrivals, max_steps=20_000, on_step=on_step)
    aborted = {rid for rids in aborts.values() for rid in rids}
    for r in reqs:
        assert r.status is Status.FINISHED and r.pages == []
        if r.request_id not in aborted and r.kind == GENERATE:
            want = expected_tokens(r)[:cfg.max_model_len - len(r.prompt_token_ids)]
            assert r.output_token_ids == want, f"request {r.request_id} lost tokens"
    assert all(c == 0 for c in sched.pages.ref_count)
    assert sched.pages.num_free == cfg.num_pages - 1, "free + cached != all pages"
    check_pool(sched.pages)
