"""Layer-layout helpers shared by the decoder and the encoder.

Loaders and checkpoints hold layer weights stacked on a leading axis (`layers: {name: [L, ...]}`),
which the models run with `nn.scan` over one block. On a CPU, `lax.scan` copies each layer's
weight slice every step, so there the runners use the per-layer layout from `split_layers`
(`layers: {"0": {name: [...]}, "1": ...}`, made once, outside jit) and the models unroll the
layer loop; `stack_layers` inverts it for saving; `is_unrolled` tells the two apart.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def is_unrolled(params) -> bool:
    """Whether `params["layers"]` has the per-layer layout of `split_layers`."""
    return "0" in params["layers"]


def split_layers(params) -> dict:
    """The same params with `layers` as {"0": {...}, "1": {...}} per layer (once, outside jit).

    The model then runs the layers as an unrolled Python loop. On a CPU this avoids the copy
    of each layer's weights that `lax.scan` makes when it slices the stacked arrays (measured
    about 4x faster decode on the `small` preset); compile time grows with depth instead.
    """
    stacked = params["layers"]
    num_layers = next(iter(stacked.values())).shape[0]
    layers = {str(i): {k: v[i] for k, v in stacked.items()} for i in range(num_layers)}
    return dict(params, layers=layers)


def for_layer_loop(params, layer_loop: str) -> dict:
    """Params laid out for `layer_loop`: "scan", "unrolled", or "auto" (unrolled).

    "auto" unrolls on every backend: `lax.scan` slices each layer's weights out of the stacked
    arrays and copies them before their matmuls, on a CPU (about 4x slower decode on the
    `small` preset) and, in the deviceless H200 compile, on a GPU too (an 8B-shaped bf16
    decode step at 64 x 2,048 moves 1.98x its floor scanned, 1.12x unrolled; docs/results.md).
    "scan" keeps compile time flat in depth (17-19 s vs 25-34 s for that step's 32 layers)."""
    if layer_loop not in ("auto", "scan", "unrolled"):
        raise ValueError(f"layer_loop={layer_loop!r}: expected auto, scan or unrolled")
    return params if layer_loop == "scan" else split_layers(params)


def stack_layers(params) -> dict:
    """Inverse of `split_layers` (a no-op on stacked params)."""
    if not is_unrolled(params):
        return params
    per_layer = [params["layers"][str(i)] for i in range(len(params["layers"]))]
    return dict(params, layers=jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer))
