"""LoRA adapters on the shared Llama backbone: load PEFT directories, stack them, apply per token.

In: PEFT LoRA directories (`adapter_config.json` + `adapter_model.safetensors`). `load_adapter`
checks one against the base `ModelConfig` and returns a `LoraAdapter` (weights in the `[in, out]`
layout of the params pytree). `stack_adapters` turns several into one pytree of
`lora_a_<w> [L, A, in, r_max]` and `lora_b_<w> [L, A, r_max, out]` per targeted projection `<w>`
(`wq`, `wk`, `wv`, `wo`, `w_gate`, `w_up`, `w_down`), scale folded into B, smaller ranks and
untargeted modules zero-padded; `merge_lora_layers` puts it into `params["layers"]`.
Out: `llama.forward(..., adapter_ids [T])` adds `lora_delta` to every projection whose
`lora_a_<w>` is in the layer params. Adapter id 0 is the base model; id k > 0 is stacked index
k - 1, so the ids are per-token data and a new adapter mix never recompiles.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.models.config import ModelConfig

# PEFT module name -> params key of its weight.
MODULES = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
           "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
# base_model.model[.model].layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}[.{adapter name}].weight
_KEY = re.compile(r"base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight")
# adapter_config.json options whose non-default values change the maths; we refuse them.
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "rank_pattern": {},
                "alpha_pattern": {}, "modules_to_save": None}


@dataclasses.dataclass(frozen=True, eq=False)
class LoraAdapter:
    path: str
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    # params key (e.g. "wq") -> (a [L, in, r], b [L, r, out]); layers it does not touch are zero
    weights: dict


def projection_dims(cfg: ModelConfig) -> dict:
    """params key -> (in, out) of each of the seven projections."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return dict(wq=(d, q), wk=(d, kv), wv=(d, kv), wo=(q, d), w_gate=(d, f), w_up=(d, f),
                w_down=(f, d))


def _read_config(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: a PEFT LoRA adapter needs adapter_config.json")
    with open(path) as f:
        raw = json.load(f)
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {raw['peft_type']!r} is not supported; only 'LORA'")
    for key, default in _UNSUPPORTED.items():
        if raw.get(key, default) not in (default, None, {}, []):
            raise ValueError(f"{path}: {key}={raw[key]!r} is not supported (only {default!r})")
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{path}: r={rank!r} must be a positive integer")
    return raw


def _targets(raw: dict, path: str) -> tuple:
    """The PEFT module names the adapter targets, checked against the supported seven."""
    targets = raw.get("target_modules")
    if targets == "all-linear":
        return tuple(MODULES)
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    unknown = [t for t in targets if t not in MODULES]
    if unknown or not targets:
        raise ValueError(f"{path}: target_modules {unknown or targets} not supported; "
                         f"supported: {', '.join(MODULES)} or 'all-linear'")
    return tuple(targets)


def _layers(raw: dict, path: str, num_layers: int) -> tuple:
    layers = raw.get("layers_to_transform")
    if layers is None:
        return tuple(range(num_layers))
    layers = [layers] if isinstance(layers, int) else layers
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"{path}: layers_to_transform {bad} outside the base model's "
                         f"{num_layers} layers")
    return tuple(layers)


def _index_tensors(st, num_layers: int, layers: tuple, targets: tuple) -> dict:
    """(layer, module, "A"|"B") -> tensor name; anything we would silently ignore is an error."""
    found = {}
    for name in st.names:
        m = _KEY.fullmatch(name)
        if m is None or m.group(2) not in MODULES:
            raise ValueError(f"{st.path}: tensor {name} is not a LoRA weight of "
                             f"{', '.join(MODULES)}")
        layer, module = int(m.group(1)), m.group(2)
        if layer >= num_layers:
            raise ValueError(f"{st.path}: tensor {name} is for layer {layer}, the base model "
                             f"has {num_layers} layers")
        if layer not in layers or module not in targets:
            raise ValueError(f"{st.path}: tensor {name} is outside target_modules "
                             f"{list(targets)} or layers_to_transform")
        found[layer, module, m.group(3)] = name
    return found


def _check(st, name: str, shape: tuple) -> np.ndarray:
    arr = st.get(name)
    if arr.shape != shape:
        raise ValueError(f"{st.path}: tensor {name} has shape {arr.shape}, the base model and "
                         f"adapter rank expect {shape}")
    return arr.astype(np.float32)


def load_adapter(adapter_dir: str, cfg: ModelConfig, dtype) -> LoraAdapter:
    """Read and check a PEFT LoRA directory against the base model `cfg`; weights in `dtype`."""
    # Imported here: loading imports llama, which imports this module for lora_delta.
    from hetero_jax.models.loading import SafetensorsFile

    if not os.path.isdir(adapter_dir):
        raise FileNotFoundError(f"adapter directory {adapter_dir} not found")
    config_path = os.path.join(adapter_dir, "adapter_config.json")
    raw = _read_config(config_path)
    rank, targets = raw["r"], _targets(raw, config_path)
    layers = _layers(raw, config_path, cfg.num_layers)
    alpha = raw.get("lora_alpha", rank)
    scale = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    dims = projection_dims(cfg)
    for module in targets:
        if rank > min(dims[MODULES[module]]):
            raise ValueError(f"{config_path}: r={rank} exceeds the (in, out) dimensions "
                             f"{dims[MODULES[module]]} of {module} in the base model")
    st = SafetensorsFile(os.path.join(adapter_dir, "adapter_model.safetensors"))
    found = _index_tensors(st, cfg.num_layers, layers, targets)
    weights = {}
    for module in targets:
        (din, dout), key = dims[MODULES[module]], MODULES[module]
        a = np.zeros((cfg.num_layers, din, rank), np.float32)
        b = np.zeros((cfg.num_layers, rank, dout), np.float32)
        for i in layers:
            for half, shape in (("A", (rank, din)), ("B", (dout, rank))):
                if (i, module, half) not in found:
                    part = "mlp" if key.startswith("w_") else "self_attn"
                    raise ValueError(f"{st.path}: tensor base_model.model.model.layers.{i}.{part}."
                                     f"{module}.lora_{half}.weight missing (layer {i} of "
                                     f"{cfg.num_layers}, target {module})")
                (a if half == "A" else b)[i] = _check(st, found[i, module, half], shape).T
        weights[key] = (a.astype(dtype), b.astype(dtype))
    return LoraAdapter(path=adapter_dir, rank=rank, scale=scale, weights=weights)


def stack_adapters(adapters: list, cfg: ModelConfig, dtype) -> dict:
    """Adapters -> {lora_a_<w>: [L, A, in, r_max], lora_b_<w>: [L, A, r_max, out]} in `dtype`.

    B carries the adapter's scale; ranks below r_max and untargeted projections are zeros, so
    every adapter contributes exactly `scale * x @ A @ B` where it is selected and 0 elsewhere.
    """
    if not adapters:
        return {}
    r_max, n = max(ad.rank for ad in adapters), len(adapters)
    dims = projection_dims(cfg)
    stacked = {}
    for key in (k for k in dims if any(k in ad.weights for ad in adapters)):
        din, dout = dims[key]
        a = np.zeros((cfg.num_layers, n, din, r_max), np.float32)
        b = np.zeros((cfg.num_layers, n, r_max, dout), np.float32)
        for j, ad in enumerate(adapters):
            if key in ad.weights:
                a[:, j, :, :ad.rank] = ad.weights[key][0]
                b[:, j, :ad.rank, :] = ad.weights[key][1].astype(np.float32) * ad.scale
        stacked[f"lora_a_{key}"] = jnp.asarray(a, dtype)
        stacked[f"lora_b_{key}"] = jnp.asarray(b, dtype)
    return stacked


def merge_lora_layers(layers_params: dict, stacked: dict) -> dict:
    """Stacked layer params `[L, ...]` with the adapters' `[L, A, ...]` leaves added alongside."""
    assert isinstance(layers_params, dict), "merge into stacked layers, before split_layers"
    clash = sorted(set(layers_params) & set(stacked))
    assert not clash, f"{clash=}: the layers already carry adapters"
    return {**layers_params, **stacked}


def lora_delta(x, a, b, adapter_ids):
    """x [T, in], a [A, in, r], b [A, r, out], adapter_ids [T] int32 -> delta [T, out].

    Every token goes through all A adapters' down-projections (T x in x A*r flops), the rows of
    the ones it did not select are zeroed, and one matmul over A*r applies the up-projections: no
    per-token gather of matrices. Id 0 (base) selects nothing, so its delta is exactly zero.
    """
    n, rank = a.shape[0], a.shape[2]
    xa = jnp.einsum("ti,air->tar", x, a)  # [T, A, r]
    select = jax.nn.one_hot(adapter_ids - 1, n, dtype=xa.dtype)  # [T, A]; id 0 -> all zeros
    return (xa * select[:, :, None]).reshape(-1, n * rank) @ b.reshape(n * rank, -1)
