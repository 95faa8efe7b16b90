"""Embedding requests, preemption and aborts in the host scheduler; it imports no jax."""
import subprocess
import sys

import pytest

from hetero_jax.sched import (DECODE, EMBED, GENERATE, PREFILL, RunnerOutput, Scheduler, Status)
from tests.sched_fakes import config, drive, emb, expected_tokens, fake_runner, gen


@pytest.mark.parametrize("modules", ["hetero_jax.sched, hetero_jax.sim",
                                     "hetero_jax, hetero_jax.requests, hetero_jax.outputs, "
                                     "hetero_jax.config"])
def test_host_modules_and_user_types_import_no_jax(modules):
    code = f"import sys, {modules}; assert 'jax' not in sys.modules, 'imported jax'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_embedding_runs_in_chunks_and_frees_its_pages_after_the_last_one():
    sched = Scheduler(config(policy="ibs", token_budget=32, chunk_size=16, page_size=4))
    req = emb(0, 40)
    sched.add(req)
    free0 = sched.pages.num_free
    steps = []
    for _ in range(3):
        out = sched.schedule()
        ((it,),) = [out.items]
        steps.append((it.kind, it.start, it.num_tokens, it.samples, it.ends))
        assert len(req.pages) == 10 and sched.pages.num_free == free0 - 10, "whole input held"
        finished = sched.update(out, fake_runner(out))
    assert steps == [(EMBED, 0, 16, False, False), (EMBED, 16, 16, False, False),
                     (EMBED, 32, 8, False, True)]
    assert finished == [req] and req.finish_reason == "embedded" and req.embedding == ("vec", 0)
    assert req.pages == [] and sched.pages.num_free == free0 and not sched.has_work()
    assert req.output_token_ids == [] and req.status is Status.FINISHED


def test_one_step_holds_embed_chunks_then_prefill_chunks_then_decodes():
    sched = Scheduler(config(policy="fcfs", token_budget=64, chunk_size=8, max_chunk_seqs=3))
    sched.add(gen(0, 8, 4))
    out = sched.schedule()
    sched.update(out, fake_runner(out))
    for req in [gen(1, 20, 2), emb(2, 20), emb(3, 20)]:
        sched.add(req)
    out = sched.schedule()
    assert [(it.request_id, it.kind) for it in out.items] == [
        (2, EMBED), (3, EMBED), (1, PREFILL), (0, DECODE)]
    assert sum(it.kind != DECODE for it in out.items) == 3, "embed chunks count as chunks"


def test_embedding_waits_for_the_pages_of_its_whole_input():
    sched = Scheduler(config(policy="ibs", token_budget=64, chunk_size=16, page_size=4,
                             num_pages=9))
    trace = drive(sched, {0: [emb(0, 24), emb(1, 12), gen(2, 4, 1)]})
    first = [(it.request_id, it.kind, it.num_tokens) for it in trace[0][1].items]
    assert first == [(0, EMBED, 16), (2, PREFILL, 4)], "E1 needs 3 pages, 2 are free"
    assert [r.request_id for _, _, fin in trace for r in fin] == [2, 0, 1]


@pytest.mark.parametrize("policy", ["fcfs", "ibs", "homogeneous"])
def test_preemption_takes_the_newest_generation_and_loses_no_token(policy):
    sched = Scheduler(config(policy=policy, token_budget=48, chunk_size=16, page_size=4,
                             num_pages=13, max_num_seqs=6))
    reqs = [gen(i, 6 + i, 8 + i) if i % 3 else emb(i, 8 + i) for i in range(12)]
    for req in reqs:
        sched.add(req)
    preemptions = 0
    while sched.has_work():
        newest_first = [r.request_id for r in reversed(sched.running) if r.kind == GENERATE]
        out = sched.schedule()
        assert out.preempted == newest_first[:len(out.preempted)], "not the newest generation"
        assert not {it.request_id for it in out.items} & set(out.preempted)
        preemptions += len(out.preempted)
        sched.update(out, fake_runner(out))
    assert preemptions > 0, "the cache is meant to be too small"
    for r in reqs:
        if r.kind == EMBED:
            assert r.finish_reason == "embedded" and r.num_preemptions == 0
        else:
            assert r.output_token_ids == expected_tokens(r) and r.finish_reason == "length"
    assert sched.pages.num_free == 12 and sched.pending == {EMBED: 0, GENERATE: 0}


def test_preempted_request_is_recomputed_with_its_output_tokens():
    sched = Scheduler(config(policy="fcfs", token_budget=64, chunk_size=64, page_size=2,
                             num_pages=7))
    a, b = gen(0, 4, 4), gen(1, 4, 4)
    trace = drive(sched, {0: [a, b]})
    (pre_step,) = [s for s, out, _ in trace if out.preempted]
    assert trace[pre_step][1].preempted == [1]
    redo = [it for _, out, _ in trace[pre_step + 1:] for it in out.items
            if it.request_id == b.request_id and it.start == 0]
    assert redo and redo[0].num_tokens > 4, "recompute covers the prompt and the output so far"
    assert b.num_preemptions == 1 and b.output_token_ids == expected_tokens(b)


def test_abort_waiting_running_and_between_schedule_and_update():
    sched = Scheduler(config(policy="ibs", token_budget=32, chunk_size=8, page_size=4))
    reqs = [gen(0, 16, 4), emb(1, 16), gen(2, 8, 2), emb(3, 8)]
    for req in reqs:
        sched.add(req)
    free0 = sched.pages.num_free
    out = sched.schedule()
    scheduled = {it.request_id for it in out.items}
    assert {0, 1} <= scheduled
    sched.abort(1)  # running, scheduled this step
    sched.abort(3)  # still waiting
    sched.abort(99)  # unknown: a no-op
    finished = sched.update(out, fake_runner(out))
    assert reqs[1].finish_reason == "abort" and reqs[1].pages == [] and reqs[1] not in finished
    assert reqs[3].finish_reason == "abort" and reqs[3] not in sched.waiting[EMBED]
    assert reqs[1].num_computed_tokens == 0, "update skips an aborted request"
    drive(sched, {})
    assert [r.finish_reason for r in reqs] == ["length", "abort", "length", "abort"]
    assert sched.pages.num_free == free0 and sched.pending == {EMBED: 0, GENERATE: 0}


def test_update_records_the_runner_embedding_and_stop_tokens():
    sched = Scheduler(config(policy="fcfs"))
    g = gen(0, 4, 10)
    g.stop_token_ids = frozenset({expected_tokens(g)[1]})
    e = emb(1, 4)
    sched.add(g)
    sched.add(e)
    out = sched.schedule()
    fake = fake_runner(out)
    sched.update(out, RunnerOutput(fake.sampled, 0.0, {1: [0.5, 0.5]}))
    assert e.embedding == [0.5, 0.5] and e.finish_reason == "embedded"
    drive(sched, {})
    assert g.finish_reason == "stop" and len(g.output_token_ids) == 2


def test_bad_requests_are_refused():
    sched = Scheduler(config(page_size=4, num_pages=5, max_model_len=64))
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add(gen(0, 4, 0))
    with pytest.raises(ValueError, match="pages"):
        sched.add(emb(1, 20))
    with pytest.raises(ValueError, match="no tokens"):
        sched.add(emb(2, 0))
    sched.add(emb(3, 16))
    with pytest.raises(ValueError, match="already queued"):
        sched.add(emb(3, 4))


def test_items_are_plain_snapshots_and_times_are_stamped_by_update():
    """What crosses to the runner is data (no live Request); pooler slots come from the
    scheduler and go back when the embedding ends; update() stamps first output and finish."""
    sched = Scheduler(config(policy="fcfs", token_budget=32, chunk_size=8, max_num_seqs=2))
    g, e = gen(0, 4, 2), emb(1, 12)
    sched.add(g)
    sched.add(e)
    out = sched.schedule()
    assert all(type(v) in (int, str, bool, tuple, type(None), type(it.knobs))
               for it in out.items for v in it._asdict().values()), "a live object crossed"
    (ei, gi) = out.items
    assert (ei.kind, ei.token_ids, ei.pool_slot, ei.ends) == (EMBED, tuple(e.prompt_token_ids[:8]),
                                                             e.pool_slot, False)
    assert (gi.kind, gi.token_ids, gi.pages) == (PREFILL, tuple(g.prompt_token_ids), tuple(g.pages))
    assert sched.slots.num_free == 1 and g.pool_slot is None
    sched.update(out, fake_runner(out), now=10.0)
    assert g.first_token_time == 10.0 and e.first_token_time is None
    out = sched.schedule()
    assert out.items[0].pool_slot == ei.pool_slot, "the slot is held across chunks"
    finished = sched.update(out, fake_runner(out), now=11.0)
    assert {r.request_id for r in finished} == {0, 1} and sched.slots.num_free == 2
    assert (g.first_token_time, g.finish_time) == (10.0, 11.0)
    assert (e.first_token_time, e.finish_time, e.pool_slot) == (11.0, 11.0, None)


def test_abort_returns_the_pooler_slot():
    sched = Scheduler(config(policy="ibs", token_budget=8, chunk_size=8, max_num_seqs=1))
    a, b = emb(0, 20), emb(1, 4)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [it.request_id for it in out.items] == [0] and sched.slots.num_free == 0
    sched.update(out, fake_runner(out))
    sched.abort(0)
    assert sched.slots.num_free == 1 and a.pool_slot is None
    drive(sched, {})
    assert b.finish_reason == "embedded" and sched.slots.num_free == 1


def encoder_config(**kw):
    return config(encoder_max_seqs=2, token_budget=32, chunk_size=8, page_size=4, **kw)


def test_encoder_items_run_whole_without_pages_or_slots():
    sched = Scheduler(encoder_config(policy="fcfs"))
    free0 = sched.pages.num_free
    reqs = [emb(0, 12), emb(1, 5), emb(2, 3)]
    trace = drive(sched, {0: reqs})
    encoder = [[(it.request_id, it.start, it.num_tokens, it.ends) for it in out.encoder_items]
               for _, out, _ in trace]
    assert encoder == [[(0, 0, 12, True), (1, 0, 5, True)], [(2, 0, 3, True)]], "2 rows a step"
    assert all(out.items == [] for _, out, _ in trace), "no decoder items"
    assert all(r.finish_reason == "embedded" and r.embedding == ("vec", r.request_id)
               for r in reqs)
    assert sched.pages.num_free == free0 and sched.slots.num_free == sched.cfg.max_num_seqs


def test_encoder_tokens_share_the_budget_and_an_oversize_input_runs_alone():
    sched = Scheduler(encoder_config(policy="fcfs"))
    g = gen(0, 16, 2)
    sched.add(g)
    out = sched.schedule()
    sched.update(out, fake_runner(out))  # g decodes from now on
    for req in [emb(1, 20), emb(2, 40)]:
        sched.add(req)
    out = sched.schedule()  # 1 decode + 20 fit the budget of 32; 40 more would not
    assert [it.request_id for it in out.encoder_items] == [1] and len(out.items) == 1
    sched.update(out, fake_runner(out))
    out = sched.schedule()  # 40 > 32, but it is the first multi-token item: it runs, alone
    assert [it.request_id for it in out.encoder_items] == [2] and out.num_tokens == 41
    assert out.decoder_tokens <= 32


def test_homogeneous_never_mixes_encoder_and_decoder_work():
    sched = Scheduler(encoder_config(policy="homogeneous"))
    trace = drive(sched, {0: [gen(0, 20, 4), emb(1, 8), emb(2, 8), gen(3, 4, 3), emb(4, 30)]})
    for _, out, _ in trace:
        assert not (out.items and out.encoder_items), "a step ran both models"
    assert sum(len(out.encoder_items) for _, out, _ in trace) == 3
