"""Tensor parallelism: the decoder's Megatron layout over a one-axis device mesh.

In: a model config, the params pytree (stacked or `split_layers`), the tensor-parallel
degree N (`EngineConfig.tensor_parallel`: the `Engine` builds this runner when N > 1, after
`check_tensor_parallel` passed on the model's config before any weights were made or read)
and the devices. Out: a `ShardedDecoderRunner`, the `DecoderRunner` whose params,
KV cache and jitted step are laid out on the mesh `("tp",)` of N devices, with explicit
in/out shardings and the sharded state donated; the batch (its wire), the logits and the
packed output are replicated, so the scheduler, the sampler, the pooler and the one
device->host copy do not change. XLA's SPMD partitioner inserts the collectives: one
all-reduce after `wo` and one after `w_down` per layer, and one all-gather of the LM head's
vocabulary shards.

The layout is `PARTITION_RULES`, an ordered table of regex -> `PartitionSpec` over a leaf's
path (`layers/0/wq`, or stacked `layers/wq`, whose leading layer axis is never split);
the first match wins and the last rule replicates the rest. q/k/v and gate/up are split by
heads and hidden units (their output), o and down on their input, the embedding and LM head
by vocabulary (replicated when N does not divide it), the KV pages by KV head. When N
exceeds the KV heads, each KV head is repeated N / Hkv times first (`expand_kv_heads`), so
every shard holds the KV heads its query heads read (`unexpand_kv_heads` undoes it for
`Engine.save`). The XLA attention is partitioned by XLA like the rest; the Pallas kernel, a
custom call XLA cannot split, runs once per shard under `shard_map` (`shard_attention`): each
device gets its Hq / N query heads and the KV pages of its Hkv / N KV heads (the group is
unchanged, so it is the TP=1 kernel at fewer heads), the lengths, page tables and cascade plan
whole, and returns its heads of the output, which `wo` (split on its input) all-reduces.
No split leaf nor the KV cache is ever whole on one device. Host (numpy) weights, as the
Engine makes them with N > 1 (`from_pretrained`'s checkpoint, preset random weights, LoRA
stacks), are cut on the host and each device gets only its shards (`place`:
`jax.make_array_from_callback`). An engine checkpoint (`Engine.load`) is restored by orbax into
`restore_targets`: each leaf straight into its sharding on `tp_mesh` (the runner's mesh, so
`place` then moves nothing), except the K/V leaves whose heads are repeated, which come to the
host and take the host path. The KV cache and pooler state are made on the mesh by a jitted
zero-fill.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetero_jax.config import EngineConfig
from hetero_jax.models import llama
from hetero_jax.models.config import ModelConfig
from hetero_jax.models.layers import for_layer_loop
from hetero_jax.runner.decoder import DecoderRunner, DeviceState
from hetero_jax.runner.executables import compile_options
from hetero_jax.runner.wire import wire_spec

# The Pallas kernel's outputs carry no varying-axes type, so shard_map's check must be off.
try:  # jax >= 0.7 (the experimental module is deprecated, and gone in later releases)
    from jax import shard_map as _shard_map
    _UNCHECKED = {"check_vma": False}
except ImportError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _shard_map
    _UNCHECKED = {"check_rep": False}

AXIS = "tp"
PARTITION_RULES = (  # (regex over the leaf path, spec of the leaf without its layer axis)
    (r"^embed$", P(AXIS, None)),  # [V, d]: by vocabulary
    (r"^lm_head$", P(None, AXIS)),  # [d, V]
    (r"(^|/)(wq|wk|wv|w_gate|w_up)$", P(None, AXIS)),  # [d, out]: by heads / hidden units
    (r"(^|/)(bq|bk|bv)$", P(AXIS)),  # [out]
    (r"(^|/)(wo|w_down)$", P(AXIS, None)),  # [in, d]: on the input
    (r"(^|/)lora_b_(wq|wk|wv|w_gate|w_up)$", P(None, None, AXIS)),  # [A, r, out]
    (r"(^|/)lora_a_(wo|w_down)$", P(None, AXIS, None)),  # [A, in, r]
    (r".*", P()),  # norms, the other LoRA halves: replicated
)
VOCAB_LEAVES = ("embed", "lm_head")  # replicated when N does not divide the vocabulary
KV_SPEC = P(None, None, None, AXIS, None)  # [L, P, page_size, Hkv, D]: by KV head
KV_LEAVES = ("wk", "wv", "bk", "bv", "lora_b_wk", "lora_b_wv")  # [..., Hkv * D]


def check_tensor_parallel(cfg: ModelConfig, n: int, num_devices: int) -> None:
    """ValueError naming the value when `n` cannot split this model over these devices (the
    model first: a degree no device count could serve is named as such)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel={n!r} must be an integer >= 1")
    if cfg.num_heads % n:
        raise ValueError(f"tensor_parallel={n} does not divide num_heads={cfg.num_heads}")
    kv = cfg.num_kv_heads
    if kv % n and n % kv:
        raise ValueError(f"tensor_parallel={n} neither divides num_kv_heads={kv} nor is a "
                         "multiple of it (to replicate the KV heads)")
    if cfg.intermediate_size % n:
        raise ValueError(f"tensor_parallel={n} does not divide intermediate_size="
                         f"{cfg.intermediate_size}")
    if n > num_devices:
        raise ValueError(f"tensor_parallel={n} exceeds the {num_devices} "
                         f"{jax.default_backend()} device(s) jax sees")


def expand_kv_heads(cfg: ModelConfig, params, n: int) -> tuple:
    """(cfg, params) with each KV head repeated n / Hkv times when n > Hkv: the model
    computes the same, and every one of n shards holds whole KV heads."""
    if n <= cfg.num_kv_heads:
        return cfg, params
    reps, d = n // cfg.num_kv_heads, cfg.head_dim

    def repeat(path, x):
        name = _path(path).rsplit("/", 1)[-1]
        if name not in KV_LEAVES:
            return x
        heads = x.reshape(*x.shape[:-1], x.shape[-1] // d, d)  # [..., Hkv, D]
        xp = np if isinstance(x, np.ndarray) else jnp  # host weights stay on the host
        return xp.repeat(heads, reps, axis=-2).reshape(*x.shape[:-1], -1)

    params = dict(params, layers=jax.tree_util.tree_map_with_path(
        lambda p, x: repeat(p, x), params["layers"]))
    return dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * reps), params


def unexpand_kv_heads(cfg: ModelConfig, params) -> dict:
    """The inverse of `expand_kv_heads` for the model's own `cfg`: params whose K/V
    projections hold cfg.num_kv_heads heads again (params that do already are unchanged)."""
    kv, d = cfg.num_kv_heads, cfg.head_dim

    def first(path, x):
        heads = x.shape[-1] // d
        if _path(path).rsplit("/", 1)[-1] not in KV_LEAVES or heads == kv:
            return x
        runs = x.reshape(*x.shape[:-1], kv, heads // kv, d)  # [..., Hkv, repeats, D]
        return runs[..., 0, :].reshape(*x.shape[:-1], kv * d)

    return dict(params, layers=jax.tree_util.tree_map_with_path(first, params["layers"]))


def _path(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def leaf_spec(path: str, shape: tuple, n: int) -> P:
    """The `PartitionSpec` of one leaf: the first rule whose regex matches its path, with
    None prepended for a stacked leaf's layer axis."""
    spec = next(s for pattern, s in PARTITION_RULES if re.search(pattern, path))
    if path.startswith("layers/") and not path.split("/")[1].isdigit() and spec:
        spec = P(None, *spec)  # stacked: [L, ...]
    for dim, axis in zip(shape, spec):
        if axis is not None and dim % n:
            if path in VOCAB_LEAVES:
                return P()
            raise ValueError(f"tensor_parallel={n} does not divide {path} {shape}")
    return spec


def param_shardings(mesh: Mesh, params):
    """A `NamedSharding` per leaf of the params pytree, by `PARTITION_RULES`."""
    n = mesh.shape[AXIS]
    return jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, leaf_spec(_path(p), x.shape, n)), params)


def state_shardings(mesh: Mesh, state: DeviceState) -> DeviceState:
    """KV pages by KV head; the pooler's state, page sidecars and token buffers replicated."""
    replicated = NamedSharding(mesh, P())
    kv = NamedSharding(mesh, KV_SPEC)
    return DeviceState(llama.KVCache(kv, kv), jax.tree.map(lambda _: replicated, state.pool),
                       None if state.sidecar is None else
                       jax.tree.map(lambda _: replicated, state.sidecar), replicated,
                       replicated)


def shard_attention(attn_fn, mesh: Mesh):
    """`attn_fn` (a ragged paged attention with its static hints bound, as `step` makes it)
    run once per shard of `mesh`: q [T, Hq, D] split by query heads, the stacked k/v cache
    [L, P, page_size, Hkv, D] (or one layer's pages without `layer`) by KV head, kv_lens [S],
    page_indices [S, pps], cu_q_lens [S+1], num_seqs [], the layer index, the cascade plan and
    the kernel's work lists replicated -> [T, Hq, D] split by query heads."""
    heads = P(None, AXIS, None)

    def sharded(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, layer=None,
                cascade=None, plan=None):
        cache = P(*([None] * (k_cache.ndim - 2)), AXIS, None)
        layer = None if layer is None else jnp.asarray(layer, jnp.int32)

        def per_shard(q, k, v, meta, layer, cascade, plan):  # k/v [..., Hkv/N, D]
            return attn_fn(q, k, v, *meta, layer=layer, cascade=cascade, plan=plan)

        per_device = _shard_map(per_shard, mesh=mesh,
                                in_specs=(heads, cache, cache, P(), P(), P(), P()),
                                out_specs=heads, **_UNCHECKED)
        return per_device(q, k_cache, v_cache, (kv_lens, page_indices, cu_q_lens, num_seqs),
                          layer, cascade, plan)

    return sharded


def tp_mesh(n: int, devices: list | None = None) -> Mesh:
    """The `("tp",)` mesh of the first n devices (of `jax.devices()` unless given)."""
    return Mesh(np.array((jax.devices() if devices is None else devices)[:n]), (AXIS,))


def restore_targets(cfg: ModelConfig, n: int, dtype, devices: list | None = None) -> dict:
    """orbax restore targets for an engine checkpoint of `cfg` (stacked, as `Engine.save`
    writes it) at degree n: each leaf a `jax.ShapeDtypeStruct` in `dtype` under its table
    sharding on the runner's mesh, so orbax reads each device's shard straight onto it; the
    K/V leaves whose heads are repeated (n > Hkv) a host array instead, which the runner
    repeats and places like a Hugging Face checkpoint's. Checks n first (nothing is read)."""
    devices = jax.devices() if devices is None else devices
    check_tensor_parallel(cfg, n, len(devices))
    mesh, expand = tp_mesh(n, devices), n > cfg.num_kv_heads

    def target(path, shape):
        name = _path(path)
        if expand and name.rsplit("/", 1)[-1] in KV_LEAVES:
            return np.zeros(shape, dtype)  # a numpy target: orbax restores it to the host
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(
            mesh, leaf_spec(name, shape, n)))

    return jax.tree_util.tree_map_with_path(target, llama.param_shapes(cfg),
                                            is_leaf=lambda x: isinstance(x, tuple))


def place(x, sharding: NamedSharding) -> jax.Array:
    """One leaf on its devices. A host (numpy) array is cut on the host and each device gets
    only its own shard, so a checkpoint never sits whole on one device; a device array is
    moved to the sharding."""
    if isinstance(x, np.ndarray):
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    return jax.device_put(x, sharding)


class ShardedDecoderRunner(DecoderRunner):
    """`DecoderRunner` on a `("tp",)` mesh of the first `tensor_parallel` devices."""

    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, params, tensor_parallel: int,
                 devices: list | None = None):
        devices = jax.devices() if devices is None else devices
        check_tensor_parallel(model_cfg, tensor_parallel, len(devices))
        model_cfg, params = expand_kv_heads(model_cfg, params, tensor_parallel)
        self.mesh = tp_mesh(tensor_parallel, devices)  # zero_state needs it
        super().__init__(model_cfg, cfg, params)
        self.param_sharding = param_shardings(self.mesh, self.params)
        self.state_sharding = state_shardings(self.mesh, self.state)
        self.params = jax.tree.map(place, self.params, self.param_sharding)

    def layout_params(self, params, backend: str) -> dict:
        """For `cfg.layer_loop` only: the shardings name the MLP's row-major weights."""
        return for_layer_loop(params, self.cfg.layer_loop)

    def zero_state(self) -> DeviceState:
        """The fresh state made on the mesh: each device zeroes its own KV shard."""
        build = super().zero_state
        return jax.jit(build, out_shardings=state_shardings(self.mesh, jax.eval_shape(build)))()

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def _compile(self, key: tuple):
        replicated = self.replicated()
        fn = jax.jit(self.step_fn(
            key, wrap_attention=functools.partial(shard_attention, mesh=self.mesh)
            if self.impl == "pallas" else None),
            in_shardings=(self.param_sharding, self.state_sharding, replicated, replicated),
            out_shardings=(self.state_sharding, replicated, replicated), donate_argnums=(1,))
        return fn.lower(self.params, self.state, *wire_spec(self.spec(key))).compile(
            compiler_options=compile_options(jax.default_backend()) or None)
