"""Engine generation against transformers, and invariants of the paged mixed step."""
import dataclasses

import jax
import numpy as np
import pytest
import torch

from hetero_jax import Engine, EngineConfig, SamplingParams
from hetero_jax.runner.batch import uses_cascade
from tests.hf_models import hf_logits
from tests.model_runs import full_logits

# One token and one page bucket (3 variants, not 12): compiling is most of these tests' time,
# and `test_results_do_not_depend_on_batch_bucket_or_pages` compares other buckets with these.
CFG = EngineConfig(token_budget=32, chunk_size=16, max_num_seqs=8, page_size=8,
                   max_model_len=256, token_buckets=(32,), page_buckets=(32,))
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=3)


def prompts(vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_greedy_generation_matches_transformers(hf_model, name):
    """Prompts longer than chunk_size prefill in chunks beside other requests' decodes."""
    path, model = hf_model(name)
    engine = Engine.from_pretrained(path, config=CFG)
    ps = prompts(engine.model_cfg.vocab_size, [5, 40, 70, 3, 23])
    outs = engine.generate(ps, GREEDY, use_tqdm=False)
    assert engine.stats.steps > 0 and all(len(o.token_ids) == 32 for o in outs)
    for p, o in zip(ps, outs):
        logits = hf_logits(model, p + o.token_ids[:-1])[len(p) - 1:]  # [32, V]
        ref_lp = torch.log_softmax(torch.tensor(logits, dtype=torch.float64), -1).numpy()
        picked = ref_lp[np.arange(32), o.token_ids]
        # our token is transformers' top-1 (up to fp32 ties) at every step
        np.testing.assert_array_less(ref_lp.max(-1) - picked, 1e-4)
        np.testing.assert_allclose([lp["logprob"] for lp in o.logprobs], picked, atol=1e-4)
        top = [[t for t, _ in lp["top"]] for lp in o.logprobs]
        assert [t[0] for t in top] == o.token_ids
        np.testing.assert_allclose([[v for _, v in lp["top"]] for lp in o.logprobs],
                                   np.take_along_axis(ref_lp, np.array(top), -1), atol=1e-4)


def test_results_do_not_depend_on_batch_bucket_or_pages(hf_model):
    """One prompt alone vs beside others, under other buckets, page sizes and chunk sizes."""
    path, _ = hf_model("mistral")
    ps = prompts(300, [37, 5, 61, 12, 8])
    alone = Engine.from_pretrained(path, config=CFG).generate(ps[:1], GREEDY, use_tqdm=False)[0]
    other = EngineConfig(token_budget=64, chunk_size=8, max_num_seqs=4, page_size=4,
                         max_model_len=256, num_pages=80, token_buckets=(16, 64),
                         page_buckets=(64,))  # two token buckets, neither CFG's
    engine = Engine.from_pretrained(path, config=other)
    engine.generate(ps[3:], GREEDY, use_tqdm=False)  # dirty the pages first
    crowd = engine.generate(ps, GREEDY, use_tqdm=False)[0]
    assert crowd.token_ids == alone.token_ids
    np.testing.assert_allclose([lp["logprob"] for lp in crowd.logprobs],
                               [lp["logprob"] for lp in alone.logprobs], atol=1e-5)


def test_paged_decode_equals_full_forward():
    """Each decode step's logprob equals the full forward of the sequence so far (tiny preset)."""
    engine = Engine.from_preset("tiny", config=CFG)
    out = engine.generate([[256, 72, 105, 33]], GREEDY, use_tqdm=False)[0]
    seq = out.prompt_token_ids + out.token_ids[:-1]
    ref = full_logits(engine.model_cfg, engine.runner.params, seq)[len(out.prompt_token_ids) - 1:]
    ref_lp = np.asarray(jax.nn.log_softmax(ref, axis=-1))
    assert out.token_ids == ref.argmax(-1).tolist()
    np.testing.assert_allclose([lp["logprob"] for lp in out.logprobs],
                               ref_lp[np.arange(len(out.token_ids)), out.token_ids], atol=1e-5)


def test_zero_compiles_after_warmup():
    """warmup() builds every variant not already on disk; no step compiles after it (one may
    load a variant an earlier engine of this configuration left in the persistent cache)."""
    few = dataclasses.replace(CFG, token_buckets=(8, 32), warmup="all")  # 4 variants: two token buckets
    engine = Engine.from_preset("tiny", config=few)
    on_disk = engine.runner.manifest().keys()
    n = engine.warmup()
    assert n == len(set(engine.config.variants()) - on_disk) == engine.stats.compiles
    assert set(engine.config.variants()) <= engine.runner.manifest().keys()
    compiled = engine.stats.compiles - engine.stats.compile_loads
    rng = np.random.default_rng(1)
    ps = [rng.integers(0, 256, int(k)).tolist() for k in rng.integers(1, 120, 12)]
    params = [SamplingParams(max_tokens=int(m), temperature=float(t), top_k=int(k), seed=i)
              for i, (m, t, k) in enumerate(zip(rng.integers(1, 40, 12), rng.uniform(0, 2, 12),
                                                rng.integers(0, 50, 12)))]
    engine.generate(ps, params, use_tqdm=False)
    assert engine.stats.compiles - engine.stats.compile_loads == compiled, \
        "a step compiled after warmup()"


def test_preemption_recomputes_and_loses_nothing():
    """A cache too small for all requests at once: they wait or are preempted, and still
    produce exactly what they produce alone."""
    ps = [[256] + list(range(60 + i, 90 + i)) for i in range(4)]
    alone = Engine.from_preset("tiny", config=CFG).generate(ps, GREEDY, use_tqdm=False)
    tight = EngineConfig(token_budget=32, chunk_size=16, max_num_seqs=8, page_size=8,
                         max_model_len=64, num_pages=17, token_buckets=(32,))
    engine = Engine.from_preset("tiny", config=tight)
    outs = engine.generate(ps, GREEDY, use_tqdm=False)
    assert engine.stats.preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]


@pytest.mark.slow  # ~45 s in interpret mode; the kernel alone: tests/test_pallas_attention.py
def test_pallas_attention_engine_matches_xla():
    """Decode, mixed and cascade steps give the same tokens and log-probs with the Pallas
    kernel, in the unrolled layer loop (a Python int layer) and in `scan` (a traced one, as on
    GPUs); with Pallas, cascade also runs in mixed steps (the shared prompts decode while the
    last, long one prefills). On a CPU the kernel runs in interpret mode; scripts/gpu_check.sh
    runs this on a GPU (float32 at the highest matmul precision, so TF32 does not blur the
    comparison)."""
    shared = list(range(60, 100))  # 5 pages of 8 shared: decode steps run as cascade steps
    ps = [[256] + list(range(40, 40 + n)) for n in (3, 30, 11)] + [
        [256] + shared + [n] for n in (7, 8, 9)] + [[256] + list(range(100, 190))]
    sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
    cfg = dataclasses.replace(CFG, dtype="float32", cascade_min_pages=1)
    runs = []
    with jax.default_matmul_precision("highest"):
        for impl, loop in (("xla", "auto"), ("pallas", "unrolled"), ("pallas", "scan")):
            engine = Engine.from_preset("tiny", config=dataclasses.replace(
                cfg, attention_impl=impl, layer_loop=loop))
            steps, launch = [], engine.runner.launch

            def record(items, key, batch, launch=launch, steps=steps):
                steps.append((key[2] > 0, uses_cascade(batch)))
                return launch(items, key, batch)

            engine.runner.launch = record
            runs.append(engine.generate(ps, sp, use_tqdm=False))
            assert engine.runner.cascade_steps > 0, (impl, loop)
            assert ((True, True) in steps) == (impl == "pallas"), (impl, loop, steps)
    for run in runs[1:]:
        for x, p in zip(runs[0], run):
            assert x.token_ids == p.token_ids
            np.testing.assert_allclose([lp["logprob"] for lp in p.logprobs],
                                       [lp["logprob"] for lp in x.logprobs], atol=1e-5)