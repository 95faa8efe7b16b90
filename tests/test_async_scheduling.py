"""Async scheduling (step N+1 scheduled and packed while N runs) changes speed, never results.

The engine with `async_scheduling` on equals it off (tiny preset): greedy tokens and
log-probs (fp32, 1e-5), seeded samples with top-k/p and penalties, n, stop tokens and stop
strings that end requests mid-stream (dead rows in the next step), embeddings, prefix-cache
hits, preemptions and cascade steps, aborts between steps, a NaN row and a culprit item that
fail alone, and the per-step deltas a front streams. On the host alone (fake runner), the
scheduler driven ahead (`advance`, schedule the next step, `settle`) produces what it produces
in sequence, over random mixes that preempt, and leaves the pool clean.
"""
import dataclasses
import itertools
import random

import numpy as np
import pytest

from hetero_jax import EmbedRequest, Engine, EngineConfig, GenerateRequest, PoolingParams, \
    SamplingParams
from hetero_jax.models import llama
from hetero_jax.models.presets import preset_config
from hetero_jax.models.tokenizer import ByteTokenizer
from hetero_jax.sched import Scheduler, SchedulerConfig
from hetero_jax.sched.advance import PLACEHOLDER
from tests.sched_fakes import emb, expected_tokens, fake_runner, gen

CFG = dict(token_budget=64, chunk_size=16, max_num_seqs=8, max_model_len=256,
           token_buckets=(16, 64), page_buckets=(4, 16))
GREEDY = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, logprobs=2)
RNG = np.random.default_rng(31)
PREFIX = RNG.integers(3, 250, 40).tolist()
PROMPTS = [PREFIX + RNG.integers(3, 250, n).tolist() for n in (3, 9, 30)] + [[256, 5, 6, 7],
                                                                              [256, 9]]


def engines(**kw):
    return {on: Engine.from_preset("tiny", config=EngineConfig(**dict(CFG, **kw),
                                                               async_scheduling=on))
            for on in (False, True)}


@pytest.fixture(scope="module")
def pair():
    return engines()


def assert_same(a, b):
    assert (a.finish_reason, type(a).__name__) == (b.finish_reason, type(b).__name__)
    if hasattr(a, "embedding"):
        np.testing.assert_allclose(a.embedding, b.embedding, rtol=1e-5, atol=1e-6)
        return
    assert a.token_ids == b.token_ids and a.text == b.text
    if a.logprobs:
        np.testing.assert_allclose([t["logprob"] for t in a.logprobs],
                                   [t["logprob"] for t in b.logprobs], rtol=1e-5, atol=1e-5)


def mix(engine) -> list:
    """Greedy, stop-token and stop-string requests that end mid-stream (from a reference run),
    seeded samples with penalties and n, and embeddings, in one batch."""
    ref = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    stop_text = engine.tokenizer.decode(ref[1].token_ids[:4])[-2:]
    sampled = SamplingParams(max_tokens=9, temperature=0.9, top_k=20, top_p=0.9, seed=5, n=2,
                             presence_penalty=0.5, frequency_penalty=0.3,
                             repetition_penalty=1.2, logprobs=1)
    return [GenerateRequest(PROMPTS[0], GREEDY),
            GenerateRequest(PROMPTS[1], SamplingParams(max_tokens=9, temperature=0,
                                                       stop=(stop_text,))),
            GenerateRequest(PROMPTS[2], SamplingParams(
                max_tokens=9, temperature=0, stop_token_ids=(ref[2].token_ids[2],))),
            GenerateRequest(PROMPTS[3], sampled), EmbedRequest(PROMPTS[2], PoolingParams()),
            GenerateRequest(PROMPTS[4], SamplingParams(max_tokens=1, temperature=0)),
            EmbedRequest(PROMPTS[0][:12], PoolingParams(pooling="cls"))]


def test_a_mixed_batch_is_the_same_with_the_overlap_on_and_off(pair):
    reqs = mix(pair[False])
    outs = {on: e.run(reqs, use_tqdm=False) for on, e in pair.items()}
    assert [o.finish_reason for o in outs[False][:3]] == ["length", "stop", "stop"]
    for a, b in zip(outs[False], outs[True]):
        assert_same(a, b)
    again = pair[True].run(reqs, use_tqdm=False)  # now from the prefix cache
    assert pair[True].stats.cache_hit_tokens > 0
    for a, b in zip(outs[False], again):
        assert_same(a, b)
    assert not pair[True].has_work()


def stream(engine, reqs, abort_at: dict) -> tuple:
    """Step-wise serving: per step, (request id, tokens so far, finished) of each request the
    step finished or progressed; `abort_at`: step -> index of a request aborted after it."""
    handles = engine.add(reqs)
    index = {h.request_id: i for i, h in enumerate(handles)}
    trace, step = [], 0
    while engine.has_work():
        out = engine.step()
        trace.append(sorted([(index[r.request_id], len(r.output_token_ids), True)
                             for r in out.finished] + [
            (index[r.request_id], len(r.output_token_ids), False) for r in out.progressed]))
        if step in abort_at:
            engine.abort(handles[abort_at[step]].request_id)
        step += 1
    return trace, [engine.output(h) for h in handles]


def test_per_step_deltas_and_aborts_are_the_same(pair):
    reqs = mix(pair[False])
    reqs = [r for r in reqs if not (isinstance(r, GenerateRequest) and r.params.n > 1)]
    got = {on: stream(e, reqs, {2: 0, 3: 2}) for on, e in pair.items()}
    assert got[False][0] == got[True][0]
    assert got[False][1][0].finish_reason == "abort"
    for a, b in zip(got[False][1], got[True][1]):
        assert_same(a, b)


def test_the_host_prepares_the_next_step_while_one_runs(pair, monkeypatch):
    """By the order of the calls: with the overlap, step N+1 is scheduled, packed and launched
    after N is launched and before N is waited on (its tokens of N are read on the device),
    and N's results are settled after that; without it each step runs schedule, launch,
    collect, settle in turn."""
    for on, engine in pair.items():
        calls = []
        for obj, name in ((engine.scheduler, "schedule"), (engine.scheduler, "settle"),
                          (engine.runner, "launch"), (engine.runner, "collect")):
            def wrapped(*args, _fn=getattr(obj, name), _name=name, **kw):
                calls.append(_name)
                return _fn(*args, **kw)
            monkeypatch.setattr(obj, name, wrapped)
        engine.generate([[256, 5, 6], [256, 40]], SamplingParams(max_tokens=6, temperature=0,
                                                                 ignore_eos=True), use_tqdm=False)
        monkeypatch.undo()
        cycle = (["launch", "schedule", "launch", "collect", "settle"] if on else
                 ["schedule", "launch", "collect", "settle"])
        steady = calls[1:1 + len(cycle)] if on else calls[:len(cycle)]
        assert steady == cycle, calls


def test_a_drained_step_dispatches_nothing_ahead_and_changes_no_output(pair, monkeypatch):
    """`Engine.step(drain=True)` (the bench's time slices end a turn with it) collects the
    step in flight without scheduling or launching the next; draining every other step gives
    the tokens of an undrained run."""
    engine = pair[True]
    ref = [o.token_ids for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]
    calls = []
    for obj, name in ((engine.scheduler, "schedule"), (engine.runner, "launch")):
        def wrapped(*args, _fn=getattr(obj, name), _name=name, **kw):
            calls.append(_name)
            return _fn(*args, **kw)
        monkeypatch.setattr(obj, name, wrapped)
    handles = engine.add([GenerateRequest(p, GREEDY) for p in PROMPTS])
    drained = 0
    for step in itertools.count():
        if not engine.has_work():
            break
        calls.clear()
        engine.step(drain=step % 2 == 1)
        if step % 2 == 1:
            assert calls == [], f"step {step} dispatched {calls}"
            drained += 1
    monkeypatch.undo()
    assert drained >= 3
    assert [engine.output(h).token_ids for h in handles] == ref


@pytest.mark.slow
def test_preemptions_and_cascade_steps_are_the_same():
    pair = engines(num_pages=20, cascade_min_pages=1, cascade_rows=4)
    params = SamplingParams(max_tokens=36, temperature=0, ignore_eos=True, logprobs=1)
    reqs = [GenerateRequest(PREFIX[:20 + i] + [7 + i], params) for i in range(8)]
    outs = {on: e.run(reqs, use_tqdm=False) for on, e in pair.items()}
    for on, e in pair.items():
        assert e.stats.preemptions > 0 and e.stats.cascade_steps > 0, (on, e.stats)
    for a, b in zip(outs[False], outs[True]):
        assert_same(a, b)


def test_a_nan_row_and_a_broken_item_fail_alone_the_same(monkeypatch):
    cfg, params = preset_config("tiny"), llama.init_params(preset_config("tiny"), 0)
    params = dict(params, embed=params["embed"].at[7].set(np.nan))
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [4, 5], [9, 9]]
    outs = {}
    for on in (False, True):
        engine = Engine(cfg, params, ByteTokenizer(), EngineConfig(**CFG, async_scheduling=on))
        process = engine.inputs.process

        def broken(i, request, request_id, process=process):
            req = process(i, request, request_id)
            if i == 3:  # past validation with a knob no check passes: fails alone at packing
                req.knobs = dataclasses.replace(req.knobs, top_k=2**40)
            return req
        monkeypatch.setattr(engine.inputs, "process", broken)
        outs[on] = engine.generate(prompts, greedy, use_tqdm=False)
        s = engine.scheduler
        assert not s.requests and s.pages.num_free == s.cfg.num_pages - 1
    assert [o.finish_reason for o in outs[True]] == ["length", "error", "length", "error"]
    assert "not finite" in outs[True][1].error
    for a, b in zip(outs[False], outs[True]):
        assert (a.token_ids, a.finish_reason, a.error) == (b.token_ids, b.finish_reason, b.error)


# -- the scheduler driven ahead, on the host alone --------------------------------------------

def run_ahead(sched: Scheduler, reqs: list) -> list:
    """Serve `reqs` as the async engine does: advance step N, schedule N+1 (its decode tokens
    of N's samples are placeholders), then settle N; -> every step's finished requests."""
    for req in reqs:
        sched.add(req)
    finished, nxt = [], None
    while nxt is not None or sched.has_work():
        out = nxt or sched.schedule()
        assert out.items or out.encoder_items, "an empty step while requests are pending"
        ahead = sched.advance(out)
        nxt = sched.schedule() if sched.has_work() else None
        for it in nxt.items if nxt else ():
            holes = [t == PLACEHOLDER for t in it.token_ids]
            assert not any(holes[:-1]), f"a placeholder before an item's last token: {it}"
            assert holes[-1] == (it.request_id in ahead.sampled and it.kind == "decode")
        finished += sched.settle(ahead, fake_runner(out))
        nxt = nxt if nxt and (nxt.items or nxt.encoder_items) else None
    return finished


@pytest.mark.parametrize("seed", range(6))
def test_the_scheduler_driven_ahead_produces_what_it_does_in_sequence(seed):
    rnd = random.Random(seed)
    cfg = SchedulerConfig(token_budget=48, chunk_size=16, max_num_seqs=6, page_size=8,
                          num_pages=rnd.choice([16, 40, 400]), max_model_len=160,
                          policy=rnd.choice(["fcfs", "ibs", "homogeneous"]),
                          prefix_caching=rnd.random() < 0.5)
    specs = [(rnd.random() < 0.3, rnd.randint(1, 60), rnd.randint(1, 20)) for _ in range(14)]
    reqs = [emb(i, n) if is_emb else gen(i, n, m) for i, (is_emb, n, m) in enumerate(specs)]
    for req in reqs[::3]:
        if not req.is_embed:  # stop tokens that end some requests early
            req.stop_token_ids = frozenset(expected_tokens(req)[len(req.prompt_token_ids) % 3:][:1])
    sched = Scheduler(cfg)
    finished = run_ahead(sched, reqs)
    assert sorted(r.request_id for r in finished) == list(range(len(reqs)))
    for req in reqs:
        if req.is_embed:
            assert req.embedding == ("vec", req.request_id) and req.finish_reason == "embedded"
        else:
            want = expected_tokens(req)
            assert req.output_token_ids == want
            assert req.finish_reason == ("stop" if want[-1] in req.stop_token_ids else "length")
    assert not sched.has_work() and sched.pages.num_free == cfg.num_pages - 1
    assert sched.slots.num_free == cfg.max_num_seqs and not any(sched.pending.values())
