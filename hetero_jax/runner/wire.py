"""Host -> device in two copies: a step's batch flattened into one int32 and one float32 array.

A `StepBatch` has about 25 small arrays, and a jitted call copies each host array on its own:
on an H200 each copy cost 20-50 us of host time before the step could start (the first GPU
profile, docs/results.md). `to_wire` lays the leaves end to end instead, float32 leaves in one
array and the rest (int32; uint32 by bit pattern; bool as 0/1) in the other, and
`from_wire`, inside the jitted step, cuts them back out by the variant's `batch_spec`: slices
and reshapes that XLA fuses into their readers. `wire_spec` gives the two arrays' shape structs
for ahead-of-time lowering.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _is_float(dtype) -> bool:
    return np.dtype(dtype) == np.float32


def wire_sizes(spec) -> tuple[int, int]:
    """(int32 length, float32 length) of the wire of a batch with shape structs `spec`."""
    sizes = [0, 0]
    for leaf in jax.tree.leaves(spec):
        sizes[_is_float(leaf.dtype)] += int(np.prod(leaf.shape, dtype=np.int64))
    return sizes[0], sizes[1]


def wire_spec(spec) -> tuple:
    """Shape structs of the (int32, float32) wire of a batch with shape structs `spec`."""
    ints, floats = wire_sizes(spec)
    return (jax.ShapeDtypeStruct((ints,), jnp.int32), jax.ShapeDtypeStruct((floats,), jnp.float32))


def to_wire(batch, spec) -> tuple[np.ndarray, np.ndarray]:
    """Host arrays `batch` -> (int32 [n], float32 [m]) numpy; each leaf must have its shape
    struct's shape and dtype in `spec` (a mismatch is a packing bug, named here)."""
    leaves, treedef = jax.tree.flatten(batch)
    specs = treedef.flatten_up_to(spec)
    parts: tuple[list, list] = ([], [])
    for i, (leaf, want) in enumerate(zip(leaves, specs)):
        leaf = np.asarray(leaf)
        if leaf.shape != want.shape or leaf.dtype != want.dtype:
            raise ValueError(f"batch leaf {i} of {treedef}: {leaf.dtype}{list(leaf.shape)}, "
                             f"the variant expects {want.dtype}{list(want.shape)}")
        flat = leaf.reshape(-1)
        if _is_float(leaf.dtype):
            parts[1].append(flat)
        else:
            parts[0].append(flat.view(np.int32) if leaf.dtype == np.uint32
                            else flat.astype(np.int32, copy=False))
    ints = np.concatenate(parts[0]) if parts[0] else np.zeros(0, np.int32)
    floats = np.concatenate(parts[1]) if parts[1] else np.zeros(0, np.float32)
    return ints, floats


def from_wire(spec, ints: jax.Array, floats: jax.Array):
    """Inside a jitted function: the batch of shape structs `spec` cut out of its wire."""
    offsets = [0, 0]
    leaves = []
    for want in jax.tree.leaves(spec):
        size, is_float = int(np.prod(want.shape, dtype=np.int64)), _is_float(want.dtype)
        lo = offsets[is_float]
        offsets[is_float] += size
        flat = (floats if is_float else ints)[lo:lo + size]
        if want.dtype == np.uint32:
            flat = jax.lax.bitcast_convert_type(flat, jnp.uint32)
        elif want.dtype == np.bool_:
            flat = flat != 0
        leaves.append(flat.reshape(want.shape))
    return jax.tree.unflatten(jax.tree.structure(spec), leaves)
