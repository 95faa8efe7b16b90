"""Dedicated mode: two worker processes give what one engine gives, in input order."""
import asyncio
import os

import numpy as np
import pytest

from hetero_jax import (EmbedRequest, Engine, EngineConfig, GenerateRequest, PoolingParams,
                        SamplingParams, make_engine)
from hetero_jax.models.tokenizer import ByteTokenizer
from hetero_jax.outputs import RequestError
from hetero_jax.serving.async_replicas import AsyncDedicated
from hetero_jax.serving.dedicated import DedicatedEngine

CONFIG = dict(token_budget=64, chunk_size=32, max_num_seqs=8, max_model_len=256,
              token_buckets=(64,), chunk_seq_buckets=(4,), page_buckets=(16,))  # one variant


def requests():
    gen = [GenerateRequest([256, 5, 6, 7 + i], SamplingParams(max_tokens=10, temperature=0))
           for i in range(3)]
    emb = [EmbedRequest(list(range(3 + 37 * i)), PoolingParams("mean")) for i in range(3)]
    return [gen[0], emb[0], emb[1], gen[1], EmbedRequest("hello", PoolingParams("last")),
            gen[2], emb[2], GenerateRequest([256, 9], SamplingParams(max_tokens=6, seed=3))]


@pytest.fixture(scope="module")
def dedicated():
    engine = make_engine("tiny", EngineConfig(scheduler="dedicated", **CONFIG))
    yield engine
    engine.close()


def test_same_tokens_and_embeddings_as_one_engine(dedicated):
    assert isinstance(dedicated, DedicatedEngine)
    one = Engine.from_preset("tiny", config=EngineConfig(**CONFIG))
    assert dedicated.config == one.config, "the workers' config, resolved against the model"
    want = one.run(requests(), False)
    got = dedicated.run(requests())
    assert [type(o) for o in got] == [type(o) for o in want]
    assert [o.request_id for o in got] == list(range(len(want)))
    for g, w in zip(got, want):
        if hasattr(w, "token_ids"):
            assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
            assert 0 < g.metrics["ttft_s"] <= g.metrics["latency_s"]
        else:
            np.testing.assert_allclose(g.embedding, w.embedding, rtol=1e-5, atol=1e-6)
            assert g.metrics["latency_s"] > 0
    assert set(dedicated.stats) == {"embed", "generate"}
    assert dedicated.stats["embed"].generated_tokens == 0


def test_workers_are_pinned_to_their_own_core_with_one_xla_thread(dedicated):
    cores = dedicated.cores
    for role, proc in dedicated._procs.items():
        assert os.sched_getaffinity(proc.pid) == {cores[role]}
        with open(f"/proc/{proc.pid}/environ", "rb") as f:
            env = f.read().decode(errors="replace")
        assert "--xla_cpu_multi_thread_eigen=false" in env
    if len(os.sched_getaffinity(0)) > 1:
        assert cores["embed"] != cores["generate"]


def test_bad_input_raises_and_the_engine_stays_usable(dedicated):
    with pytest.raises(ValueError, match="input 2 is empty"):
        dedicated.run([GenerateRequest([256, 1], SamplingParams(max_tokens=2)),
                       EmbedRequest([1]), EmbedRequest([])])
    with pytest.raises(ValueError, match="prompt 1: token id 9999"):
        dedicated.run([EmbedRequest([1]), GenerateRequest([9999])])
    with pytest.raises(TypeError, match="expected GenerateRequest"):
        dedicated.run(["just a string"])
    vec = dedicated.embed([[1, 2, 3]], PoolingParams("mean"))
    assert vec.shape == (1, 256) and np.isclose(np.linalg.norm(vec), 1.0)
    (out,) = dedicated.generate([[256, 1]], SamplingParams(max_tokens=3, temperature=0))
    assert len(out.token_ids) == 3


def test_the_one_front_over_dedicated_mode_gives_what_run_gives(dedicated):
    """`AsyncDedicated` (the front the bench drives dedicated mode through) batches what
    arrives while a worker runs; each stream has one delta, the finished one; a bad request
    fails its batch's callers with the engine's error."""
    want = dedicated.run(requests())

    async def serve():
        front = AsyncDedicated(dedicated, ByteTokenizer())
        try:
            calls = [front.embed(r.input, r.params) if isinstance(r, EmbedRequest) else
                     _deltas(front.generate(r.prompt, r.params)) for r in requests()]
            got = await asyncio.gather(*calls)
            bad = await asyncio.gather(front.embed([]), front.embed([]),
                                       return_exceptions=True)  # one batch or two
            return got, bad, front.batch_sizes, front.stats
        finally:
            await front.close()

    got, bad, sizes, stats = asyncio.run(serve())
    for g, w in zip(got, want):
        if isinstance(g, list):
            assert len(g) == 1 and g[0].finished and g[0].output.token_ids == w.token_ids
        else:
            np.testing.assert_allclose(g.embedding, w.embedding, rtol=1e-5, atol=1e-6)
    assert all(isinstance(e, RequestError) and "input 0 is empty" in str(e) for e in bad), bad
    assert sum(sizes["embed"]) == 4 + 2 and sum(sizes["generate"]) == 4, sizes
    assert stats.engine.generated_tokens > 0


async def _deltas(stream) -> list:
    return [d async for d in stream]


def test_reset_prefix_cache_forgets_both_workers_prefixes(dedicated):
    prompt = list(range(1, 70))  # 4 full pages of 16
    dedicated.generate([prompt], SamplingParams(max_tokens=1))  # caches them
    hits = []
    for reset in (False, True):
        before = dedicated.stats["generate"].cache_hit_tokens
        if reset:
            dedicated.reset_prefix_cache()
        dedicated.generate([prompt], SamplingParams(max_tokens=1))
        hits.append(dedicated.stats["generate"].cache_hit_tokens - before)
    assert hits == [64, 0], "the rerun hit its 4 cached pages; after the reset, none"


def test_make_engine_picks_the_engine_and_refuses_unknown_names():
    with pytest.raises(ValueError, match="neither a preset"):
        make_engine("no-such-model", EngineConfig(scheduler="dedicated"))
    with pytest.raises(ValueError, match="make_engine"):
        Engine.from_preset("tiny", config=EngineConfig(scheduler="dedicated", **CONFIG))
    assert type(make_engine("tiny", EngineConfig(scheduler="ibs", **CONFIG))) is Engine
