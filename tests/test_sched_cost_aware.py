"""The cost-aware IBS: its split choice against a brute-force comparison of the cost model's
step costs, and that splitting changes when tokens run, never what they are (no jax)."""
import pytest

from hetero_jax.sched import (DECODE, EMBED, GENERATE, PREFILL, ScheduledItem, Scheduler,
                              SchedulerOutput)
from hetero_jax.sched.policies import CostAwareIbsPolicy, cheaper_split, make_policy
from hetero_jax.sched.costmodel import LinearCostModel, StepCost, StepShape
from tests.sched_fakes import config, drive, emb, fake_runner, gen

# A CPU-like step: 40 ms a step, 1.3 ms a padded token, sampled rows and attention pairs.
MODEL = LinearCostModel(0.04, (("attn_pairs", 2.4e-6), ("sampled", 3.7e-4), ("tokens", 1.3e-3)),
                        token_buckets=(16, 32, 64, 128, 256))
COST = StepCost(MODEL, page_size=16)


def item(rid, kind, start, n, ends=False):
    return ScheduledItem(rid, kind, start, n, ends or kind == DECODE)


def brute_force(items):
    """'mixed', or the split when the model's two steps cost strictly less than the one."""
    def seconds(its):
        return MODEL.step_time(StepShape.from_output(SchedulerOutput(its, [])))
    embed = [it for it in items if it.kind == EMBED]
    rest = [it for it in items if it.kind != EMBED]
    if not embed or not rest:
        return "mixed"
    return "split" if seconds(embed) + seconds(rest) < seconds(items) else "mixed"


HAND_BUILT = {
    # 128 embedding tokens + one decode pad to 256 (0.04 + 0.333 s); apart 128 + 16 (0.08 +
    # 0.187 s): split
    "one decode over a full bucket": [item(0, EMBED, 0, 64), item(1, EMBED, 0, 64),
                                      item(2, DECODE, 130, 1)],
    # 240 + 16 = 256 exactly: apart saves no padding and costs a second intercept: mixed
    "decodes fill the bucket": [item(0, EMBED, 0, 64)] * 3 + [item(1, EMBED, 0, 48)]
                               + [item(10 + i, DECODE, 200, 1) for i in range(16)],
    # 64 + 64 = 128, one bucket either way: mixed
    "prefill and embedding in one bucket": [item(0, EMBED, 0, 64), item(1, PREFILL, 0, 64, True)],
    # 65 tokens pad to 128; 64 + 1 to 64 + 16: the saving (48 tokens, 62 ms) beats 40 ms: split
    "a token over a bucket": [item(0, EMBED, 0, 64), item(1, DECODE, 300, 1)],
    "embeddings only": [item(0, EMBED, 0, 64), item(1, EMBED, 64, 64, True)],
    "generation only": [item(0, PREFILL, 0, 64), item(1, DECODE, 10, 1)],
}


@pytest.mark.parametrize("name", HAND_BUILT)
def test_cheaper_split_is_the_brute_force_choice(name):
    items = HAND_BUILT[name]
    parts = cheaper_split(SchedulerOutput(items, []), COST)
    assert ("mixed" if parts is None else "split") == brute_force(items)
    if parts is not None:
        assert [it.kind == EMBED for it in parts[EMBED].items] == [True] * len(parts[EMBED].items)
        assert parts[EMBED].items + parts[GENERATE].items == items  # sorted by kind: no reorder


def test_the_hand_built_steps_cover_both_choices():
    assert {brute_force(items) for items in HAND_BUILT.values()} == {"mixed", "split"}


@pytest.mark.parametrize("embeds,prompts,budget", [
    ((128, 128), (16,), 256), ((64,), (8, 8), 128), ((100, 30), (64, 2), 256),
    ((240,), (), 256), ((16,), (16,), 256)])
def test_the_scheduler_runs_the_part_the_brute_force_choice_keeps(embeds, prompts, budget):
    """The step plain IBS builds, run whole when the model says mixing is cheaper, else the
    part of the step's first selection (the embeddings here, whose backlog is larger)."""
    def sched(step_cost):
        s = Scheduler(config(policy="ibs", token_budget=budget, chunk_size=64, max_chunk_seqs=4,
                             step_cost=step_cost, thin_batch=0.0))  # Algorithm 2's picks
        for i, n in enumerate(embeds):
            s.add(emb(i, n))
        for i, n in enumerate(prompts):
            s.add(gen(10 + i, n, 4))
        return s
    built = sched(None).schedule().items
    ran = sched(COST).schedule().items
    want = built if brute_force(built) == "mixed" else [it for it in built if it.kind == EMBED]
    assert ran == want


def always_split(out):
    """A cost that grows as the square of the items: two parts always cost less."""
    return 1 + len(out.items) ** 2


def test_a_split_changes_when_tokens_run_not_what_they_are():
    """Always splitting, each step holds one type, the kept type alternates from split to
    split, and every request ends as under plain IBS."""
    def run(step_cost):
        s = Scheduler(config(policy="ibs", token_budget=32, chunk_size=16, max_chunk_seqs=2,
                             max_num_seqs=4, page_size=4, num_pages=64, step_cost=step_cost))
        reqs = [emb(0, 40), gen(1, 20, 6), emb(2, 8), gen(3, 5, 3), emb(4, 30)]
        trace = drive(s, {0: reqs[:3], 2: reqs[3:]})
        return s, reqs, trace
    plain, plain_reqs, plain_trace = run(None)
    split, reqs, trace = run(always_split)
    assert isinstance(split.policy, CostAwareIbsPolicy) and split.policy.splits > 0
    assert len(trace) > len(plain_trace)
    kinds = [{it.kind == EMBED for it in out.items} for _, out, _ in trace]
    assert all(len(k) == 1 for k in kinds), "a step held both types"
    assert [(r.output_token_ids, r.embedding, r.finish_reason) for r in reqs] == [
        (r.output_token_ids, r.embedding, r.finish_reason) for r in plain_reqs]


def test_the_kept_type_alternates_from_split_to_split():
    s = Scheduler(config(policy="ibs", token_budget=32, chunk_size=8, max_chunk_seqs=2,
                         step_cost=always_split))
    s.add(emb(0, 64))
    s.add(gen(1, 64, 2))
    kept = []
    for _ in range(4):
        out = s.schedule()
        kept.append(EMBED if out.items[0].kind == EMBED else GENERATE)
        s.update(out, fake_runner(out))
    assert kept[1:] == [GENERATE if k == EMBED else EMBED for k in kept[:-1]], kept


def test_a_step_cost_is_for_ibs_only():
    assert isinstance(make_policy("ibs", always_split), CostAwareIbsPolicy)
    for name in ("fcfs", "homogeneous"):
        with pytest.raises(ValueError, match="for the 'ibs' policy only"):
            make_policy(name, always_split)
    with pytest.raises(ValueError, match="a callable"):
        make_policy("ibs", "calibration/small-cpu.json")
