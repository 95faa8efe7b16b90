"""Batch-forming policies (no jax): every policy loses and duplicates nothing over random
shared-prefix workloads with aborts and preemptions; the radix tree and LPM order by hand;
feather's aging; the bandit on synthetic rewards; clear errors for bad settings."""
import dataclasses
import random
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero_jax.sched import BATCHING, GENERATE, FeatherConfig, Request, Scheduler, Status
from hetero_jax.sched.bandit import (Arm, SlidingWindowUCB, held_back_efficiency, make_arms,
                                     marginal_cost)
from hetero_jax.sched.batching import make_batching
from hetero_jax.sched.radix import RadixTree
from tests.sched_fakes import config, emb, expected_tokens, fake_runner

MAX_MODEL_LEN = 96


def shared(rid: int, prefix: list, suffix_len: int, max_tokens: int) -> Request:
    return Request(rid, prefix + [300 + rid * 7 + i for i in range(suffix_len)], max_tokens)


@st.composite
def workloads(draw):
    page = draw(st.sampled_from([2, 4]))
    prefixes = [[1 + g * 50 + i for i in range(draw(st.integers(0, 40)))] for g in range(3)]
    specs = draw(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 12), st.integers(1, 10),
                                    st.integers(0, 10), st.booleans(), st.integers(0, 30),
                                    st.booleans()), min_size=1, max_size=14))
    reqs, arrivals, aborts = [], {}, {}
    for rid, (g, suffix, max_tokens, at, abort, abort_at, is_emb) in enumerate(specs):
        r = emb(rid, suffix + 4) if is_emb else shared(rid, prefixes[g], suffix, max_tokens)
        reqs.append(r)
        arrivals.setdefault(at, []).append(r)
        if abort:
            aborts.setdefault(at + abort_at, []).append(rid)
    largest = max(-(-min(r.num_tokens + r.max_tokens, MAX_MODEL_LEN) // page) for r in reqs)
    cfg = config(policy=draw(st.sampled_from(["fcfs", "ibs"])),
                 batching=draw(st.sampled_from(BATCHING)),
                 token_budget=draw(st.integers(4, 64)), chunk_size=draw(st.integers(1, 32)),
                 max_num_seqs=draw(st.integers(1, 6)), max_chunk_seqs=draw(st.integers(1, 3)),
                 page_size=page, num_pages=largest + 1 + draw(st.integers(0, largest)),
                 max_model_len=MAX_MODEL_LEN, prefix_caching=draw(st.booleans()),
                 feather=FeatherConfig(chunk_pages=draw(st.integers(1, 3)),
                                       loss_limit=draw(st.sampled_from([0, 1, None])),
                                       cap=draw(st.sampled_from([1, 2, None])),
                                       floor=draw(st.integers(1, 3)),
                                       aging_steps=draw(st.integers(1, 8)),
                                       arms=((0, 1), (None, None), (1, 2)), window=6,
                                       round_steps=draw(st.integers(1, 3))))
    return cfg, reqs, arrivals, aborts


def run(sched: Scheduler, arrivals: dict, aborts: dict, max_steps: int = 5000) -> None:
    step, last = 0, max(list(arrivals) + list(aborts))
    while sched.has_work() or step <= last:
        for r in arrivals.get(step, ()):
            sched.add(r)
        for rid in aborts.get(step, ()):
            sched.abort(rid)
        if sched.has_work():
            out = sched.schedule()
            assert out.items, f"empty step {step} with work pending"
            assert len({it.request_id for it in out.items}) == len(out.items), "duplicated"
            sched.update(out, fake_runner(out))
            places = [r.request_id for r in sched.running] + [
                r.request_id for q in sched.waiting.values() for r in q]
            assert sorted(places) == sorted(sched.requests), "a request lost or in two places"
            held = [p for r in sched.running for p in r.pages]
            assert len(held) == len(set(held)), "a page is held twice"
        step += 1
        assert step < max_steps, "did not finish"


@settings(max_examples=300, deadline=None)
@given(workloads())
def test_no_policy_drops_or_duplicates_a_request(workload):
    cfg, reqs, arrivals, aborts = workload
    sched = Scheduler(cfg)
    run(sched, arrivals, aborts)
    aborted = {rid for rids in aborts.values() for rid in rids}
    for r in reqs:
        assert r.status is Status.FINISHED and r.pages == []
        if r.finish_reason == "abort":
            assert r.request_id in aborted
        elif r.kind == GENERATE:
            want = expected_tokens(r)[:MAX_MODEL_LEN - len(r.prompt_token_ids)]
            assert r.output_token_ids == want, f"request {r.request_id} lost or changed tokens"
        else:
            assert r.finish_reason == "embedded"
    assert not sched.requests and sched.pages.num_free == cfg.num_pages - 1
    if cfg.batching.startswith("feather"):
        cht = sched.batching.cht
        assert not cht.running and not cht.waiting and not cht.count and not cht.waiters


def test_radix_tree_matches_longest_prefixes_and_forgets_removed_ones():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4])
    tree.insert([1, 2, 5])
    assert [tree.match(t) for t in ([1, 2, 3, 9], [1, 2, 5, 6], [7], [1, 2])] == [3, 3, 0, 2]
    tree.remove([1, 2, 3, 4])
    assert tree.match([1, 2, 3, 4]) == 2 and tree.match([1, 2, 5]) == 3
    tree.remove([1, 2, 5])
    assert tree.match([1, 2, 5]) == 0 and not tree.root.children


def test_lpm_admits_the_longest_match_with_the_running_batch_first():
    prefix = list(range(1, 33))
    sched = Scheduler(config(batching="lpm", token_budget=64, chunk_size=64, max_chunk_seqs=1,
                             page_size=4, num_pages=200, max_model_len=128))
    sched.add(shared(0, prefix, 4, 8))
    out = sched.schedule()
    sched.update(out, fake_runner(out))
    sched.add(Request(1, [200 + i for i in range(36)], 8))  # arrives first, shares nothing
    sched.add(shared(2, prefix, 4, 8))
    out = sched.schedule()
    assert [it.request_id for it in out.items if it.kind != "decode"] == [2]


def drive_steps(sched, n):
    for _ in range(n):
        out = sched.schedule()
        sched.update(out, fake_runner(out))


def test_feather_admits_group_mates_first_and_ages_in_a_request_that_shares_nothing():
    prefix = list(range(1, 65))
    cfg = config(batching="feather", token_budget=64, chunk_size=64, max_num_seqs=12,
                 max_chunk_seqs=1, page_size=4, num_pages=400, max_model_len=256,
                 feather=FeatherConfig(chunk_pages=2, loss_limit=0, floor=1, aging_steps=12))
    sched = Scheduler(cfg)
    sched.add(shared(0, prefix, 2, 100))
    drive_steps(sched, 2)  # request 0 runs
    sched.add(Request(1, [900 + i for i in range(66)], 50))  # shares nothing
    for rid in range(2, 10):
        sched.add(shared(rid, prefix, 2, 100))
    admitted = {}
    for step in range(1, 30):
        before = {r.request_id for r in sched.running}
        drive_steps(sched, 1)
        admitted.update((r.request_id, step) for r in sched.running if r.request_id not in before)
    order = sorted(admitted, key=admitted.get)
    assert order[:4] == [2, 3, 4, 5], "group-mates first"
    assert 1 in admitted and admitted[1] <= 12 + 1, f"aged in at step {admitted.get(1)} > 13"
    assert order.index(1) < order.index(9), "aging puts it ahead of later group-mates"


def test_feather_does_not_hold_the_queue_behind_a_group_mate_the_scheduler_skipped():
    """Two groups run (the batch has no common prefix); a group-mate of one waits, and a
    request that shares nothing. The group-mate goes first; when the scheduler cannot admit
    it this step (its prefix page still in flight), the other is offered next, not held
    behind it (in the simulator's 16-group trace such holds left steps at 134 of 256
    tokens with 4 requests waiting)."""
    cfg = config(batching="feather", token_budget=64, chunk_size=64, max_num_seqs=8,
                 max_chunk_seqs=2, page_size=4, num_pages=200, max_model_len=128,
                 feather=FeatherConfig(chunk_pages=2, loss_limit=0, floor=1))
    feather = make_batching(cfg)
    p, q = list(range(1, 17)), list(range(101, 117))
    running = [shared(0, p, 2, 8), shared(1, q, 2, 8)]
    mate, stranger = shared(2, p, 3, 8), Request(3, [500 + i for i in range(18)], 8)
    for r in running + [mate, stranger]:
        feather.add(r)
    for r in running:
        feather.admitted(r)
    feather.begin_step()
    offered = feather.order([mate, stranger])
    assert next(offered) is mate  # shares 2 chunks with the batch
    assert next(offered, None) is stranger  # mate not admitted: the next one is offered
    assert not feather.refused
    feather.admitted(stranger)
    offered.close()  # the step ends
    assert feather.cht.find_best().request is mate  # waiting still, the best still


def test_feather_without_sharing_is_fcfs():
    cfg = config(batching="feather", token_budget=32, chunk_size=32, max_num_seqs=4,
                 max_chunk_seqs=2, page_size=4, num_pages=200, max_model_len=128)
    sched = Scheduler(cfg)
    for rid in range(6):
        sched.add(Request(rid, [1 + 40 * rid + i for i in range(20 - rid)], 3))
    first = []
    while sched.has_work():
        out = sched.schedule()
        first += [it.request_id for it in out.items if it.start == 0]
        sched.update(out, fake_runner(out))
    assert first == list(range(6))


def synthetic(best: int, rng: random.Random):
    """Round rewards: the best arm 1.0, the others 0.5-0.8, each with 5% noise."""
    return lambda arm: max(rng.gauss(1.0 if arm == best else 0.5 + 0.1 * (arm % 4), 0.05), 0.0)


def test_bandit_picks_the_best_arm_after_warm_up_and_follows_a_switch():
    rng = random.Random(0)
    bandit = SlidingWindowUCB(9, window=64, c=1.0)
    reward = synthetic(4, rng)
    picks = []
    for t in range(400):
        arm = bandit.choose()
        bandit.reward(arm, reward(arm))
        picks.append(arm)
    after = picks[100:]
    assert after.count(4) / len(after) >= 0.8, f"{after.count(4) / len(after)=:.2f}"
    reward = synthetic(7, rng)  # the workload changes
    picks = []
    for t in range(400):
        arm = bandit.choose()
        bandit.reward(arm, reward(arm))
        picks.append(arm)
    late = picks[64:]  # one window after the switch
    assert late.count(7) / len(late) >= 0.8, f"{late.count(7) / len(late)=:.2f}"


def play(bandit, reward, rounds: int) -> tuple:
    """(the arms picked, the rewards they got), round by round."""
    picks, got = [], []
    for _ in range(rounds):
        arm = bandit.choose()
        picks.append(arm)
        got.append(reward(arm))
        bandit.reward(arm, got[-1])
    return picks, got


def test_conservative_bandit_loses_at_most_its_margin_to_the_baseline():
    """The baseline arm (fcfs's) is the best: plain UCB keeps trying the 8 others and gives up
    ~4.5% of the reward; the conservative rule keeps the loss within its 3% margin."""
    for seed in range(3):
        conservative = SlidingWindowUCB(9, window=64, c=1.0, baseline=8, margin=0.03)
        _, got = play(conservative, synthetic(8, random.Random(seed)), 1000)
        assert statistics.mean(got[100:]) >= 0.97, f"{seed=}: {statistics.mean(got[100:])=}"
        _, plain = play(SlidingWindowUCB(9, window=64, c=1.0), synthetic(8, random.Random(seed)),
                        1000)
        assert statistics.mean(plain[100:]) < 0.97  # the rule is what keeps the margin


def test_conservative_bandit_still_finds_a_better_arm_and_follows_switches():
    rng = random.Random(0)
    bandit = SlidingWindowUCB(9, window=64, c=1.0, baseline=8, margin=0.03)
    for best, skip in ((4, 100), (7, 64), (8, 64)):  # better than the baseline, then it again
        picks, _ = play(bandit, synthetic(best, rng), 400)
        late = picks[skip:]
        assert late.count(best) / len(late) >= 0.8, f"{best=}: {late.count(best) / len(late)=}"


def test_bandit_settings_out_of_range_raise_naming_the_value():
    with pytest.raises(ValueError, match="baseline=3"):
        SlidingWindowUCB(3, baseline=3)
    with pytest.raises(ValueError, match="margin=1.0"):
        SlidingWindowUCB(3, baseline=0, margin=1.0)


@pytest.mark.parametrize("seed", range(3))
def test_marginal_cost_is_the_least_squares_slope_within_its_bounds(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 300, size=int(rng.integers(3, 200))).astype(np.float64)
    seconds = 0.014 + 0.0005 * tokens + rng.normal(0, 0.002, tokens.size)
    slope = np.polyfit(tokens, seconds, 1)[0]  # float64 reference
    got = marginal_cost(list(zip(tokens.tolist(), seconds.tolist())))
    assert got == pytest.approx(min(max(slope, 0.0), seconds.mean() / tokens.mean()), rel=1e-9)
    assert marginal_cost([(8, 1.0), (8, 2.0)]) == marginal_cost([(8, 1.0)]) == 0.0
    assert marginal_cost([(1, 1.0), (9, 0.5)]) == 0.0  # a negative slope is no cost
    assert marginal_cost([(1, 0.0), (2, 1.0)]) == pytest.approx(0.5 / 1.5)  # <= mean s/token


def test_held_back_efficiency_is_below_one_unless_the_smaller_batch_was_faster():
    a, b = 0.014, 0.0005  # this CPU's step: 14 ms + 0.5 ms a token
    full = 32 / (a + b * 32)  # tokens/s of the step that runs all 32 decodes
    assert held_back_efficiency(32, a + b * 32, 0, b) == pytest.approx(1.0)
    held = held_back_efficiency(8, a + b * 8, 24, b)  # ran 8, held 24 back
    assert held == pytest.approx((8 / (a + b * 8)) / full) and held < 0.5
    fast = 0.2 * (a + b * 8)  # the 8 ran 5x faster than the cost line: homogeneity paid
    paid = held_back_efficiency(8, fast, 24, b)
    assert paid == pytest.approx((8 / fast) / (32 / (fast + 24 * b))) and paid > 1


def test_feather_bandit_reports_its_arm_and_mean_reward():
    prefix = list(range(1, 33))
    cfg = config(batching="feather-bandit", token_budget=64, chunk_size=32, max_num_seqs=8,
                 page_size=4, num_pages=400, max_model_len=128,
                 feather=FeatherConfig(arms=((0, 4), (None, None)), window=8, round_steps=2))
    sched = Scheduler(cfg)
    for rid in range(8):
        sched.add(shared(rid, prefix, 3, 12))
    while sched.has_work():
        drive_steps(sched, 1)
    stats = sched.batching.stats()
    assert stats["batching"] == "feather-bandit" and stats["rounds"] >= 2
    assert stats["arm"] in ("loss<=0,cap=4", "loss<=any,cap=max")
    assert stats["best_mean_reward"] > 0  # tokens per step: the fake runner times nothing


def test_feather_bandit_scores_a_round_by_what_its_arm_held_back():
    """A step costs 14 ms + 0.5 ms a token, as on this CPU. One group runs; a second arrives.
    The loss <= 0 round refuses it (fcfs would have admitted all 3): that round scores its
    tokens/s over what it would have made with them, below 1; the `any` rounds hold nothing
    back and score 1."""
    def timed(out):
        tokens = sum(it.num_tokens for it in out.items)
        return dataclasses.replace(fake_runner(out), step_time=0.014 + 0.0005 * tokens)

    cfg = config(batching="feather-bandit", token_budget=64, chunk_size=32, max_num_seqs=8,
                 page_size=4, num_pages=400, max_model_len=256,
                 feather=FeatherConfig(chunk_pages=1, floor=2, arms=((0, None), (None, None)),
                                       window=8, round_steps=2, margin=None))
    sched = Scheduler(cfg)
    for rid in range(3):
        sched.add(shared(rid, list(range(1, 17)), 2, 30))
    for rid in range(3, 6):
        if rid == 3:
            for _ in range(3):  # the first group admitted, decoding under loss <= 0
                out = sched.schedule()
                sched.update(out, timed(out))
            assert sched.batching.arm == Arm(0, None) and not sched.batching.bandit.history
        sched.add(shared(rid, list(range(100, 116)), 2, 30))
    for _ in range(6):
        out = sched.schedule()
        sched.update(out, timed(out))
    (first_arm, first), *rest = sched.batching.bandit.history
    assert first_arm == 0 and 0 < first < 0.9, first  # it held 3 admissions back
    assert rest and all(arm == 1 and value == pytest.approx(1.0) for arm, value in rest), rest


def test_feather_bandit_learns_nothing_from_rounds_no_arm_could_change():
    """One request decoding alone, nothing waiting: every arm runs the same steps, so those
    rounds reward nothing (a warm-up's or a drain's lone request must not score the arm that
    happened to be playing); once two groups compete, the rounds count."""
    cfg = config(batching="feather-bandit", token_budget=64, chunk_size=32, max_num_seqs=8,
                 page_size=4, num_pages=400, max_model_len=256,
                 feather=FeatherConfig(window=8, round_steps=2))
    sched = Scheduler(cfg)
    sched.add(shared(0, list(range(1, 33)), 3, 40))
    drive_steps(sched, 12)
    assert sched.batching.bandit.t == 0
    for rid, first in ((1, 100), (2, 100), (3, 200), (4, 200)):  # two groups, two each
        sched.add(shared(rid, list(range(first, first + 32)), 3, 20))
    drive_steps(sched, 8)
    assert sched.batching.bandit.t >= 2


def test_an_unknown_batching_name_raises_naming_it():
    with pytest.raises(ValueError,
                       match="batching='sjf' is not a batching policy; expected one of fcfs"):
        Scheduler(config(batching="sjf"))


@pytest.mark.parametrize("kwargs, match", [
    (dict(chunk_pages=0), "chunk_pages=0"),
    (dict(arms=()), "no arms"),
    (dict(arms=((0, 0),)), "cap=0"),
    (dict(arms=((-1, 8),)), "loss_limit=-1"),
    (dict(arms="0,8"), "not a string"),
    (dict(arms=((0,),)), r"bad bandit arm \(0,\)"),
    (dict(arms=((0, 8), (0, 8))), "repeat"),
    (dict(loss_limit=1.5), "loss_limit=1.5"),
    (dict(window=2), "window=2"),
    (dict(margin=1.0), "margin=1.0"),
    (dict(margin="3%"), "margin='3%'"),
])
def test_bad_feather_settings_raise_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FeatherConfig(**kwargs)


def test_arms_print_their_limits():
    assert [str(a) for a in make_arms([(0, 8), (None, None)])] == ["loss<=0,cap=8",
                                                                    "loss<=any,cap=max"]
    assert make_arms([Arm(2, 16)]) == (Arm(2, 16),)
