"""The model function against transformers: full-sequence logits, several families/shapes."""
import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from hetero_jax.models import layers
from hetero_jax.models.formats.hf_llama import load_hf_model
from tests.hf_models import hf_logits
from tests.model_runs import full_logits


@pytest.mark.parametrize("name", ["llama3", "mistral", "qwen2"])
def test_full_sequence_logits_match_transformers(hf_model, name):
    path, model = hf_model(name)
    cfg, params = load_hf_model(path)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 150)  # past the llama3 64 window
    want = hf_logits(model, ids)
    got = full_logits(cfg, params, ids)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-4, f"{name}: max relative error {err:.2e}"


def test_config_mapping(hf_model):
    cfg, params = load_hf_model(hf_model("llama3")[0])
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 1, 24)
    assert dict(cfg.rope_scaling)["factor"] == 8.0
    cfg, params = load_hf_model(hf_model("qwen2")[0])
    assert cfg.tie_word_embeddings and cfg.qkv_bias and "lm_head" not in params
    assert params["layers"]["bq"].shape == (2, 64)


def test_bf16_logits_close_to_fp32(hf_model):
    """bf16 weights: no worse than 1.5x the error of transformers' own bf16 run."""
    path, model = hf_model("mistral")
    cfg, params = load_hf_model(path, jnp.bfloat16)
    ids = np.arange(3, 60)
    want = hf_logits(model, ids)
    torch_bf16 = hf_logits(copy.deepcopy(model).to(torch.bfloat16), ids)
    rel = lambda x: np.linalg.norm(x - want) / np.linalg.norm(want)  # noqa: E731
    ours = rel(full_logits(cfg, params, ids).astype(np.float32))
    assert ours < 1.5 * rel(torch_bf16), f"bf16 relative L2 {ours:.2e} vs torch {rel(torch_bf16):.2e}"


def test_unrolled_layers_equal_scan(hf_model):
    cfg, params = load_hf_model(hf_model("llama3")[0])
    ids = np.arange(5, 45)
    np.testing.assert_allclose(full_logits(cfg, layers.split_layers(params), ids),
                               full_logits(cfg, params, ids), rtol=1e-5, atol=1e-5)
    restacked = layers.stack_layers(layers.split_layers(params))
    np.testing.assert_array_equal(restacked["layers"]["wq"], params["layers"]["wq"])


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
@pytest.mark.parametrize("unrolled", [False, True])
def test_feature_major_mlp_matches_transformers(hf_model, name, unrolled):
    """The MLP over transposed weights (the CPU runner's layout) gives transformers' logits, at
    several lengths (1, 7 and 40 tokens: XLA picks different matmuls by row count), stacked
    and per-layer; `row_major_mlp` restores the params exactly."""
    path, model = hf_model(name)
    cfg, params = load_hf_model(path)
    params = layers.split_layers(params) if unrolled else params
    fm = layers.feature_major_mlp(params)
    assert layers.is_feature_major(fm) and not layers.is_feature_major(params)
    for n in (1, 7, 40):
        ids = np.random.default_rng(n).integers(0, cfg.vocab_size, n)
        want = hf_logits(model, ids)
        err = np.abs(full_logits(cfg, fm, ids) - want).max() / np.abs(want).max()
        assert err < 1e-4, f"{name}, {n} tokens: max relative error {err:.2e}"
    back = layers.row_major_mlp(fm)
    assert layers.row_major_mlp(back) is back and layers.feature_major_mlp(fm) is fm
    for a, b in zip(*(jax.tree.leaves_with_path(p) for p in (back, params))):
        assert a[0] == b[0]
        np.testing.assert_array_equal(a[1], b[1])
