"""Hand-computed steps of each policy, and the credit rule of IBS (no jax)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.sched_fakes import config, drive, emb, fake_runner, gen

from hetero_jax.sched import (DECODE, EMBED, GENERATE, PREFILL, Credits, Scheduler, make_policy)


def layout(out):
    """A step as [(request_id, kind, start, num_tokens)]."""
    return [(it.request_id, it.kind, it.start, it.num_tokens) for it in out.items]


@settings(max_examples=200, deadline=None)
@given(w_e=st.integers(1, 1000), w_g=st.integers(1, 1000), k=st.integers(1, 400))
def test_credits_stay_within_one_opportunity_of_the_proportional_share(w_e, w_g, k):
    credits, count_e = Credits(), 0
    for i in range(1, k + 1):
        count_e += credits.pick({EMBED: w_e, GENERATE: w_g}) == EMBED
        share = i * w_e / (w_e + w_g)
        assert abs(count_e - share) <= 1, f"after {i} picks: {count_e=} vs {share=:.3f}"
    assert sum(credits.acc.values()) == 0, f"{credits.acc=} must sum to zero"


def test_credits_hand_computed():
    credits = Credits()
    picks = [credits.pick({EMBED: 1, GENERATE: 2}) for _ in range(6)]
    assert picks == [GENERATE, EMBED, GENERATE, GENERATE, EMBED, GENERATE]
    assert credits.acc == {EMBED: 0, GENERATE: 0}


def test_ibs_hand_computed_steps():
    """Weights are the uncomputed input tokens of each queue; credits persist across steps."""
    sched = Scheduler(config(policy="ibs", token_budget=64, chunk_size=16, max_chunk_seqs=4))
    for req in [emb(0, 32), emb(1, 32), gen(2, 64, 1), gen(3, 16, 1)]:
        sched.add(req)
    # w=(64, 80): a=(64, 80) -> G2, a_g=-64 | w=(64, 64): a=(128, 0) -> E0, a_e=0
    # w=(48, 64): a=(48, 64) -> G3, a_g=-48 | w=(48, 48): a=(96, 0) -> E1, a_e=0
    out = sched.schedule()
    assert layout(out) == [(0, EMBED, 0, 16), (1, EMBED, 0, 16), (2, PREFILL, 0, 16),
                           (3, PREFILL, 0, 16)]
    assert [it.samples for it in out.items] == [False, False, False, True]
    assert [r.request_id for r in sched.update(out, fake_runner(out))] == [3]
    trace = drive(sched, {})
    # w=(32, 48): a=(32, 48) -> G2, a_g=-32 | w=(32, 32): a=(64, 0) -> E0 | only E1 is left
    assert layout(trace[0][1]) == [(0, EMBED, 16, 16), (1, EMBED, 16, 16), (2, PREFILL, 16, 16)]
    assert [r.finish_reason for r in trace[0][2]] == ["embedded", "embedded"]
    assert [layout(o) for _, o, _ in trace[1:]] == [[(2, PREFILL, 32, 16)], [(2, PREFILL, 48, 16)]]


def test_fcfs_serves_one_arrival_ordered_queue():
    sched = Scheduler(config(policy="fcfs", token_budget=48, chunk_size=16, max_chunk_seqs=3))
    for req in [gen(0, 32, 2), emb(1, 16), gen(2, 16, 1), emb(3, 16)]:
        sched.add(req)
    trace = drive(sched, {})
    assert [layout(o) for _, o, _ in trace] == [
        [(1, EMBED, 0, 16), (0, PREFILL, 0, 16), (2, PREFILL, 0, 16)],
        [(3, EMBED, 0, 16), (0, PREFILL, 16, 16)],
        [(0, DECODE, 32, 1)],
    ]


def test_fcfs_head_of_line_blocks_later_requests():
    """A head whose pages are not free stops admission even if a later request would fit."""
    sched = Scheduler(config(policy="fcfs", token_budget=64, chunk_size=64, page_size=4,
                             num_pages=11))
    sched.add(gen(0, 24, 4))  # 6 pages now, up to 7 with its output
    sched.add(emb(1, 24))  # needs all 6 pages of its input at admission: only 4 are free
    sched.add(gen(2, 4, 1))  # 1 page would fit, but arrived after the embedding
    assert layout(sched.schedule()) == [(0, PREFILL, 0, 24)]
    ibs = Scheduler(config(policy="ibs", token_budget=64, chunk_size=64, page_size=4,
                           num_pages=11))
    for req in [gen(0, 24, 4), emb(1, 24), gen(2, 4, 1)]:
        ibs.add(req)
    assert layout(ibs.schedule()) == [(0, PREFILL, 0, 24), (2, PREFILL, 0, 4)]


def test_ibs_interleaves_where_fcfs_blocks_embeddings():
    """Embeddings behind long prefills: IBS finishes them early, FCFS after all prefills."""
    def embed_finish_steps(policy, thin_batch=0.0):
        sched = Scheduler(config(policy=policy, token_budget=32, chunk_size=16, max_chunk_seqs=2,
                                 thin_batch=thin_batch))
        trace = drive(sched, {0: [gen(0, 64, 4), gen(1, 64, 4), emb(2, 16), emb(3, 16)]})
        return [s for s, _, fin in trace for r in fin if r.kind == EMBED]
    assert embed_finish_steps("ibs") == [1, 3]  # Algorithm 2 as published
    assert embed_finish_steps("fcfs") == [4, 5]  # step 4: 2 decodes, E2 16, E3 14 of 16
    # thin batch (2 of 32 slots < 16): the prompts lead two selections (one step's chunks),
    # then the credits give E2 one; E3 waits for the lead to pass again
    assert embed_finish_steps("ibs", 0.5) == [1, 5]


def thin_and_paper_steps(thin_batch):
    sched = Scheduler(config(policy="ibs", token_budget=48, chunk_size=16, max_chunk_seqs=3,
                             max_num_seqs=4, thin_batch=thin_batch))
    for req in [emb(0, 64), emb(1, 64), gen(2, 16, 3), gen(3, 16, 3)]:
        sched.add(req)
    return sched, layout(sched.schedule())


def test_ibs_leads_with_generation_prefill_while_the_batch_is_thin():
    """Below thin_seqs running generations a generation head takes the selection, whatever
    the credits; at thin_seqs the credits decide again (hand-computed)."""
    sched, steps = thin_and_paper_steps(0.5)
    assert sched.policy.thin_seqs == 2
    # G2, G3 lead (0, then 1 generation running); no generation head left -> E0
    assert steps == [(0, EMBED, 0, 16), (2, PREFILL, 0, 16), (3, PREFILL, 0, 16)]
    assert sched.policy.credits.acc == {EMBED: 0, GENERATE: 0}, "the lead moved the credits"
    # Algorithm 2: w=(128, 32): a=(128, 32) -> E0, a_e=-32 | w=(112, 32): a=(80, 64) -> E1,
    # a_e=-64 | w=(96, 32): a=(32, 96) -> G2
    _, steps = thin_and_paper_steps(0.0)
    assert steps == [(0, EMBED, 0, 16), (1, EMBED, 0, 16), (2, PREFILL, 0, 16)]


def test_the_thin_lead_passes_over_an_embedding_at_most_max_lead_times():
    """Generations that end at their first token keep the batch thin; still an embedding
    that the credits favour gets a selection after max_lead (one step's chunks) led ones."""
    def steps(thin_batch):
        sched = Scheduler(config(policy="ibs", token_budget=16, chunk_size=8, max_chunk_seqs=2,
                                 max_num_seqs=8, thin_batch=thin_batch))
        assert sched.policy.max_lead == 2
        trace = drive(sched, {0: [emb(0, 64)] + [gen(i, 8, 1) for i in range(1, 7)]})
        return [[(it.request_id, it.kind) for it in out.items] for _, out, _ in trace][:3]
    # two led selections, then the credits (w=(64, 32)) -> E0 and the lead is back: G3
    assert steps(0.5) == [[(1, PREFILL), (2, PREFILL)], [(0, EMBED), (3, PREFILL)],
                          [(4, PREFILL), (5, PREFILL)]]
    # Algorithm 2: w=(64, 48) -> E0, then G1; every step holds one of each
    assert steps(0.0) == [[(0, EMBED), (1, PREFILL)], [(0, EMBED), (2, PREFILL)],
                          [(0, EMBED), (3, PREFILL)]]


def test_homogeneous_steps_hold_one_type_and_alternate():
    sched = Scheduler(config(policy="homogeneous", token_budget=64, chunk_size=16))
    trace = drive(sched, {0: [gen(0, 16, 3), emb(1, 48), gen(2, 16, 2)]})
    kinds = [{it.kind for it in out.items} for _, out, _ in trace]
    assert kinds == [{PREFILL}, {EMBED}, {DECODE}, {EMBED}, {DECODE}, {EMBED}]
    assert [r.request_id for _, _, fin in trace for r in fin] == [2, 0, 1]


def test_homogeneous_falls_back_when_the_preferred_type_cannot_run():
    """After a generation step the embedding is preferred, but its 4 pages are not free while
    the generation holds 2-3 of the 5: the generation's decodes run instead, and the
    embedding runs once they have freed their pages."""
    sched = Scheduler(config(policy="homogeneous", token_budget=64, chunk_size=64, page_size=4,
                             num_pages=6))
    trace = drive(sched, {0: [gen(0, 8, 2), emb(1, 16)]})
    assert [layout(out) for _, out, _ in trace] == [
        [(0, PREFILL, 0, 8)],  # no step yet: generation first
        [(0, DECODE, 8, 1)],  # embedding preferred, blocked on pages: fallback
        [(1, EMBED, 0, 16)],  # the generation finished and freed its pages
    ]
    assert [[r.request_id for r in fin] for _, _, fin in trace] == [[], [0], [1]]
    roomy = Scheduler(config(policy="homogeneous", token_budget=64, chunk_size=64, page_size=4,
                             num_pages=16))
    trace = drive(roomy, {0: [gen(0, 8, 2), emb(1, 16)]})
    assert [layout(out) for _, out, _ in trace] == [
        [(0, PREFILL, 0, 8)], [(1, EMBED, 0, 16)], [(0, DECODE, 8, 1)]], "the preference"


def test_dedicated_is_an_engine_mode_not_a_policy():
    with pytest.raises(ValueError, match="'dedicated' is an engine mode"):
        make_policy("dedicated")
    with pytest.raises(ValueError, match="'dedicated' is an engine mode"):
        Scheduler(config(policy="dedicated"))


def test_unknown_policies_are_refused():
    with pytest.raises(ValueError, match="unknown scheduler policy 'round-robin'; expected one "
                                         "of ibs, fcfs, homogeneous"):
        make_policy("round-robin")
    with pytest.raises(ValueError, match="unknown scheduler policy 'round-robin'"):
        Scheduler(config(policy="round-robin"))
