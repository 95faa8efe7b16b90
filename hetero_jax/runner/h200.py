"""Engine steps compiled for an NVIDIA H200 on a host without a GPU (deviceless compile).

In: a model config, an `EngineConfig`, a variant key (or any jitted function and its shape
structs). Out: the compiled executable of XLA's real GPU pipeline for sm_90 (Triton, PTX,
ptxas, buffer assignment), to read and never run: `memory_analysis()`, the optimised HLO
(`as_text()`), and, compiled with `fail_on_spills=True`, whether ptxas had to spill registers.

Needs the `gpu-compile` extra (jax-cuda12-pjrt and jax-cuda12-plugin at jax's version: the
458 MB PJRT plugin, no CUDA libraries), `JAX_PLATFORMS=cpu` set before jax starts (else the
plugin tries a GPU and prints a configuration error), and `ptxas` on the PATH or in
/usr/local/cuda/bin. The target is `h200.txtpb` beside this file, a `GpuTargetConfigProto`:
132 SMs of compute capability 9.0, 228 KB shared memory each, 50 MB L2, 141 GB of HBM3e at
4.8 TB/s. Without a device XLA does not autotune: GEMMs compile as its default Triton
fusions, not the cuBLAS calls a real H200 may pick, so the GEMMs' bytes are an estimate.
"""
from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp

from hetero_jax.config import EngineConfig
from hetero_jax.models.config import ModelConfig
from hetero_jax.runner import gpu_lowering

SPEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "h200.txtpb")


def unavailable() -> str | None:
    """Why this process cannot compile for the H200 target, or None when it can."""
    if importlib.util.find_spec("jax_plugins") is None or \
            importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        return "no CUDA PJRT plugin: pip install -e '.[gpu-compile]'"
    if os.environ.get("JAX_PLATFORMS", "") != "cpu":
        return "set JAX_PLATFORMS=cpu before jax starts (the plugin would look for a GPU)"
    return None


def h200_devices(count: int = 1) -> list:
    """`count` compile-only H200 devices of one host (`count` > 1 for tensor parallelism)."""
    from jax.experimental import topologies
    with open(SPEC) as f:
        topology = topologies.get_topology_desc(platform="cuda", target_config=f.read(),
                                                topology=f"1x1x{count}")
    return list(topology.devices)


def on_device(tree, device):
    """Shape structs of `tree`'s leaves, committed to `device`."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        tree)


def compile_for_h200(fn, *args, fail_on_spills: bool = False):
    """Jitted `fn` compiled for one H200 at `args` (shape structs, placed there by this
    function). With `fail_on_spills`, a kernel whose registers spill raises (ptxas's verdict,
    from XLA's `xla_gpu_fail_ptx_compilation_on_register_spilling`)."""
    args = on_device(args, h200_devices()[0])
    options = {"xla_gpu_fail_ptx_compilation_on_register_spilling": True} \
        if fail_on_spills else None
    return fn.lower(*args).compile(compiler_options=options)


def compile_step(model_cfg: ModelConfig, cfg: EngineConfig, key: tuple, **kw):
    """Variant `key` of the GPU engine's step (`gpu_lowering.gpu_config` of `cfg`: Pallas,
    unrolled or `cfg.layer_loop="scan"` layers, bf16 by default) compiled for the H200."""
    fn = gpu_lowering.step_for_gpu(model_cfg, cfg, key)
    return compile_for_h200(fn, *gpu_lowering.step_args(model_cfg, cfg, key), **kw)


def one_layer_kv_bytes(model_cfg: ModelConfig, cfg: EngineConfig) -> int:
    """Bytes of one layer's K and V pages in a resolved `cfg`: what a per-layer slice of the
    stacked cache in front of the kernel used to copy."""
    per_page = cfg.page_size * model_cfg.num_kv_heads * model_cfg.head_dim
    return 2 * cfg.num_pages * per_page * jnp.dtype(cfg.dtype).itemsize
