"""Steps and kernels compiled for an H200 target on this CPU (slow; the `gpu-compile` extra).

    pip install -e '.[test,gpu-compile]'
    JAX_PLATFORMS=cpu python -m pytest -q -n 0 -m slow tests/test_h200_compile.py

What XLA's GPU compiler made of the step is read, never run: the step's temporaries stay
below one layer's K+V (the in-place cache read: a slice in front of the kernel used to copy
exactly one layer's K+V), and the bf16 kernels compile with no register spills.
"""
import jax
import numpy as np
import pytest

from hetero_jax.config import EngineConfig
from hetero_jax.models.presets import preset_config
from hetero_jax.ops.cascade import tile_list_spec
from hetero_jax.ops.pallas_attention import ragged_paged_attention_pallas
from hetero_jax.runner import gpu_lowering, h200
from tests.batches import random_batch

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(h200.unavailable() is not None,
                                 reason=str(h200.unavailable()))]

ENGINE = EngineConfig(max_model_len=2048, max_num_seqs=32)


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("key", [(32, 32, 0, 128, 0), (256, 32, 4, 128, 128)])
def test_step_temporaries_below_one_layer_of_kv(preset, key):
    model_cfg = preset_config(preset)
    cfg = gpu_lowering.gpu_config(model_cfg, ENGINE)
    compiled = h200.compile_step(model_cfg, cfg, key)
    temp = compiled.memory_analysis().temp_size_in_bytes
    one_layer = h200.one_layer_kv_bytes(model_cfg, cfg)
    assert temp < one_layer / 4, f"{temp=} vs one layer's K+V {one_layer}"
    text = compiled.as_text()  # the unrolled layers: two launches each (own pages, tiles)
    assert text.count('custom_call_target="__gpu$xla.gpu.triton"') == 2 * model_cfg.num_layers


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_kernel_has_no_spills(head_dim):
    """ptxas compiles the bf16 kernel (32 query heads on 8 KV heads, 64 sequences) without
    spilling; the float32 one at head_dim 128 (IEEE dots on CUDA cores) spills, which shows
    the check is live."""
    b = random_batch(np.random.default_rng(0), [1] * 48 + [64] * 2, [500] * 50, 32, 8,
                     head_dim, page_size=16)

    def structs(dtype):
        return {k: jax.ShapeDtypeStruct(np.shape(v), dtype if k in ("q", "k_pages", "v_pages")
                                        else np.asarray(v).dtype) for k, v in b.items()}

    kernel = jax.jit(ragged_paged_attention_pallas)
    h200.compile_for_h200(jax.jit(lambda a: kernel(**a)), structs(jax.numpy.bfloat16),
                          fail_on_spills=True)
    if head_dim == 128:
        with jax.default_matmul_precision("highest"), pytest.raises(Exception, match="spill"):
            h200.compile_for_h200(jax.jit(lambda a: kernel(**a)), structs(np.float32),
                                  fail_on_spills=True)


def test_bf16_kernel_with_cascade_tiles_has_no_spills():
    """The same batch with a cascade `TileList` (the GPU engine's every step): the first
    launch with its skipped pages and the tiles' launch, reading queries through the token
    map, compile without spilling at head_dim 128."""
    b = random_batch(np.random.default_rng(0), [1] * 48 + [64] * 2, [500] * 50, 32, 8, 128,
                     page_size=16)
    structs = {k: jax.ShapeDtypeStruct(np.shape(v), jax.numpy.bfloat16 if k in (
        "q", "k_pages", "v_pages") else np.asarray(v).dtype) for k, v in b.items()}
    tiles = tile_list_spec(b["kv_lens"].shape[0])
    h200.compile_for_h200(jax.jit(lambda a, c: ragged_paged_attention_pallas(
        **a, cascade=c, num_multi_query_seqs=2)), structs, tiles, fail_on_spills=True)
