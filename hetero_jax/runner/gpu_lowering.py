"""An engine step lowered for an NVIDIA GPU on a host without one.

In: a model config, an `EngineConfig` and a variant key `(T, S, Sc, pages_per_seq,
second_pages)`. Out: the step (`decoder.step`, the Pallas kernel, the scanned layer loop)
exported for the `cuda` platform as StableHLO text, with no GPU, no CUDA plugin and nothing
allocated: every argument is a `jax.ShapeDtypeStruct` (`step_args`). The Triton kernels stay
custom calls in that text, so `triton_calls` counts the launches a step makes per layer body.
`runner/h200.py` goes further, through XLA's real GPU compiler (the `gpu-compile` extra).

On jax >= 0.11 lowering for `cuda` on a CPU host needs an abstract GPU device
(`abstract_gpu()`); on 0.10 the platform name alone is enough.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp

from hetero_jax.config import EngineConfig
from hetero_jax.models import llama
from hetero_jax.models.config import ModelConfig
from hetero_jax.models.layers import split_layers
from hetero_jax.ops.pallas_attention import H200_SMS
from hetero_jax.runner.batch import batch_spec
from hetero_jax.runner.decoder import bind_step, zero_state
from hetero_jax.runner.wire import wire_spec

TRITON_TARGET = "__gpu$xla.gpu.triton"


def gpu_config(model_cfg: ModelConfig, cfg: EngineConfig) -> EngineConfig:
    """`cfg` as a GPU engine resolves it: the Pallas kernel, layer_loop "auto" as "unrolled"
    (`layers.for_layer_loop`), dtype "auto" as bfloat16, and every None filled from the
    model."""
    cfg = dataclasses.replace(cfg, attention_impl="pallas", dtype=cfg.dtype_on("gpu"),
                              layer_loop="unrolled" if cfg.layer_loop == "auto" else cfg.layer_loop)
    kv_bytes = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * \
        jnp.dtype(cfg.dtype).itemsize
    return cfg.resolve(model_cfg.max_position_embeddings, kv_bytes)


def step_args(model_cfg: ModelConfig, cfg: EngineConfig, key: tuple) -> tuple:
    """(params, state, ints, floats) of variant `key` of a resolved `cfg` as shape structs:
    layer weights in `cfg.dtype` (stacked, or per layer for `layer_loop="unrolled"`), the KV
    cache and pooler state, the step's batch as its two-array wire (`wire.py`)."""
    dtype = jnp.dtype(cfg.dtype)
    params = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, dtype),
                          llama.param_shapes(model_cfg), is_leaf=lambda x: isinstance(x, tuple))
    if cfg.layer_loop == "unrolled":
        params = jax.eval_shape(split_layers, params)
    state = jax.eval_shape(lambda: zero_state(model_cfg, cfg))
    return (params, state, *wire_spec(batch_spec(cfg, *key)))


def step_for_gpu(model_cfg: ModelConfig, cfg: EngineConfig, key: tuple):
    """The jitted step of variant `key` (state donated, as the runner compiles it) with the
    Triton kernel (not interpret mode)."""
    fn = bind_step(model_cfg, cfg, key, impl="pallas", interpret=False)
    return jax.jit(fn, donate_argnums=(1,))


def abstract_gpu():
    """A context in which jax lowers for `cuda` without a GPU: an abstract H200 mesh on
    jax >= 0.11, nothing on 0.10 (where the platform name is enough)."""
    if tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11):
        return contextlib.nullcontext()
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
    return use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        "NVIDIA H200", H200_SMS, "gpu")))


def export_for_cuda(fn, *args, **kwargs) -> str:
    """StableHLO text of jitted `fn` at `args`/`kwargs` (shape structs) exported for `cuda`;
    the Triton custom calls are allowed (jax.export refuses unknown custom calls by default)."""
    from jax.export import DisabledSafetyCheck, export
    with abstract_gpu():
        exported = export(fn, platforms=("cuda",), disabled_checks=[
            DisabledSafetyCheck.custom_call(TRITON_TARGET)])(*args, **kwargs)
    return exported.mlir_module()


def triton_calls(text: str) -> int:
    """The Triton kernel calls written in lowered StableHLO text: the kernels one layer
    launches (every layer calls the same lowered function, unrolled or scanned)."""
    return text.count(f"custom_call @{TRITON_TARGET}(")


def cache_slices(text: str, cache: jax.ShapeDtypeStruct) -> int:
    """Slices taken of a whole stacked KV cache `cache` [L, P, page_size, Hkv, D] in lowered
    text: each one is a layer's pages copied out in front of a custom call."""
    dims = "x".join(map(str, cache.shape))
    element = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}[str(cache.dtype)]
    pattern = rf"stablehlo\.(dynamic_slice|slice) [^\n]*: \(tensor<{dims}x{element}>"
    return len(re.findall(pattern, text))
