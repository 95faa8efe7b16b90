"""Prefix caching changes speed, never results: the engine with the cache on equals it off.

Generation (greedy tokens and log-probs, fp32 1e-5, and transformers' greedy tokens) for
prompts sharing prefixes shorter than, equal to and longer than a page, fully cached prompts,
prefixes written by an embedding request, and a preemption storm; embeddings (all four
streaming heads, min cosine > 0.99999) from hits written by embedding chunks and by
generation prefill, at chunk sizes 8, 32 and the page size, and on a LoRA adapter, whose
tokens never hit base pages.
"""
import numpy as np
import pytest
import torch

from hetero_jax import (EmbedRequest, Engine, EngineConfig, GenerateRequest, PoolingParams,
                        SamplingParams)
from tests.test_lora import write_adapter

HEADS = ("mean", "weighted_mean", "cls", "last")
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
RNG = np.random.default_rng(7)
PREFIX = RNG.integers(3, 250, 40).tolist()


def suffix(n):
    return RNG.integers(3, 250, n).tolist()


# One bucket of each kind (one token bucket, not 16 and 64: a variant fewer per engine; most
# of these tests' time is compiling, and the cache's results do not depend on the bucket)
CFG = dict(token_budget=64, chunk_size=16, page_size=8, max_num_seqs=8, max_model_len=128,
           token_buckets=(64,), page_buckets=(16,), seq_buckets=(8,))
PROMPTS = [PREFIX[:5] + suffix(6), PREFIX[:8] + suffix(3), PREFIX + suffix(9), PREFIX,
           PREFIX[:24], PREFIX[:17] + suffix(20)]


def engine_pair(path=None, **kw):
    cfg = dict(CFG, **kw)
    make = (lambda c: Engine.from_pretrained(path, config=c)) if path else (
        lambda c: Engine.from_preset("tiny", config=c))
    return {on: make(EngineConfig(prefix_caching=on, **cfg)) for on in (True, False)}


def runs(engines, batches):
    """Run the same batches (one `run` each, in order) on every engine; the outputs of each."""
    return {on: [o for b in batches for o in e.run(b, use_tqdm=False)]
            for on, e in engines.items()}


def assert_same_generation(a, b):
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose([t["logprob"] for t in a.logprobs],
                               [t["logprob"] for t in b.logprobs], rtol=1e-5, atol=1e-5)


def min_cosine(xs, ys):
    x, y = np.stack(xs), np.stack(ys)
    return float(np.min(np.sum(x * y, -1) / np.linalg.norm(x, axis=-1) / np.linalg.norm(y, axis=-1)))


def test_generation_with_the_cache_equals_without_and_transformers(hf_model):
    path, model = hf_model("llama3")
    engines = engine_pair(path)
    writer = [EmbedRequest(PREFIX + suffix(4), PoolingParams("mean"))]  # writes the prefix
    gens = [GenerateRequest(p, GREEDY) for p in PROMPTS]
    out = runs(engines, [writer, gens, gens])
    cached = [o.metrics["cached_tokens"] for o in out[True][1:]]
    assert cached[:6] == [0, 8, 40, 32, 16, 16], "hits of the embedding's pages"
    assert cached[6:] == [8, 8, 48, 32, 16, 32], "the second round hits its own pages"
    assert all(o.metrics["cached_tokens"] == 0 for o in out[False])
    for a, b in zip(out[True][1:], out[False][1:]):
        assert_same_generation(a, b)
    for p, o in zip(PROMPTS, out[True][1:7]):
        with torch.no_grad():
            want = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False,
                                  min_new_tokens=6)[0, len(p):].tolist()
        assert o.token_ids == want
    stats = engines[True].stats
    assert stats.cache_queries == 13 and stats.cache_hit_tokens == sum(cached)
    assert 0 < stats.cache_hit_rate <= 1


def test_a_preemption_storm_changes_nothing():
    engines = engine_pair(num_pages=24, max_num_seqs=8)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1)
    reqs = [GenerateRequest(PREFIX[:20 + i] + suffix(3), params) for i in range(8)]
    out = runs(engines, [reqs])
    assert engines[True].stats.preemptions > 0 and engines[True].stats.cache_hit_tokens > 0
    for a, b in zip(out[True], out[False]):
        assert_same_generation(a, b)


@pytest.mark.parametrize("chunk_size", [pytest.param(8, marks=pytest.mark.slow),
                                        pytest.param(32, marks=pytest.mark.slow), 16])  # 16: page
def test_embeddings_from_the_cache_equal_the_uncached_ones(chunk_size):
    engines = engine_pair(chunk_size=chunk_size, page_size=16)
    writers = [EmbedRequest(PREFIX + suffix(7), PoolingParams("mean")),
               GenerateRequest(PREFIX[:33] + suffix(30), SamplingParams(max_tokens=2))]
    tails = [suffix(1), suffix(9), suffix(17), []]
    embeds = [EmbedRequest(PREFIX + t, PoolingParams(h, normalize=False))
              for h in HEADS for t in tails]
    embeds += [EmbedRequest(PREFIX[:33] + suffix(30)[:20], PoolingParams(h, normalize=False))
               for h in HEADS]  # hits the generation's prefill pages
    out = runs(engines, [writers, embeds])
    hits = [o.metrics["cached_tokens"] for o in out[True][2:]]
    assert min(hits) >= 32 and max(hits) == 48, hits
    for i, head in enumerate(HEADS):
        got = [o.embedding for o in out[True][2 + 4 * i:6 + 4 * i]] + [out[True][18 + i].embedding]
        want = [o.embedding for o in out[False][2 + 4 * i:6 + 4 * i]] + [
            out[False][18 + i].embedding]
        assert min_cosine(got, want) > 0.99999, head


def test_adapter_tokens_never_hit_base_pages(hf_model, tmp_path):
    path, model = hf_model("llama3")
    write_adapter(tmp_path / "lora", model, 8, ["q_proj", "v_proj", "down_proj"])
    engines = {on: Engine.from_pretrained(path, config=EngineConfig(prefix_caching=on, **CFG),
                                          embed_adapter={"lora": str(tmp_path / "lora")})
               for on in (True, False)}
    lora = [EmbedRequest(PREFIX + suffix(3), PoolingParams(h, normalize=False)) for h in HEADS]
    base = [GenerateRequest(PREFIX + suffix(2), SamplingParams(max_tokens=1))]
    out = runs(engines, [base, lora[:1], lora])
    hits = [o.metrics["cached_tokens"] for o in out[True]]
    assert hits[1] == 0, "an adapter request hit pages the base model wrote"
    assert hits[2:] == [40] * 4
    assert min_cosine([o.embedding for o in out[True][2:]],
                      [o.embedding for o in out[False][2:]]) > 0.99999


def test_salts_isolate_and_reset_empties_the_cache_while_requests_run():
    engine = Engine.from_preset("tiny", config=EngineConfig(**CFG))
    params = SamplingParams(max_tokens=4, temperature=0, cache_salt="tenant a")
    first = engine.run([GenerateRequest(PREFIX, params)], use_tqdm=False)[0]
    other = engine.run([GenerateRequest(PREFIX, SamplingParams(
        max_tokens=4, temperature=0, cache_salt="tenant b"))], use_tqdm=False)[0]
    assert other.metrics["cached_tokens"] == 0 and other.token_ids == first.token_ids
    reqs = engine.add([GenerateRequest(PREFIX, params)])
    engine.step()
    engine.reset_prefix_cache()  # a running request keeps its pages and finishes the same
    while engine.has_work():
        engine.step()
    again = engine.output(reqs[0])
    assert again.metrics["cached_tokens"] == 32 and again.token_ids == first.token_ids
    after = engine.run([GenerateRequest(PREFIX, params)], use_tqdm=False)[0]
    assert after.metrics["cached_tokens"] == 0 and after.token_ids == first.token_ids
    assert engine.scheduler.cache_stats().free_pages == engine.config.num_pages - 1
    with pytest.raises(ValueError, match="cache_salt=5 must be a string or None, not int"):
        SamplingParams(cache_salt=5)
    with pytest.raises(ValueError, match="cache_salt=b'x' must be a string"):
        PoolingParams(cache_salt=b"x")
    with pytest.raises(ValueError, match="prefix_caching='yes' must be True or False"):
        EngineConfig(prefix_caching="yes")


def test_cascade_decode_steps_equal_plain_ones():
    """Decodes sharing cached pages read them once per tile (cache on); without the cache
    nothing is shared and every step is plain; tokens and log-probs are the same."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    reqs = [GenerateRequest(PREFIX + suffix(1 + i), params) for i in range(6)]
    reqs += [GenerateRequest(PREFIX[:17] + suffix(5), params) for _ in range(2)]
    engines = engine_pair(cascade_min_pages=1, cascade_rows=4)
    out = runs(engines, [reqs[:1], reqs])
    assert engines[True].stats.cascade_steps > 0 and engines[False].stats.cascade_steps == 0
    for a, b in zip(out[True], out[False]):
        assert_same_generation(a, b)
