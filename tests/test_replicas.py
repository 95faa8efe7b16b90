"""Replicas: two engine processes behind the router give what one engine gives (the same
tokens, embeddings to fp32 reduction order, request ids and seeds), for `run`, the asyncio
front and the batch job's front; the router sees the engine's own page digests; bad input
raises naming it; a replica killed mid-run fails its own requests and the other goes on.
The tests share one ReplicaSet (its start-up is the cost); the kill test runs last."""
import asyncio
import os
import pickle
import re
import signal

import numpy as np
import pytest

from hetero_jax import (EmbedRequest, Engine, EngineConfig, GenerateRequest, PoolingParams,
                        SamplingParams, make_engine)
from hetero_jax.offline import cli as batch_cli
from hetero_jax.offline.job import EngineFront
from hetero_jax.offline.replica_front import ReplicaFront
from hetero_jax.sched.hashing import page_hashes
from hetero_jax.serving.async_replicas import AsyncReplicas
from hetero_jax.serving.replicas import ReplicaSet
from tests.test_batch_job import by_id, mixed_rows, read_jsonl, run_rows, write_jsonl

CONFIG = dict(token_budget=64, chunk_size=32, max_num_seqs=8, max_model_len=256,
              token_buckets=(64,), chunk_seq_buckets=(4,), page_buckets=(16,),
              cascade_rows=0)  # one step variant
SHARED = [256] + list(range(1, 40))  # 40 tokens: two full pages of 16 to share
TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")


def requests():
    gen = [GenerateRequest(SHARED + [50 + i], SamplingParams(max_tokens=8, temperature=0))
           for i in range(4)]
    emb = [EmbedRequest(list(range(3 + 37 * i)), PoolingParams("mean")) for i in range(3)]
    return [gen[0], emb[0], gen[1], EmbedRequest(SHARED + [7], PoolingParams("last")), emb[1],
            GenerateRequest([256, 9, 9], SamplingParams(max_tokens=6, temperature=0.8)),
            gen[2], EmbedRequest("a passage", PoolingParams("cls")), gen[3], emb[2],
            GenerateRequest("hello", SamplingParams(max_tokens=5, seed=3, logprobs=2))]


def assert_same(got, want):
    assert [type(o) for o in got] == [type(o) for o in want]
    for g, w in zip(got, want):
        assert g.finish_reason == w.finish_reason and g.prompt_token_ids == w.prompt_token_ids
        if hasattr(w, "token_ids"):
            assert (g.token_ids, g.text) == (w.token_ids, w.text)
            if w.logprobs:
                np.testing.assert_allclose([t["logprob"] for t in g.logprobs],
                                           [t["logprob"] for t in w.logprobs], atol=1e-5)
        else:  # fp32; the steps hold other requests
            np.testing.assert_allclose(g.embedding, w.embedding, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def one():
    return Engine.from_preset("tiny", config=EngineConfig(**CONFIG))


@pytest.fixture(scope="module")
def replicas():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two replicas need two cores")
    rs = make_engine("tiny", EngineConfig(**CONFIG), replicas=2)
    yield rs
    rs.close()


def test_two_replicas_give_what_one_engine_gives(replicas, one):
    assert isinstance(replicas, ReplicaSet) and replicas.config == one.config
    assert replicas.router.config.policy == "prefix-affinity"
    want = one.run(requests(), False)
    got = replicas.run(requests())
    assert [o.request_id for o in got] == [o.request_id for o in want] == list(range(len(want)))
    assert_same(got, want)
    assert all(s.steps > 0 for s in replicas.replica_stats), "both replicas served"
    # the five requests sharing SHARED went to one replica, so its cache found the prefix
    # for four of them, as one engine's does; the last embedding shares two pages with the
    # second one
    cached = [o.metrics["cached_tokens"] for o in got]
    assert cached == [o.metrics["cached_tokens"] for o in want] and sum(cached) == 5 * 32
    assert replicas.router.stats.affinity == 5 and replicas.in_flight == 0
    assert 0 < got[0].metrics["ttft_s"] <= got[0].metrics["latency_s"]


def test_the_router_hashes_pages_as_the_engine_does(replicas, one):
    ps = one.config.page_size
    for r in [GenerateRequest(SHARED, SamplingParams(cache_salt="s")), EmbedRequest(SHARED),
              EmbedRequest("a text long enough for a page, or two.", PoolingParams("cls"))]:
        (req,) = one.prepare([r])
        cap = (req.num_tokens - 1) // ps
        hashes, cost = replicas.placement.key(0, r)
        assert hashes == page_hashes(req.prompt_token_ids, ps, req.cache_seed)[:cap]
        assert cap > 0 and cost == req.num_tokens + getattr(r.params, "max_tokens", 0)


def test_bad_input_raises_naming_it_and_the_replicas_stay_usable(replicas):
    with pytest.raises(ValueError, match="input 2 is empty"):
        replicas.run([GenerateRequest([256, 1]), EmbedRequest([1]), EmbedRequest([])])
    with pytest.raises(ValueError, match="prompt 1 has 300 tokens; max_model_len=256"):
        replicas.run([EmbedRequest([1]), GenerateRequest([1] * 300)])  # a replica's check
    with pytest.raises(ValueError, match="prompt 0: logprobs=9 exceeds max_logprobs=5"):
        replicas.run([GenerateRequest([1], SamplingParams(logprobs=9))])
    with pytest.raises(TypeError, match="expected GenerateRequest"):
        replicas.run(["just a string"])
    assert replicas.in_flight == 0
    vec = replicas.embed([[1, 2, 3]], PoolingParams("mean"))
    assert vec.shape == (1, 256) and np.isclose(np.linalg.norm(vec), 1.0)


def test_the_asyncio_front_serves_coroutines_and_cancels(replicas, one):
    greedy = SamplingParams(max_tokens=4, temperature=0)

    async def main():
        front = AsyncReplicas(replicas)
        outs = await asyncio.gather(*[front.generate([256, i + 1], greedy) for i in range(4)],
                                    front.embed([1, 2, 3]))
        with pytest.raises(ValueError, match="prompt 0 is empty"):
            await front.generate([])
        with pytest.raises(ValueError, match="has 300 tokens"):
            await front.generate([1] * 300)
        long = asyncio.ensure_future(front.generate([256, 1], SamplingParams(
            max_tokens=200, ignore_eos=True)))
        await asyncio.sleep(0.05)
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)
        await front.close()
        return outs

    outs = asyncio.run(main())
    assert replicas.in_flight == 0, "the cancelled request was aborted"
    want = one.generate([[256, i + 1] for i in range(4)], greedy, use_tqdm=False)
    assert [o.token_ids for o in outs[:4]] == [w.token_ids for w in want]
    np.testing.assert_allclose(outs[4].embedding, one.embed([[1, 2, 3]], use_tqdm=False)[0],
                               rtol=1e-5, atol=1e-6)


def test_the_server_over_replicas_gives_what_one_engine_gives(replicas, one):
    """`serve --engine-process` (and `--replicas N`): the OpenAI server on replica processes;
    greedy tokens, plain and streamed, equal one engine's, embeddings to fp32 reduction order
    (the steps hold other requests); its stats carry the replicas' step times."""
    import openai

    from hetero_jax.server.app import ServerConfig, build_app
    from hetero_jax.server.cli import ServerThread

    prompts = [[256, 5, 6, 7], [256, 40, 41]]
    greedy = SamplingParams(max_tokens=6, temperature=0)
    want = [w.token_ids for w in one.generate(prompts, greedy, use_tqdm=False)]
    want_vec = one.embed([[1, 2, 3], [4, 5, 6, 7]], use_tqdm=False)
    front = AsyncReplicas(replicas)
    with ServerThread(build_app(front, ServerConfig(model="tiny"))) as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                            timeout=120)
        got = oai.completions.create(model="tiny", prompt=prompts, max_tokens=6,
                                     temperature=0, extra_body={"return_token_ids": True})
        streamed = {}
        for chunk in oai.completions.create(model="tiny", prompt=prompts, max_tokens=6,
                                            temperature=0, stream=True,
                                            extra_body={"return_token_ids": True}):
            for c in chunk.choices:
                streamed.setdefault(c.index, []).extend(c.token_ids or [])
        vecs = oai.embeddings.create(model="tiny", input=[[1, 2, 3], [4, 5, 6, 7]]).data
    assert [c.token_ids for c in got.choices] == want
    assert [streamed[i] for i in range(2)] == want
    np.testing.assert_allclose([v.embedding for v in vecs], want_vec, rtol=1e-5, atol=1e-6)
    assert replicas.in_flight == 0
    stats = front.stats  # /metrics: the replicas' step times, none running or waiting now
    assert sum(stats.steps.counts) > 0 and stats.steps.total_s > 0
    assert not any(stats.running.values()) and not any(stats.waiting.values())


def test_replica_streams_send_a_delta_per_step_that_joins_to_the_output(replicas, one):
    """A streamed generation's worker sends one delta per step that gave it a token and did
    not end it (`collect` hands each on); through the front, the deltas' ids, text and
    log-probs join to the final output, whose greedy tokens are one engine's; an embedding and
    an unstreamed request (the batch path) still come back only when they end."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    (want,) = one.generate([[256, 5, 6]], params, use_tqdm=False)
    (tag,) = replicas.submit([GenerateRequest([256, 5, 6], params)], stream=True)
    plain = replicas.submit([GenerateRequest([256, 5, 6], params), EmbedRequest([1, 2])])
    got: list = []
    while len([r for _, r in got if r.delta is None]) < 3:
        got += replicas.collect(timeout=1.0)
    deltas = [r.delta for t, r in got if r.delta is not None]
    (out,) = [r.output for t, r in got if t == tag and r.delta is None]
    assert all(t == tag for t, r in got if r.delta is not None), "only the streamed one"
    assert [len(d.token_ids) for d in deltas] == [1] * 11, "one per step but the last"
    assert sum((d.token_ids for d in deltas), []) == out.token_ids[:11] == want.token_ids[:11]
    assert {t for t, r in got if r.delta is None} == {tag, *plain}

    async def main():
        front = AsyncReplicas(replicas)
        stream = [d async for d in front.generate([256, 5, 6], params, request_id="s")]
        await front.close()
        return stream

    stream = asyncio.run(main())
    last = stream[-1].output
    assert len(stream) > 1 and stream[-1].finished and not any(d.finished for d in stream[:-1])
    assert {d.request_id for d in stream} == {"s"} and last.token_ids == want.token_ids
    assert sum((d.token_ids for d in stream), []) == last.token_ids
    assert "".join(d.text for d in stream) == last.text == want.text
    assert sum((d.logprobs for d in stream), []) == last.logprobs
    assert replicas.in_flight == 0


def test_the_batch_job_on_replicas_writes_the_rows_of_one_engine(replicas, one, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", mixed_rows(18) + [{"id": "bad", "prompt": []}])
    run_rows(inp, tmp_path / "one.jsonl", EngineFront(one, max_in_flight=6))
    tally = run_rows(inp, tmp_path / "two.jsonl", ReplicaFront(replicas, max_in_flight=6))
    got, want = by_id(read_jsonl(tmp_path / "two.jsonl")), by_id(read_jsonl(tmp_path / "one.jsonl"))
    errors = [read_jsonl(f"{tmp_path}/{name}.jsonl.errors.jsonl") for name in ("one", "two")]
    assert errors[0] == errors[1] and len(errors[1]) == tally.refused == 1
    assert got.keys() == want.keys() and len(got) == 18
    for key, w in want.items():
        g = got[key]
        if "embedding" in w:
            np.testing.assert_allclose(g.pop("embedding"), w.pop("embedding"), rtol=1e-5,
                                       atol=1e-6)
        assert g == w, key
    assert {"line": 19, "id": "bad", "stage": "engine", "error": "the prompt is empty"} in \
        errors[1]


def test_the_ray_actors_drive_their_engine_as_one_engine_does(one):
    """`EngineActor.serve` and the Ray Data `EngineBatcher` are plain classes (Ray makes them
    actors; here they run without it): each drives its engine through `drive.Drive`, so every
    tag comes back once, as one engine's output or as the `RequestError` that refused it."""
    from hetero_jax.offline.ray_data import EngineBatcher
    from hetero_jax.serving.processes import ModelSource
    from hetero_jax.serving.ray_replicas import EngineActor

    items = [(10, GenerateRequest([256, 1, 2], SamplingParams(max_tokens=4, temperature=0))),
             (11, EmbedRequest([])), (12, EmbedRequest([5, 6, 7], PoolingParams("mean")))]
    want = one.run([items[0][1], items[2][1]], False)
    source, config = ModelSource(preset="tiny"), EngineConfig(**CONFIG)
    results, failure, _ = EngineActor(source, config).serve(items)
    batch = EngineBatcher(source, config)({"i": np.arange(3), "request": np.array(
        [pickle.dumps(r) for _, r in items], dtype=object)})
    from_batcher = {int(i) + 10: pickle.loads(r) for i, r in zip(batch["i"], batch["result"])}
    for got in (dict(results), from_batcher):
        assert sorted(got) == [10, 11, 12] and failure is None
        assert str(got[11].error) == "input 0 is empty" and got[11].output is None
        assert got[10].output.token_ids == want[0].token_ids
        np.testing.assert_allclose(got[12].output.embedding, want[1].embedding, rtol=1e-5,
                                   atol=1e-6)


def test_a_killed_replica_fails_its_own_requests_and_the_other_goes_on(replicas):
    long = SamplingParams(max_tokens=120, ignore_eos=True, temperature=0)
    tags = replicas.submit([GenerateRequest([256, i + 1], long) for i in range(6)])
    where = {t: replicas._flights[t].replica for t in tags}
    assert sorted(where.values()) == [0, 0, 0, 1, 1, 1], "least tokens alternates"
    os.kill(replicas._procs[1].pid, signal.SIGKILL)
    results = {}
    while len(results) < len(tags):
        results.update(replicas.collect(timeout=10.0))
    for tag in tags:
        out = results[tag].output
        if where[tag] == 1:
            assert out.finish_reason == "error" and re.fullmatch(
                r"replica 1 \(pid \d+\) died with exit code -9; its 3 requests in flight "
                r"failed", out.error), out.error
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 120
    assert replicas.alive == [True, False]
    outs = replicas.generate([[256, 5]] * 3, SamplingParams(max_tokens=3))
    assert [len(o.token_ids) for o in outs] == [3, 3, 3]


def test_bad_replica_settings_name_the_value_before_any_process(tmp_path, capsys):
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=f"replicas={cores + 1} needs one CPU core each; this "
                       f"process may use {cores}"):
        ReplicaSet.from_preset("tiny", cores + 1)
    with pytest.raises(ValueError, match="replicas=0 must be an integer >= 1"):
        make_engine("tiny", replicas=0)
    with pytest.raises(ValueError, match="router='random' must be one of"):
        ReplicaSet.from_preset("tiny", 1, router="random")
    with pytest.raises(ValueError, match="needs EngineConfig\\(prefix_caching=True\\)"):
        ReplicaSet.from_preset("tiny", 1, config=EngineConfig(prefix_caching=False),
                               router="prefix-affinity")
    with pytest.raises(ValueError, match="it needs replicas >= 2"):
        make_engine("tiny", router="least-tokens")
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        ReplicaSet.from_preset("huge", 1)
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "embed": "x"}])
    with pytest.raises(SystemExit):
        batch_cli.batch_main([inp, "--output", str(tmp_path / "o.jsonl"),
                              "--replicas", str(cores + 1)])
    assert (f"argument --replicas: {cores + 1} replicas need one CPU core each; this process "
            f"may use {cores}") in capsys.readouterr().err


def test_ray_without_ray_is_an_argparse_error(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "embed": "x"}])
    with pytest.raises(SystemExit) as e:
        batch_cli.batch_main([inp, "--output", str(tmp_path / "o.jsonl"), "--ray"])
    assert e.value.code == 2 and ("argument --ray: --ray local needs ray, which is not "
                                  "installed") in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o.jsonl")


def test_n_samples_on_replicas_are_one_engines(replicas, one):
    sampled = [GenerateRequest("sampled", SamplingParams(n=3, seed=4, max_tokens=4))]
    got = replicas.run(sampled)
    assert len(got) == 3
    assert [o.token_ids for o in got] == [o.token_ids for o in one.run(sampled, False)]
