"""LoRA adapters on the shared Llama backbone: stack them, apply them per token.

In: `LoraAdapter`s (read from PEFT directories by `formats.peft.load_adapter`, weights in the
`[in, out]` layout of the params pytree). `stack_adapters` turns several into one pytree of
`lora_a_<w> [L, A, in, r_max]` and `lora_b_<w> [L, A, r_max, out]` per targeted projection
`<w>` (`wq`, `wk`, `wv`, `wo`, `w_gate`, `w_up`, `w_down`), scale folded into B, smaller ranks
and untargeted modules zero-padded; `merge_lora_layers` puts it into `params["layers"]`.
Out: `llama.LlamaModel` with `adapter_ids [T]` adds `lora_delta` to every projection whose
`lora_a_<w>` is in the layer params. Adapter id 0 is the base model; id k > 0 is stacked index
k - 1, so the ids are per-token data and a new adapter mix never recompiles.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.models.config import ModelConfig


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


def stack_adapters(adapters: list, cfg: ModelConfig, dtype, on_host: bool = False) -> dict:
    """Adapters -> {lora_a_<w>: [L, A, in, r_max], lora_b_<w>: [L, A, r_max, out]} in `dtype`,
    on the default device or `on_host` as numpy arrays (for the tensor-parallel runner).

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
        to_array = np.asarray if on_host else jnp.asarray
        stacked[f"lora_a_{key}"], stacked[f"lora_b_{key}"] = to_array(a, dtype), to_array(b, dtype)
    return stacked


def merge_lora_layers(layers_params: dict, stacked: dict) -> dict:
    """Stacked layer params `[L, ...]` with the adapters' `[L, A, ...]` leaves added alongside."""
    assert "0" not in layers_params, "merge into stacked layers, before split_layers"
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
