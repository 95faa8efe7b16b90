"""The Chunked Hash Tree (no jax): hand-computed cases, then every query against a brute-force
recomputation after each operation of random adds, admissions, preemptions, finishes and
aborts over requests drawn from a few shared prefixes."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero_jax.sched import Request
from hetero_jax.sched.cht import ChunkedHashTree, chunk_keys

PAGE, CHUNK = 2, 2  # a chunk is 4 tokens


def req(rid: int, tokens: list) -> Request:
    return Request(rid, list(tokens), 4)


def test_keys_are_the_digests_at_chunk_boundaries_and_shared_prefixes_share_them():
    a, b = req(0, range(10)), req(1, list(range(8)) + [99, 98, 97])
    ka, kb = chunk_keys(a, PAGE, CHUNK), chunk_keys(b, PAGE, CHUNK)
    assert len(ka) == 2 and len(kb) == 2  # 10 and 11 tokens: two full chunks of 4
    assert ka == kb  # the first 8 tokens agree
    c = req(2, [5] + list(range(1, 10)))
    assert chunk_keys(c, PAGE, CHUNK)[0] != ka[0]
    with pytest.raises(ValueError, match="chunk_pages=0"):
        ChunkedHashTree(PAGE, 0)


def test_find_best_prefers_the_request_sharing_the_running_batch_and_reports_the_tip():
    cht = ChunkedHashTree(PAGE, CHUNK)
    run = req(0, list(range(12)))  # 3 chunks
    other = req(1, [50 + i for i in range(12)])  # shares nothing, arrived first
    kin = req(2, list(range(8)) + [70, 71, 72, 73])  # shares 2 chunks
    for r in (run, other, kin):
        cht.add(r)
    assert cht.find_best().request is run  # nothing runs: fewest missing (3 each), earliest
    cht.admit(run)
    best = cht.find_best()
    assert best.request is kin and (best.missing, best.held) == (1, 2)
    assert (best.tip_before, best.tip_after, best.loss) == (3, 2, 1)
    assert cht.find_best() is best  # cached
    cht.admit(kin)
    assert cht.tip == chunk_keys(kin, PAGE, CHUNK)[:2]
    b = cht.find_best()
    assert b.request is other and (b.missing, b.tip_before, b.tip_after, b.loss) == (3, 2, 0, 2)
    cht.remove(kin)
    assert len(cht.tip) == 3  # the tip grows back to the remaining request's keys
    assert [r.request_id for r in cht.ranked()] == [1]


def test_a_best_found_while_ranked_sets_requests_aside_is_not_kept_after_it():
    """`ranked` pops the requests it yields off the heap until it ends; a `find_best` asked
    meanwhile (feather's admission loop asks after every admission) sees only the rest. Once
    the iterator ends they are back, and so must the best be: a stale None left feather's
    queue unserved for 16 steps of the simulator's 16-group trace."""
    cht = ChunkedHashTree(PAGE, CHUNK)
    a, b = req(0, range(8)), req(1, [50 + i for i in range(8)])
    cht.add(a)
    cht.add(b)
    it = cht.ranked()
    assert [next(it).request_id, next(it).request_id] == [0, 1]
    cht.find_best()  # asked while both are set aside
    it.close()
    assert cht.find_best().request is a
    assert [r.request_id for r in cht.ranked()] == [0, 1]


def brute(cht: ChunkedHashTree, running: dict, waiting: dict, order: dict) -> dict:
    keys = {rid: chunk_keys(r, PAGE, CHUNK) for rid, r in {**running, **waiting}.items()}
    work = {k for rid in running for k in keys[rid]}
    tip = []
    if running:
        first = keys[next(iter(running))]
        while len(tip) < len(first) and all(
                len(keys[r]) > len(tip) and keys[r][len(tip)] == first[len(tip)] for r in running):
            tip.append(first[len(tip)])
    per = 4
    missing = {rid: max(-(-len(waiting[rid].prompt_token_ids) // per), 1)
               - sum(k in work for k in keys[rid]) for rid in waiting}
    best = min(waiting, key=lambda rid: (missing[rid], order[rid]), default=None)
    out = dict(tip=tip, missing=missing, best=best)
    if best is not None:
        kb = keys[best]
        after = len(kb) if not running else next(
            (i for i in range(min(len(tip), len(kb))) if kb[i] != tip[i]), min(len(tip), len(kb)))
        peers = sum(1 for r in waiting if keys[r][:1] == kb[:1]) if kb else 1
        out.update(after=after, peers=peers, held=sum(k in work for k in kb),
                   ranked=sorted(waiting, key=lambda rid: (missing[rid], order[rid])))
    return out


@st.composite
def programs(draw):
    prefixes = [[p * 100 + i for i in range(draw(st.integers(0, 16)))] for p in range(3)]
    n = draw(st.integers(1, 14))
    prompts = [draw(st.sampled_from(prefixes))[:draw(st.integers(0, 16))]
               + [1000 + 50 * rid + i for i in range(draw(st.integers(0, 6)))] for rid in range(n)]
    prompts = [p or [7] for p in prompts]
    ops = draw(st.lists(st.tuples(st.sampled_from(["add", "admit", "preempt", "finish", "abort"]),
                                  st.integers(0, 1000)), min_size=1, max_size=60))
    return prompts, ops


@settings(max_examples=300, deadline=None)
@given(programs())
def test_queries_equal_a_brute_force_recomputation_after_every_operation(program):
    prompts, ops = program
    cht = ChunkedHashTree(PAGE, CHUNK)
    running, waiting, order, fresh, arrivals = {}, {}, {}, list(range(len(prompts))), 0
    for op, pick in ops:
        if op == "add" and fresh:
            rid = fresh.pop(0)
            waiting[rid] = req(rid, prompts[rid])
            order[rid], arrivals = arrivals, arrivals + 1
            cht.add(waiting[rid])
        elif op == "admit" and waiting:
            rid = sorted(waiting)[pick % len(waiting)]
            running[rid] = waiting.pop(rid)
            cht.admit(running[rid])
        elif op == "preempt" and running:
            rid = sorted(running)[pick % len(running)]
            waiting[rid] = running.pop(rid)
            cht.preempt(waiting[rid])
        elif op in ("finish", "abort") and (running or waiting):
            pool = running if op == "finish" and running else (waiting or running)
            rid = sorted(pool)[pick % len(pool)]
            cht.remove(pool.pop(rid))
        want = brute(cht, running, waiting, order)
        assert cht.tip == want["tip"]
        assert {rid: cht.missing(rid) for rid in waiting} == want["missing"]
        best = cht.find_best()
        if want["best"] is None:
            assert best is None and list(cht.ranked()) == []
            continue
        assert best.request.request_id == want["best"]
        assert (best.tip_before, best.tip_after) == (len(want["tip"]) if running else 0,
                                                     want["after"])
        assert (best.peers, best.held, best.missing) == (want["peers"], want["held"],
                                                         want["missing"][want["best"]])
        assert [r.request_id for r in cht.ranked()] == want["ranked"]
        assert cht.find_best() == best  # ranked() left the heap as it was
