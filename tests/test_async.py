"""AsyncEngine: coroutines share heterogeneous steps; bad input and cancellation stay local."""
import asyncio
import time

import numpy as np
import pytest

from hetero_jax import AsyncEngine, Engine, EngineConfig, PoolingParams, SamplingParams

CFG = EngineConfig(token_budget=64, chunk_size=16, max_num_seqs=8, max_model_len=256,
                   token_buckets=(16, 64), page_buckets=(4, 16))
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def engine():
    return Engine.from_preset("tiny", config=CFG)


def test_concurrent_pipelines_match_the_sync_engine(engine):
    questions = ["what is jax", "why batch", "paged attention?"]
    want_vec = engine.embed(questions, PoolingParams("mean"), use_tqdm=False)
    want_gen = [o.token_ids for o in engine.generate(questions, GREEDY, use_tqdm=False)]

    async def pipeline(aengine, q):  # embed -> generate -> embed, like one iterative query
        v = await aengine.embed(q, PoolingParams("mean"))
        g = await aengine.generate(q, GREEDY)
        return v.embedding, g.token_ids, await aengine.embed(q + g.text, PoolingParams("mean"))

    async def main():
        aengine = AsyncEngine(engine)
        try:
            return await asyncio.gather(*(pipeline(aengine, q) for q in questions))
        finally:
            await aengine.close()

    steps = engine.stats.steps
    results = asyncio.run(main())
    for (v, g, _), wv, wg in zip(results, want_vec, want_gen):
        np.testing.assert_allclose(v, wv, atol=1e-5)
        assert g == wg
    assert engine.stats.steps > steps


def test_bad_request_fails_only_its_coroutine(engine):
    async def main():
        aengine = AsyncEngine(engine)
        good = asyncio.ensure_future(aengine.generate("fine", GREEDY))
        with pytest.raises(ValueError, match="prompt 0 is empty"):
            await aengine.generate("", GREEDY)
        out = await good
        await aengine.close()
        return out

    assert len(asyncio.run(main()).token_ids) == 12


def test_cancel_aborts_and_frees_pages(engine):
    free = engine.scheduler.cache_stats().free_pages

    async def main():
        aengine = AsyncEngine(engine)
        long = SamplingParams(max_tokens=200, ignore_eos=True)  # still running at the cancel
        task = asyncio.ensure_future(aengine.generate("long one", long))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        other = await aengine.generate("after", GREEDY)  # the stepper keeps serving
        await aengine.close()
        return other

    assert len(asyncio.run(main()).token_ids) == 12
    assert engine.scheduler.cache_stats().free_pages == free and not engine.has_work()


def test_a_caller_behind_the_steps_gets_the_queued_deltas_joined(engine):
    """The caller blocks its event loop until the engine has finished the request: every later
    step's delta is queued by then, and the next iteration yields them as one finished delta
    whose ids, text and log-probs join the first to the whole output."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)

    async def main():
        aengine = AsyncEngine(engine)
        deltas = aiter(aengine.generate("lagging", params))
        first = await anext(deltas)
        for _ in range(3000):  # blocks the loop (no await) until the engine is done, 30 s at most
            if not engine.has_work():
                break
            time.sleep(0.01)
        time.sleep(0.5)  # and the stepper has handed the last step's delta over (microseconds)
        rest = [d async for d in deltas]
        await aengine.close()
        return first, rest

    first, rest = asyncio.run(main())
    (last,) = rest
    out = last.output
    assert last.finished and not first.finished and len(first.token_ids) >= 1
    assert first.token_ids + last.token_ids == out.token_ids and len(out.token_ids) == 10
    assert first.text + last.text == out.text
    assert first.logprobs + last.logprobs == out.logprobs
