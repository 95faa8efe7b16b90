"""Layer-layout helpers shared by the decoder and the encoder.

Loaders and checkpoints hold layer weights stacked on a leading axis (`layers: {name: [L, ...]}`),
which the models run with `nn.scan` over one block. On a CPU, `lax.scan` copies each layer's
weight slice every step, so there the runners use the per-layer layout from `split_layers`
(`layers: {"0": {name: [...]}, "1": ...}`, made once, outside jit) and the models unroll the
layer loop; `stack_layers` inverts it for saving; `is_unrolled` tells the two apart.

On a CPU the decoder's runner also stores the MLP's weights transposed (`feature_major_mlp`:
`w_gate_t`, `w_up_t` [F, d], `w_down_t` [d, F]), and the model runs the MLP on [d, T]
activations: XLA:CPU's matmuls with few rows (decode steps, short chunks) run 1.2-1.4x faster
with the weights' output dimension leading (docs/results.md). `row_major_mlp` inverts it.
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


MLP_WEIGHTS = ("w_gate", "w_up", "w_down")


def _each_layer(params, fn) -> dict:
    """`params` with `fn(layer dict) -> layer dict` applied to every layer (the stacked dict
    counts as one: its arrays' leading axis is the layer)."""
    layers = params["layers"]
    if is_unrolled(params):
        return dict(params, layers={i: fn(lp) for i, lp in layers.items()})
    return dict(params, layers=fn(layers))


def is_feature_major(params) -> bool:
    """Whether the MLP's weights are stored transposed (`feature_major_mlp`)."""
    layers = params["layers"]
    return "w_up_t" in (layers["0"] if is_unrolled(params) else layers)


def _transposed(params, rename: dict) -> dict:
    """`params` with each layer weight named in `rename` transposed (last two axes) and
    renamed to its value there."""
    return _each_layer(params, lambda lp: {
        rename.get(k, k): (jnp.swapaxes(v, -1, -2) if k in rename else v) for k, v in lp.items()})


def feature_major_mlp(params) -> dict:
    """The same params with each MLP weight `w` [..., in, out] stored as `w_t` [..., out, in]
    (once, outside jit); a no-op when they already are."""
    if is_feature_major(params):
        return params
    return _transposed(params, {k: f"{k}_t" for k in MLP_WEIGHTS})


def row_major_mlp(params) -> dict:
    """Inverse of `feature_major_mlp` (a no-op on row-major params)."""
    if not is_feature_major(params):
        return params
    return _transposed(params, {f"{k}_t": k for k in MLP_WEIGHTS})
