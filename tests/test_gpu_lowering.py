"""Every GPU step lowered for `cuda` on this CPU host (no GPU, no CUDA plugin): the Triton
kernel at several head layouts and dtypes, and every step variant of a small engine, with the
launches they should make and the KV cache passed whole (never a layer sliced out, a copy)."""
import dataclasses
import re

import jax
import numpy as np
import pytest

from hetero_jax.config import EngineConfig
from hetero_jax.models.config import ModelConfig
from hetero_jax.models.presets import preset_config
from hetero_jax.ops.pallas_attention import ragged_paged_attention_pallas
from hetero_jax.runner import gpu_lowering as gl
from hetero_jax.runner.batch import is_cascade
from tests.batches import random_batch

pytestmark = pytest.mark.skipif(jax.default_backend() == "gpu",
                                reason="on a GPU the kernels run: tests/test_pallas_attention.py")

SMALL_ENGINE = EngineConfig(max_model_len=256, token_budget=64, chunk_size=32, max_num_seqs=8,
                            max_chunk_seqs=2, token_buckets=(16, 64), seq_buckets=(8,),
                            page_buckets=(4, 16))  # a second page width, as a user may ask


def spec(b):
    return {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for k, v in b.items()}


@pytest.mark.parametrize("hq,hkv,d", [(24, 4, 128), (8, 8, 64), (32, 8, 128), (12, 4, 80),
                                      (4, 1, 48)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_lowers_to_one_triton_call(hq, hkv, d, dtype):
    b = random_batch(np.random.default_rng(0), [1, 9, 1], [40, 0, 7], hq, hkv, d, page_size=16)
    b = {k: (v.astype(dtype) if k in ("q", "k_pages", "v_pages") else v) for k, v in b.items()}
    text = gl.export_for_cuda(jax.jit(ragged_paged_attention_pallas), **spec(b))
    assert gl.triton_calls(text) == 1


def test_every_step_variant_lowers_with_its_launches_and_no_cache_copy():
    """Each variant of a tiny engine on the GPU path (Pallas, unrolled layers, bf16): two Triton
    launches per layer (each sequence's own pages, then the cascade tiles, whose list is data:
    no variant is a cascade one), the stacked cache never sliced, and no control flow, which
    XLA runs from the host on a GPU (a conditional waits there for the kernels before it; the
    sampler's branches are the host's choice, `sampler.needs`)."""
    model_cfg = preset_config("tiny")
    cfg = gl.gpu_config(model_cfg, SMALL_ENGINE)
    assert cfg.dtype == "bfloat16" and cfg.layer_loop == "unrolled"
    variants = cfg.variants()
    assert len(variants) >= 8 and not any(map(is_cascade, variants))
    for key in variants:
        args = gl.step_args(model_cfg, cfg, key)
        text = gl.export_for_cuda(gl.step_for_gpu(model_cfg, cfg, key), *args)
        assert gl.triton_calls(text) == 2, key
        assert gl.cache_slices(text, args[1].kv.k) == 0, key
        assert not re.findall(r"stablehlo\.(?:while|case|if)\b", text), key


@pytest.mark.parametrize("decode_only", [False, True])
def test_scanned_layers_slice_no_cache_either(decode_only):
    """With `layer_loop="scan"` the layer index is traced; both launches still get the whole
    cache (the old `k_cache[layer]` was a dynamic slice here, copied per layer)."""
    model_cfg = preset_config("tiny")
    cfg = gl.gpu_config(model_cfg, dataclasses.replace(SMALL_ENGINE, layer_loop="scan"))
    key = next(k for k in cfg.variants() if (k[2] == 0) == decode_only)
    args = gl.step_args(model_cfg, cfg, key)
    text = gl.export_for_cuda(gl.step_for_gpu(model_cfg, cfg, key), *args)
    assert gl.triton_calls(text) == 2
    assert gl.cache_slices(text, args[1].kv.k) == 0


def test_cache_slices_sees_a_sliced_layer():
    """The counter behind the no-copy assert finds the slice the old layer loop made."""
    cache = jax.ShapeDtypeStruct((3, 5, 4, 2, 16), np.float32)
    text = jax.jit(lambda c, i: c[i] * 2).lower(cache, np.int32(1)).as_text()
    assert gl.cache_slices(text, cache) == 1


def test_odd_head_size_and_gqa_engine_lowers():
    """A model with head_dim 80 and 6 query heads per KV head lowers on the GPU path."""
    model_cfg = ModelConfig(vocab_size=512, hidden_size=480, intermediate_size=512,
                            num_layers=2, num_heads=6, num_kv_heads=1, head_dim=80,
                            max_position_embeddings=512, bos_token_id=1, eos_token_ids=(2,))
    cfg = gl.gpu_config(model_cfg, SMALL_ENGINE)
    key = cfg.variants()[-1]
    text = gl.export_for_cuda(gl.step_for_gpu(model_cfg, cfg, key),
                              *gl.step_args(model_cfg, cfg, key))
    assert gl.triton_calls(text) == 2


@pytest.mark.parametrize("preset", ["tiny", "small", "llama-8b-shape"])
def test_gpu_defaults_compile_at_most_24_variants(preset):
    """The Pallas kernel loops over each sequence's pages, so a GPU engine's default page
    buckets are one, and cascade tiles are data: its variants are T x S x chunk slots, not x
    page widths or x cascade (17 at the defaults, where cascade keys made 20)."""
    model_cfg = preset_config(preset)
    cfg = gl.gpu_config(model_cfg, EngineConfig())
    assert cfg.page_buckets == (-(-cfg.max_model_len // cfg.page_size),)
    assert len(cfg.variants()) == 17
    assert len(EngineConfig().resolve(cfg.max_model_len, 1024).variants()) > 24  # XLA: widths
