"""Embeddings in the mixed step: chunked equals single-pass, poolers equal transformers."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from hetero_jax import (EmbedRequest, Engine, EngineConfig, GenerateRequest, PoolingParams,
                        SamplingParams)

POOLINGS = ("mean", "weighted_mean", "cls", "last")


# Several buckets: the warm-up of every variant and the chunk group's own page bucket
SEVERAL = dict(token_buckets=(16, 64), page_buckets=(4, 16))


def config(chunk, budget=64, **kw):
    """One token and one page bucket unless `kw` says otherwise: compiling is most of these
    tests' time, and what they check does not depend on the buckets."""
    budget = max(budget, chunk)
    return EngineConfig(**dict(dict(token_budget=budget, chunk_size=chunk, max_num_seqs=8,
                                    max_model_len=256, token_buckets=(budget,),
                                    page_buckets=(16,)), **kw))


def inputs(n=6, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(k)).tolist() for k in [160, 3, 41, 97, 1, 128][:n]]


def cos(a, b):
    return np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def single_pass():
    """Every input in one chunk (chunk 256 >= the longest input): the reference."""
    engine = Engine.from_preset("tiny", config=config(256, budget=256))
    return {p: engine.embed(inputs(), PoolingParams(p, normalize=False), use_tqdm=False)
            for p in POOLINGS}


@pytest.mark.parametrize("chunk", [8, 32])  # the 160-token input runs as 20 and 5 chunks
def test_chunked_equals_single_pass_beside_decodes(single_pass, chunk):
    engine = Engine.from_preset("tiny", config=config(chunk))
    gen = [GenerateRequest([256, 7, 8, 9], SamplingParams(max_tokens=40, temperature=0))] * 3
    for p in POOLINGS:
        outs = engine.run(gen + [EmbedRequest(x, PoolingParams(p, normalize=False))
                                 for x in inputs()], use_tqdm=False)
        got = np.stack([o.embedding for o in outs[3:]])
        want = single_pass[p]
        rel = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
        assert cos(got, want).min() > 0.9999 and rel.max() < 1e-3, f"{p}: {rel.max():.2e}"
        assert all(len(o.token_ids) == 40 for o in outs[:3])


def test_chunks_beside_long_decodes_attend_over_their_own_pages(monkeypatch):
    """Fresh chunks beside decodes past the smallest page bucket run at that bucket (the
    variant's second_pages < pages_per_seq): embeddings equal the single pass, generations
    equal the same requests alone."""
    from hetero_jax.runner import decoder

    keys, pack = [], decoder.pack_batch

    def recording(items, cfg, plan=None):
        key, batch = pack(items, cfg, plan)
        keys.append(key)
        return key, batch

    monkeypatch.setattr(decoder, "pack_batch", recording)
    engine = Engine.from_preset("tiny", config=config(32, **SEVERAL))
    gen = [GenerateRequest([256] + list(range(7, 90)), SamplingParams(max_tokens=40,
                                                                      temperature=0))] * 4
    alone = [o.token_ids for o in engine.run(gen, use_tqdm=False)]
    # four fresh inputs fill the chunk group (Sc = 4) and each fits the smallest page bucket
    short = [x[:k] for x, k in zip(inputs(seed=1), (3, 41, 1, 20))]
    pooling = PoolingParams("mean", normalize=False)
    want = engine.embed(short, pooling, use_tqdm=False)
    gens = engine.add(gen)
    while any(not r.output_token_ids for r in gens):  # until all four decode, 84+ tokens each
        engine.step()
    embeds = engine.add([EmbedRequest(x, pooling) for x in short])
    while engine.has_work():
        engine.step()
    assert any(sc and second < pages for _, _, sc, pages, second in keys)
    got = np.stack([engine.output(r).embedding for r in embeds])
    assert cos(got, want).min() > 0.9999
    assert [engine.output(r).token_ids for r in gens] == alone


def test_normalize_and_order():
    engine = Engine.from_preset("tiny", config=config(16))
    raw = engine.embed(inputs(), PoolingParams("mean", normalize=False), use_tqdm=False)
    unit = engine.embed(inputs(), PoolingParams("mean"), use_tqdm=False)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(unit, raw / np.linalg.norm(raw, axis=-1, keepdims=True), atol=1e-6)
    backwards = engine.embed(inputs()[::-1], PoolingParams("mean"), use_tqdm=False)
    np.testing.assert_allclose(backwards[::-1], unit, atol=1e-6)


def test_poolers_equal_transformers_last_hidden_state(hf_model):
    path, model = hf_model("llama3")
    engine = Engine.from_pretrained(path, config=config(16))
    ids = np.random.default_rng(1).integers(3, 300, 70).tolist()
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()
    weights = np.arange(1, len(ids) + 1)[:, None]
    want = {"mean": hidden.mean(0), "last": hidden[-1], "cls": hidden[0],
            "weighted_mean": (hidden * weights).sum(0) / weights.sum()}
    for p, w in want.items():
        got = engine.embed([ids], PoolingParams(p, normalize=False), use_tqdm=False)[0]
        assert cos(got, w) > 0.99999, p


@pytest.mark.slow  # ~30 s: every variant; tests/test_generate.py keeps the default-suite one
def test_zero_compiles_after_warmup_with_embeddings():
    engine = Engine.from_preset("tiny", config=config(16, warmup="all", **SEVERAL))
    engine.warmup()
    compiled = engine.stats.compiles - engine.stats.compile_loads
    rng = np.random.default_rng(2)
    reqs = []
    for i in range(10):
        x = rng.integers(0, 256, int(rng.integers(1, 200))).tolist()
        reqs.append(EmbedRequest(x, PoolingParams(POOLINGS[i % 4])) if i % 2 else
                    GenerateRequest(x, SamplingParams(max_tokens=int(rng.integers(1, 30)))))
    engine.run(reqs, use_tqdm=False)
    assert engine.stats.compiles - engine.stats.compile_loads == compiled, "a step compiled"


@pytest.mark.parametrize("x,kw,match", [
    ("", {}, "input 1 is empty"), ([], {}, "input 1 is empty"),
    (list(range(300)), {}, r"input 1 has 300 tokens > the embedding limit 256"),
    ([1, 2], dict(adapter="nope"), "input 1: unknown adapter 'nope'; loaded: none"),
    ([1, 2], dict(pooling="buffered"), r"input 1: pooling='buffered' needs EngineConfig\(")])
def test_bad_embedding_input(x, kw, match):
    engine = Engine.from_preset("tiny", config=config(16))
    with pytest.raises(ValueError, match=match):
        engine.run([GenerateRequest("fine", SamplingParams(max_tokens=2)),
                    EmbedRequest(x, PoolingParams(**kw))], use_tqdm=False)
    assert not engine.has_work() and engine.stats.steps == 0, "a rejected batch started work"
    assert engine.embed(["still works"], use_tqdm=False).shape == (1, 256)


def test_truncate_keeps_the_first_tokens():
    engine = Engine.from_preset("tiny", config=config(64))
    long = list(range(200)) * 2
    got = engine.embed([long], PoolingParams("mean", truncate=True), use_tqdm=False)
    np.testing.assert_allclose(got, engine.embed([long[:256]], use_tqdm=False), atol=1e-6)


def test_unknown_pooling():
    with pytest.raises(ValueError, match="unknown pooling 'max'"):
        PoolingParams("max")


def max_pool_head(hidden, length):
    """A head that does not stream: elementwise max over the request's hidden states."""
    valid = jnp.arange(hidden.shape[0])[:, None] < length
    return jnp.max(jnp.where(valid, hidden, -jnp.inf), axis=0)


def test_buffered_head_sees_every_hidden_state():
    """The buffered head over chunks equals the same function of the single-pass states."""
    engine = Engine.from_preset("tiny", config=config(16, buffered_head=max_pool_head))
    got = engine.embed(inputs(), PoolingParams("buffered", normalize=False), use_tqdm=False)
    whole = Engine.from_preset("tiny", config=config(256, budget=256, buffered_head=max_pool_head))
    want = whole.embed(inputs(), PoolingParams("buffered", normalize=False), use_tqdm=False)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for p in ("last", "cls"):  # the max over all tokens bounds each single token
        one = engine.embed(inputs(), PoolingParams(p, normalize=False), use_tqdm=False)
        assert np.all(got >= one - 1e-5), p
    with pytest.raises(ValueError, match="needs EngineConfig\\(buffered_head=...\\)"):
        Engine.from_preset("tiny", config=config(16)).embed(
            ["x"], PoolingParams("buffered"), use_tqdm=False)
