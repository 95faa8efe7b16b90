"""hetero_jax.train: the LoRA embedding adapter trained with optax on the tiny preset.

Invariants: the adapter raises held-out recall@5 by >= 0.3 over the base model's pooled
states; the engine serving the exported PEFT directory embeds as the training forward does
(cosine within 1e-5, every pooler); a run stopped after k steps and resumed from its orbax
checkpoint ends with the same weights as an uninterrupted run. Hand-computed: the loss of
two orthogonal pairs and recall@k. The command's --help imports no jax.
"""
import dataclasses
import os
import subprocess
import sys
from unittest import mock

import jax.numpy as jnp
import numpy as np
import pytest

from hetero_jax.models import llama
from hetero_jax.models.formats.hf_llama import export_hf_model
from hetero_jax.models.presets import preset_config
from hetero_jax.models.tokenizer import ByteTokenizer
from hetero_jax.train import data, fit
from hetero_jax.train.checkpoint import export_adapter
from hetero_jax.train.fit import FitOptions, fit_adapter, recall
from hetero_jax.offline.recall import recall_at_k
from hetero_jax.train.loss import contrastive_loss
from hetero_jax.train.step import AdapterConfig, embed_texts, init_lora, jit_train_step

CORPUS = os.path.join(os.path.dirname(__file__), "..", "data", "corpus.jsonl")
AC = AdapterConfig(pooling="mean", rank=8, learning_rate=5e-3, steps=24, warmup=6)
OPTS = FitOptions(batch_size=32, max_len=48, seed=0)
OPTIMISED = {"xla_backend_optimization_level": 2, "xla_llvm_disable_expensive_passes": False}


@pytest.fixture(scope="module")
def tiny():
    cfg = preset_config("tiny")
    return cfg, llama.init_params(cfg, 0), ByteTokenizer()


@pytest.fixture(scope="module")
def trained(tiny):
    """The suite compiles with XLA's cheapest backend passes (conftest), but the fit runs its
    one step 30 times: compiled fully optimised it costs 41 CPU s instead of 58 (measured),
    with the same weights' recall."""
    cfg, params, tok = tiny
    pairs = data.read_pairs(CORPUS)
    train, held = data.split(pairs, 0.25, 0)
    with mock.patch.object(fit, "train_step", jit_train_step(OPTIMISED)):
        state = fit_adapter(params, cfg, tok, train, AC, OPTS)
    pool = list(dict.fromkeys(pairs.passages))
    untrained = init_lora(cfg, AC, OPTS.seed)  # B = 0: exactly the base model, same compile
    before, after = (recall(params, cfg, tok, held, pool, "mean", lora, 5, OPTS.max_len)
                     for lora in (untrained, state.lora))
    return state.lora, before, after


def test_adapter_raises_held_out_recall_at_5(trained):
    _, before, after = trained
    assert after - before >= 0.3, f"recall@5 {before=:.3f} {after=:.3f}"


def test_engine_serves_the_trained_embeddings(tiny, trained, tmp_path):
    """Every pooler in one engine run (the pooling kind is per-request data)."""
    from hetero_jax import EmbedRequest, Engine, EngineConfig, PoolingParams

    cfg, params, tok = tiny
    export_hf_model(str(tmp_path / "base"), cfg, params)
    export_adapter(str(tmp_path / "adapter"), trained[0], cfg.num_layers, {})
    engine = Engine.from_pretrained(
        str(tmp_path / "base"), embed_adapter=str(tmp_path / "adapter"),
        config=EngineConfig(token_budget=64, chunk_size=32, max_num_seqs=8, max_model_len=256,
                            token_buckets=(64,), page_buckets=(16,)))  # few variants to compile
    texts = ["What is Mars known for?", "Mars is the fourth planet from the Sun. Its red "
             "colour comes from iron oxide in its dust. It has two small moons.", "x"]
    poolers = ("mean", "weighted_mean", "cls", "last")
    outs = engine.run([EmbedRequest(tok.encode(t), PoolingParams(k, normalize=True))
                       for k in poolers for t in texts], use_tqdm=False)
    tokens, lengths = data.encode(texts, tok, 256)
    for i, pooling in enumerate(poolers):
        want = embed_texts(params, cfg, tokens, lengths, pooling, trained[0])  # [3, d], unit
        got = np.stack([o.embedding for o in outs[3 * i:3 * i + 3]])
        cos = np.sum(got * want, axis=1)
        assert np.all(cos > 1 - 1e-5), f"{pooling}: cosine {cos}"


@pytest.mark.slow  # 14 s: two fits and their orbax checkpoints
def test_resumed_run_equals_uninterrupted(tiny, tmp_path):
    cfg, params, tok = tiny
    train = data.read_pairs(CORPUS)
    whole = fit_adapter(params, cfg, tok, train, AC, dataclasses.replace(OPTS, stop_after=4))
    opts = dataclasses.replace(OPTS, stop_after=2, checkpoint_every=2,
                               checkpoint_dir=str(tmp_path / "ckpt"))
    first = fit_adapter(params, cfg, tok, train, AC, opts)  # "killed" after 2 steps
    assert int(first.step) == 2
    steps = []
    resumed = fit_adapter(params, cfg, tok, train, AC, opts, lambda k, loss: steps.append(k))
    assert steps == [3, 4] and int(resumed.step) == 4
    for w in AC.targets:
        for got, want in zip(resumed.lora[w], whole.lora[w]):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_contrastive_loss_and_recall_by_hand():
    q = jnp.eye(2)
    # each query equals its passage: log-softmax of [1/t, 0] at the diagonal, both directions
    t = 0.5
    want = np.log1p(np.exp(-1 / t))
    got = contrastive_loss(q, q, jnp.array([0, 1]), t)
    assert abs(float(got) - want) < 1e-6
    pool = np.eye(3)
    queries = np.array([[1.0, 0.1, 0], [0, 0, 1.0]])
    assert recall_at_k(queries, pool, np.array([1, 2]), 1) == 0.5
    assert recall_at_k(queries, pool, np.array([1, 2]), 2) == 1.0


def test_train_adapter_help_imports_no_jax():
    code = ("import sys\nfrom hetero_jax.cli import main\ntry:\n"
            "    main(['train-adapter', '--help'])\n"
            "except SystemExit as e:\n    print(e.code, 'jax' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.split()[-2:] == ["0", "False"], (proc.stdout[-500:], proc.stderr[-2000:])
    assert "--pooling {mean,weighted_mean,cls,last}" in proc.stdout
