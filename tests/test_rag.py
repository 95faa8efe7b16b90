"""Iter-RetGen: the device index against float64 numpy, the pipeline, its errors, the workload."""
import asyncio

import numpy as np
import pytest

from hetero_jax import AsyncEngine, Engine, EngineConfig, SamplingParams
from hetero_jax.bench.workloads import PAPER_STATS, synthetic_iter_retgen
from hetero_jax.models.tokenizer import ByteTokenizer
from hetero_jax.rag import (IterRetGenResult, QueryPlan, VectorIndex, build_index, fit_prompt,
                            iter_retgen_many, run_iter_retgen)

CFG = EngineConfig(token_budget=64, chunk_size=16, max_num_seqs=8, max_model_len=256,
                   token_buckets=(64,), page_buckets=(16,))  # few variants: fast compiles
GREEDY = SamplingParams(max_tokens=6, temperature=0)
DOCS = ["Cairo is the capital of Egypt.", "The Nile flows through Cairo.",
        "Ottawa is the capital of Canada.", "Paged attention stores KV in pages.",
        "JAX compiles with XLA.", "Bees dance to point at flowers.",
        "Pi is about 3.14159.", "The Moon is tidally locked.",
        "Gold has atomic number 79.", "Mount Everest is 8849 m high."]


@pytest.fixture(scope="module")
def engine():
    return Engine.from_preset("tiny", config=CFG)


@pytest.fixture(scope="module")
def index(engine):
    return VectorIndex.from_engine(engine, DOCS, ids=[f"d{i}" for i in range(len(DOCS))])


def numpy_top_k(vectors, queries, k):
    """float64 reference: cosine scores and rows of the k best, best first."""
    v = vectors / np.linalg.norm(vectors, axis=-1, keepdims=True)
    q = queries / np.linalg.norm(queries, axis=-1, keepdims=True)
    scores = q @ v.T
    rows = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
    return np.take_along_axis(scores, rows, -1), rows


@pytest.mark.parametrize("n, d, q, k", [(1, 8, 1, 1), (50, 16, 3, 5), (64, 32, 9, 64),
                                        (300, 24, 17, 10), (1000, 64, 1100, 7)])
def test_search_matches_float64_top_k(n, d, q, k):
    rng = np.random.default_rng(n + d)
    vectors, queries = rng.standard_normal((n, d)), rng.standard_normal((q, d))
    index = VectorIndex(d)
    index.add(vectors[: n // 2])
    index.add(vectors[n // 2:])  # two adds, one growth past the first bucket when n > 64
    assert len(index) == n and index.capacity >= n
    scores, rows = index.search(queries, k)
    want_scores, want_rows = numpy_top_k(vectors, queries, k)
    assert scores.shape == rows.shape == (q, k)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_allclose(scores, want_scores, atol=2e-6)
    np.testing.assert_allclose(np.linalg.norm(index.vectors, axis=-1), 1.0, atol=1e-6)
    one_scores, one_rows = index.search(queries[0], k)  # a [d] query gives [k] results
    np.testing.assert_array_equal(one_rows, rows[0])
    np.testing.assert_allclose(one_scores, scores[0], atol=1e-6)


def test_search_errors():
    index = VectorIndex(4)
    with pytest.raises(ValueError, match="index is empty"):
        index.search(np.ones(4), 1)
    index.add(np.eye(4)[:3], docs=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"k=4 must be an integer in \[1, 3\] \(the index size\)"):
        index.search(np.ones(4), 4)
    with pytest.raises(ValueError, match="k=0"):
        index.search(np.ones(4), 0)
    with pytest.raises(ValueError, match=r"expected \[Q, 4\]"):
        index.search(np.ones((2, 5)), 1)
    with pytest.raises(ValueError, match="NaN or inf"):
        index.search(np.full(4, np.nan), 1)
    with pytest.raises(ValueError, match=r"expected \[n, 4\]"):
        index.add(np.ones((2, 3)))
    with pytest.raises(ValueError, match="3 vectors but 2 documents"):
        index.add(np.ones((3, 4)), docs=["x", "y"])
    scores, rows = index.search(np.eye(4)[1], 1)  # hand-computed: the same unit vector wins
    assert rows.tolist() == [1] and scores[0] == pytest.approx(1.0)


def test_adding_within_a_bucket_does_not_recompile():
    rng = np.random.default_rng(0)
    index = VectorIndex(16, min_capacity=64)
    index.add(rng.standard_normal((5, 16)))
    index.search(rng.standard_normal((1, 16)), 3)
    warm = index.compiles
    for _ in range(6):  # 5 + 6 x 7 = 47 rows: still the 64-row bucket, same write bucket
        index.add(rng.standard_normal((7, 16)))
        index.search(rng.standard_normal((1, 16)), 3)
    assert index.compiles == warm == 2 and index.capacity == 64
    index.add(rng.standard_normal((20, 16)))  # 67 rows: the next bucket compiles anew
    index.search(rng.standard_normal((1, 16)), 3)
    assert index.capacity == 128 and index.compiles == warm + 2


def test_index_from_engine_and_bad_documents(engine, index):
    want = engine.embed(DOCS, use_tqdm=False)
    _, rows = index.search(want, 1)
    assert rows[:, 0].tolist() == list(range(len(DOCS)))  # each document finds itself
    assert index.ids[3] == "d3" and index.docs[3] == DOCS[3]
    with pytest.raises(ValueError, match="document 1 is empty"):
        VectorIndex.from_engine(engine, ["fine", "  "])
    with pytest.raises(ValueError, match="input 0 has 300 tokens > the embedding limit 256"):
        VectorIndex.from_engine(engine, ["x" * 299])

    async def main():
        aengine = AsyncEngine(engine)
        try:
            built = await build_index(aengine, DOCS[:4])
            with pytest.raises(ValueError, match="document 2: input 0 has 301 tokens"):
                await build_index(aengine, ["a", "b", "y" * 300])
            return built
        finally:
            await aengine.close()

    built = asyncio.run(main())
    np.testing.assert_allclose(built.vectors, index.vectors[:4], atol=1e-5)


def test_iter_retgen_iterations_and_deterministic_retrieval(engine, index):
    question = "What river flows through the capital of Egypt?"

    async def main():
        aengine = AsyncEngine(engine)
        try:
            alone = await run_iter_retgen(aengine, index, question, iterations=3, k=2,
                                          params=GREEDY)
            crowd = await iter_retgen_many(aengine, index, [question, "Where is Ottawa?",
                                                            question], 3, 2, GREEDY)
            return alone, crowd
        finally:
            await aengine.close()

    alone, crowd = asyncio.run(main())
    assert isinstance(alone, IterRetGenResult) and len(alone.iterations) == 3
    assert all(len(ids) == 2 and len(set(ids)) == 2 for ids in alone.retrieved)
    assert all(len(it.token_ids) == 6 for it in alone.iterations)
    assert alone.iterations[-1].embed_s == 0.0 and alone.total_s > 0
    _, want = index.search(engine.embed([question], use_tqdm=False), 2)
    assert alone.iterations[0].rows == want[0].tolist()  # round 1 searches with the question
    for again in (crowd[0], crowd[2]):  # alone or among others: same documents, same text
        assert again.retrieved == alone.retrieved
        assert [it.token_ids for it in again.iterations] == [
            it.token_ids for it in alone.iterations]


def test_bad_question_fails_only_its_coroutine(engine, index):
    free = engine.scheduler.pages.num_free

    async def main():
        aengine = AsyncEngine(engine)
        try:
            run = lambda q, k=2: run_iter_retgen(aengine, index, q, 2, k, GREEDY)  # noqa: E731
            return await asyncio.gather(run("Where is Cairo?"), run(""), run("q" * 300),
                                        run("Where is Ottawa?", len(DOCS) + 1),
                                        run("What is JAX?"), return_exceptions=True)
        finally:
            await aengine.close()

    good, empty, long, big_k, other = asyncio.run(main())
    assert isinstance(empty, ValueError) and "question is empty" in str(empty)
    assert isinstance(long, ValueError) and "more than the prompt limit of 250 tokens" in str(long)
    assert isinstance(big_k, ValueError) and "k=11" in str(big_k) and "[1, 10]" in str(big_k)
    assert len(good.iterations) == len(other.iterations) == 2
    assert engine.scheduler.pages.num_free == free and not engine.has_work()


def test_fit_prompt_cuts_documents_evenly():
    tok = ByteTokenizer()
    docs = ["a" * 50, "b" * 10, "c" * 50]
    prompt, n = fit_prompt(docs, "why?", tok, budget=80)
    assert n == len(tok.encode(prompt)) and 80 - 2 < n <= 80  # each cut adds 2 tokens
    assert "b" * 10 in prompt and "a" * 26 not in prompt  # the short one stays whole
    whole, n_whole = fit_prompt(docs, "why?", tok, budget=1000)
    assert all(d in whole for d in docs) and n_whole == len(tok.encode(whole))


def test_synthetic_workload_follows_the_paper_statistics():
    docs, plans = synthetic_iter_retgen(4000, scale=1.0, seed=0, num_docs=8)
    prompt = np.array([p.prompt_budget for p in plans])
    decode = np.array([p.max_tokens for p in plans])
    ks = np.array([p.k for p in plans])
    assert abs(prompt.mean() - PAPER_STATS["prompt_mean"]) < 25 and prompt.max() <= 2000
    assert abs(decode.mean() - PAPER_STATS["decode_mean"]) < 50 and decode.max() <= 4000
    assert ks.min() == 1 and ks.max() == 10 and set(ks) == set(range(1, 11))
    assert min(len(d) for d in docs) >= 2000  # long enough to fill any prompt budget
    again, plans2 = synthetic_iter_retgen(4000, scale=1.0, seed=0, num_docs=8)
    assert again == docs and plans2 == plans
    small = synthetic_iter_retgen(50, scale=0.1, seed=1)[1]
    assert max(p.max_tokens for p in small) <= 400 and max(p.prompt_budget for p in small) <= 200
    with pytest.raises(ValueError, match="scale=2"):
        synthetic_iter_retgen(10, scale=2)


def test_plan_prompt_length_is_met(engine):
    docs, plans = synthetic_iter_retgen(3, scale=0.1, seed=2, num_docs=10)

    async def main():
        aengine = AsyncEngine(engine)
        try:
            index = await build_index(aengine, docs)
            fast = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            return await iter_retgen_many(aengine, index, plans, 1, params=fast,
                                          concurrency=2, return_exceptions=False)
        finally:
            await aengine.close()

    for plan, result in zip(plans, asyncio.run(main())):
        assert isinstance(plan, QueryPlan) and len(result.retrieved[0]) == plan.k
        n = result.iterations[0].prompt_tokens
        assert plan.prompt_budget - plan.k < n <= plan.prompt_budget, (n, plan)


def test_shipped_corpus():
    import pathlib

    from hetero_jax.rag import load_corpus

    ids, texts = load_corpus(str(pathlib.Path(__file__).parents[1] / "data" / "corpus.jsonl"))
    assert 50 <= len(ids) <= 200 and len(set(ids)) == len(ids)
    assert all(20 < len(t) < 400 for t in texts)
