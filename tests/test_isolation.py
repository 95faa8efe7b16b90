"""One bad request or caller never takes down the others: typed validation, failure isolation,
close, misuse across loops and threads."""
import asyncio
import dataclasses
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetero_jax import (AsyncEngine, EmbedRequest, Engine, EngineConfig, GenerateRequest,
                        PoolingParams, SamplingParams)

CFG = EngineConfig(token_budget=64, chunk_size=16, max_num_seqs=8, max_model_len=256,
                   token_buckets=(16, 64), page_buckets=(4, 16))
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[256, 5, 6, 7], [256, 40, 41], [256, 9]]


@pytest.fixture(scope="module")
def engine():
    return Engine.from_preset("tiny", config=CFG)


@pytest.fixture(scope="module")
def alone(engine):
    """What each prompt generates alone: the reference of every isolation test."""
    return [engine.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]


def assert_clean(engine):
    s = engine.scheduler
    assert not engine.has_work() and not s.requests, "a request was left behind"
    assert s.pages.num_free == s.cfg.num_pages - 1 and s.slots.num_free == s.cfg.max_num_seqs


def break_request(engine, monkeypatch, index: int, **knobs):
    """Requests at `index` come out of validation with `knobs` that no check would pass: the
    engine must still fail them alone (a bug in a check must cost one request)."""
    process = engine.inputs.process

    def broken(i, request, request_id):
        req = process(i, request, request_id)
        if i == index:
            req.knobs = dataclasses.replace(req.knobs, **knobs)
        return req
    monkeypatch.setattr(engine.inputs, "process", broken)


@pytest.mark.parametrize("knobs, where", [(dict(top_k=2**40), "step"),
                                           (dict(logprobs=2.5), "output")])
def test_a_request_that_breaks_after_validation_fails_alone_in_run(engine, alone, monkeypatch,
                                                                    knobs, where):
    break_request(engine, monkeypatch, 1, **knobs)
    outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert outs[1].finish_reason == "error" and "request" in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == [alone[0], alone[2]]
    assert_clean(engine)


def test_a_request_that_breaks_fails_alone_in_the_async_front(engine, alone, monkeypatch):
    break_request(engine, monkeypatch, 0, top_k=2**40)

    async def main():
        aengine = AsyncEngine(engine)
        try:
            return await asyncio.gather(*(aengine.generate(p, GREEDY) for p in PROMPTS),
                                        return_exceptions=True)
        finally:
            await aengine.close()

    outs = asyncio.run(asyncio.wait_for(main(), 120))
    assert all(isinstance(o, RuntimeError) and "OverflowError" in str(o) for o in outs), outs
    monkeypatch.undo()
    break_request(engine, monkeypatch, 0, logprobs=2.5)  # every submit is index 0 here

    async def mixed():
        aengine = AsyncEngine(engine)
        try:
            bad = asyncio.ensure_future(aengine.generate(PROMPTS[0], GREEDY))
            await asyncio.sleep(0)
            monkeypatch.undo()
            good = await asyncio.gather(*(aengine.generate(p, GREEDY) for p in PROMPTS[1:]))
            return good, await asyncio.gather(bad, return_exceptions=True)
        finally:
            await aengine.close()

    good, (bad,) = asyncio.run(asyncio.wait_for(mixed(), 120))
    assert isinstance(bad, RuntimeError) and "TypeError" in str(bad)
    assert [o.token_ids for o in good] == alone[1:]
    assert_clean(engine)


def test_a_stream_whose_delta_breaks_fails_alone_at_once(engine, alone, monkeypatch):
    """A streamed generation whose delta cannot be built (its log-probs, broken after the
    checks) fails in that step, not when its 200 tokens are done; the others go on."""
    from hetero_jax.serving.drive import Drive

    break_request(engine, monkeypatch, 0, logprobs=2.5)
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    bad = engine.prepare([GenerateRequest(PROMPTS[0], long)])[0]
    monkeypatch.undo()
    good = engine.prepare([GenerateRequest(p, GREEDY) for p in PROMPTS[1:]])
    drive = Drive(engine)
    assert drive.queue([("bad", bad)] + list(zip("xy", good)), stream=True) == []
    steps, done, deltas = engine.stats.steps, {}, {"x": [], "y": []}
    while len(drive):
        step_deltas, finished = drive.step_with_deltas()
        done.update(finished)
        for tag, d in step_deltas:
            deltas[tag] += d.token_ids
    assert done["bad"].output.finish_reason == "error" and "TypeError" in done["bad"].output.error
    assert engine.stats.steps - steps < 20, "the broken stream ran on"
    assert [done[t].output.token_ids for t in "xy"] == alone[1:]
    assert all(deltas[t] == alone[i + 1][:len(deltas[t])] for i, t in enumerate("xy"))
    assert_clean(engine)


def test_an_error_of_no_single_request_fails_all_and_the_front_keeps_serving(engine, alone,
                                                                            monkeypatch):
    def lost(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "launch", lost)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_clean(engine)

    async def main():
        aengine = AsyncEngine(engine)
        try:
            failed = await asyncio.gather(*(aengine.generate(p, GREEDY) for p in PROMPTS),
                                          return_exceptions=True)
            monkeypatch.undo()
            return failed, await aengine.generate(PROMPTS[0], GREEDY)
        finally:
            await aengine.close()

    failed, after = asyncio.run(asyncio.wait_for(main(), 120))
    assert all(str(e) == "device lost" for e in failed)
    assert after.token_ids == alone[0]
    assert_clean(engine)


def test_close_fails_what_is_in_flight_and_frees_it(engine):
    async def main():
        aengine = AsyncEngine(engine)
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        tasks = [asyncio.ensure_future(aengine.generate(p, long)) for p in PROMPTS]
        await asyncio.sleep(0.3)
        tasks[0].cancel()  # an abort still queued when close() comes
        await aengine.close()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        with pytest.raises(RuntimeError, match="closed"):
            await aengine.generate("too late")
        return results

    results = asyncio.run(asyncio.wait_for(main(), 120))
    assert isinstance(results[0], asyncio.CancelledError)
    assert all(isinstance(r, RuntimeError) and "closed" in str(r) for r in results[1:])
    assert_clean(engine)
    steps = engine.stats.steps
    engine.generate(["next"], SamplingParams(max_tokens=1), use_tqdm=False)
    assert engine.stats.steps - steps == 1, "an orphan request ran on"


def test_one_async_engine_serves_one_event_loop(engine):
    aengine = AsyncEngine(engine)
    first = asyncio.new_event_loop()
    stream = aengine.generate(PROMPTS[0], SamplingParams(max_tokens=50))
    task = first.create_task(stream.output())
    first.run_until_complete(asyncio.sleep(0.05))
    with pytest.raises(RuntimeError, match="make one AsyncEngine per event loop"):
        asyncio.run(aengine.generate(PROMPTS[1], GREEDY).output())
    with pytest.raises(RuntimeError, match="serving other requests"):
        engine.generate(PROMPTS[:1], GREEDY, use_tqdm=False)  # the async request is in flight
    first.run_until_complete(task)
    first.run_until_complete(aengine.close())
    first.close()
    assert_clean(engine)


def test_threads_take_turns(engine, alone):
    results, errors = {}, []

    def call(i):
        try:
            results[i] = [o.token_ids for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and all(results[i] == alone for i in range(3))
    assert_clean(engine)


@pytest.mark.parametrize("kw, match", [
    (dict(max_tokens=1.5), "max_tokens=1.5 must be an integer"),
    (dict(max_tokens=True), "max_tokens=True must be an integer"),
    (dict(top_k=2**31), r"top_k=2147483648 must be in \[0, 2147483647\]"),
    (dict(logprobs=2.5), "logprobs=2.5 must be an integer"),
    (dict(seed="7"), "seed='7' must be an integer"),
    (dict(ignore_eos="no"), "ignore_eos='no' must be True or False"),
    (dict(stop_token_ids="ab"), "stop_token_ids='ab' must be a list"),
    (dict(stop_token_ids=[10**20]), r"stop_token_ids\[0\]=100000000000000000000 must be in"),
    (dict(temperature=float("inf")), "temperature=inf must be finite"),
    (dict(top_p="1"), "top_p='1' must be a number")])
def test_sampling_knobs_are_typed(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw, match", [
    (dict(truncate="no"), "truncate='no' must be True or False"),
    (dict(normalize="no"), "normalize='no' must be True or False"),
    (dict(adapter=3), "adapter=3 must be an adapter name")])
def test_pooling_knobs_are_typed(kw, match):
    with pytest.raises(ValueError, match=match):
        PoolingParams(**kw)


@pytest.mark.parametrize("kw, match", [
    (dict(max_model_len=0), r"max_model_len=0 must be in \[1, "),
    (dict(kv_cache_gib=-1), "kv_cache_gib=-1 must be > 0"),
    (dict(max_logprobs=-1), r"max_logprobs=-1 must be in \[0, "),
    (dict(token_budget=64.0), "token_budget=64.0 must be an integer"),
    (dict(token_buckets=(16, "64")), r"token_buckets\[1\]='64' must be an integer")])
def test_engine_config_is_typed(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_numpy_integers_are_integers_and_limits_need_the_model(engine):
    sp = SamplingParams(max_tokens=np.int64(3), top_k=np.int32(5), seed=np.uint32(7))
    assert (type(sp.max_tokens), sp.top_k, sp.seed) == (int, 5, 7)
    with pytest.raises(ValueError, match=r"max_logprobs=600 exceeds the vocabulary of 512"):
        Engine.from_preset("tiny", config=EngineConfig(max_logprobs=600, max_model_len=64))
    with pytest.raises(ValueError, match=r"prompt 0: stop token id 600 outside \[0, 512\)"):
        engine.generate([[1]], SamplingParams(stop_token_ids=[600]), use_tqdm=False)


@pytest.mark.parametrize("request_, match", [
    (GenerateRequest([1], None), "request 1: GenerateRequest.params is a NoneType; expected "
                                 "SamplingParams"),
    (EmbedRequest([1], SamplingParams()), "request 1: EmbedRequest.params is a SamplingParams"),
    ("text", "request 1 is a str; expected GenerateRequest or EmbedRequest")])
def test_a_request_of_the_wrong_type_is_named(engine, request_, match):
    with pytest.raises(TypeError, match=match):
        engine.run([GenerateRequest([1], GREEDY), request_], use_tqdm=False)
    assert_clean(engine)


@pytest.mark.parametrize("prompt, match", [
    ([1, 1.7], r"prompt 1: token 1 is 1.7 \(float\); expected an integer"),
    ([1, "104"], r"prompt 1: token 1 is '104' \(str\)"),
    ([1, True], r"prompt 1: token 1 is True \(bool\)"),
    ([[5]], r"prompt 1: token 0 is \[5\] \(list\)"),
    (b"hi", r"prompt 1 is bytes \(b'hi'\); expected a string or a list of token ids"),
    ({1: 2}, "prompt 1 is a dict"), (None, "prompt 1 is None"), (5, r"prompt 1 is an int \(5\)"),
    (np.zeros((2, 2), np.int32), r"prompt 1 is an array of shape \(2, 2\)"),
    (np.array([1.0]), "dtype float64; expected a 1-D integer array"),
    ("x\ud800", "prompt 1 is not valid Unicode")])
def test_token_ids_are_checked_not_coerced(engine, prompt, match):
    with pytest.raises(ValueError, match=match):
        engine.generate([[1], prompt], GREEDY, use_tqdm=False)
    assert_clean(engine)


def test_integer_arrays_are_prompts_and_empty_batches_are_empty(engine, alone):
    outs = engine.generate([np.array(PROMPTS[0], np.int64)], GREEDY, use_tqdm=False)
    assert outs[0].token_ids == alone[0]
    assert engine.generate([], GREEDY, use_tqdm=False) == []
    assert engine.embed([], use_tqdm=False).shape == (0, 256)


GOOD = [GenerateRequest(p, sp) for p in PROMPTS for sp in (
    GREEDY, SamplingParams(max_tokens=4, temperature=0.9, top_k=20, seed=3, ignore_eos=True))]
GOOD += [EmbedRequest(p, PoolingParams(kind)) for p in PROMPTS[:2] for kind in ("mean", "last")]
BAD = [(GenerateRequest([], GREEDY), "prompt 0 is empty"),
       (GenerateRequest([1, 9999], GREEDY), "token id 9999 outside"),
       (GenerateRequest([1, 2.5], GREEDY), "token 1 is 2.5"),
       (GenerateRequest([1], SamplingParams(logprobs=50)), "logprobs=50 exceeds"),
       (EmbedRequest([1], PoolingParams(adapter="x")), "unknown adapter 'x'"),
       (EmbedRequest("", PoolingParams()), "input 0 is empty")]


def same_as_alone(out, request, reference):
    want = reference(request)
    if isinstance(request, EmbedRequest):
        np.testing.assert_allclose(out.embedding, want, atol=1e-5)  # another bucket: rounding
    else:
        assert out.token_ids == want.token_ids


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(plan=st.lists(st.tuples(st.booleans(), st.integers(0, 99), st.sampled_from(
    ["wait", "wait", "cancel", "close"])), min_size=1, max_size=7))
def test_random_mixes_of_good_bad_cancelled_and_closed(engine, plan):
    """Each coroutine submits one request (good or bad) and waits for it, cancels it after a
    few steps, or the front closes under it: good ones that run to the end get exactly what
    they get alone, bad ones an error naming them, nothing hangs, nothing is left over."""
    cache = {}

    def reference(request):
        key = repr(request)
        if key not in cache:
            cache[key] = (engine.embed([request.input], request.params, use_tqdm=False)[0]
                          if isinstance(request, EmbedRequest) else
                          engine.generate([request.prompt], request.params, use_tqdm=False)[0])
        return cache[key]

    for good, pick, _ in plan:  # the references first, while no front holds the engine
        if good:
            reference(GOOD[pick % len(GOOD)])

    async def one(aengine, good, pick, fate):
        request, message = (GOOD[pick % len(GOOD)], None) if good else BAD[pick % len(BAD)]
        submit = (aengine.embed(request.input, request.params)
                  if isinstance(request, EmbedRequest) else
                  aengine.generate(request.prompt, request.params))
        task = asyncio.ensure_future(submit)
        if fate == "cancel":
            await asyncio.sleep(0.01 * (pick % 5))
            task.cancel()
        try:
            out = await task
        except asyncio.CancelledError:
            assert fate == "cancel"
            return
        except (ValueError, RuntimeError) as e:
            assert message is not None and message in str(e) or "closed" in str(e), e
            return
        assert good, "a bad request was served"
        same_as_alone(out, request, reference)

    async def main():
        aengine = AsyncEngine(engine)
        tasks = [asyncio.ensure_future(one(aengine, *p)) for p in plan]
        if any(fate == "close" for _, _, fate in plan):
            await asyncio.sleep(0.02)
            await aengine.close()
        await asyncio.gather(*tasks)
        await aengine.close()

    asyncio.run(asyncio.wait_for(main(), 60))
    assert_clean(engine)
