"""Incremental poolers: embedding chunks over several steps become one vector, on the device.

State (`PoolerState`, donated to the step) holds running sums per embedding slot: `sum_h`,
`sum_jh` (position-weighted, j 1-based, as in SGPT), `count`, `sum_j`, the first hidden state
(CLS) and the latest one (last token); with a buffered head configured, also every hidden
state of the request (O(n d) memory), for heads that do not stream. Each step adds the
embedding slice's final hidden states with segment sums over their slots. The step's packed
device->host array carries one vector per embedding item of the step (`[Se, d]`, a few KB:
its shape is static, so unfinished items ride along), and the host keeps only those whose
last chunk ran. Slots are allocated by the scheduler; slot `E` (the last row) is the dummy
target of every non-embedding row, so padding never touches a real slot.

`select_and_normalize` is the one place that turns pooled candidates into the requested kind,
optionally L2-normalised; the separate encoder and the vector index use it too.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class PoolerState:
    sum_h: jax.Array  # [E+1, d] f32
    sum_jh: jax.Array  # [E+1, d] f32
    count: jax.Array  # [E+1] f32
    sum_j: jax.Array  # [E+1] f32
    first: jax.Array  # [E+1, d] f32
    last: jax.Array  # [E+1, d] f32
    buffer: jax.Array  # [E+1, Lb, d] f32: every hidden state, for a buffered head (Lb = 1: off)

    @classmethod
    def zeros(cls, num_slots: int, dim: int, buffer_len: int = 1) -> "PoolerState":
        vec = lambda: jnp.zeros((num_slots + 1, dim), jnp.float32)  # noqa: E731
        scalar = lambda: jnp.zeros((num_slots + 1,), jnp.float32)  # noqa: E731
        buffer = jnp.zeros((num_slots + 1, buffer_len, dim), jnp.float32)
        return cls(vec(), vec(), scalar(), scalar(), vec(), vec(), buffer)  # distinct: donated

    @property
    def dummy_slot(self) -> int:
        return self.count.shape[0] - 1


@flax.struct.dataclass
class PoolBatch:
    token_slot: jax.Array  # [T] int32: the slot of each embedding row, dummy elsewhere
    item_slot: jax.Array  # [Se] int32: the slot of each embedding item, dummy for padding
    item_last_row: jax.Array  # [Se] int32: the item's last row on the token axis
    item_first_chunk: jax.Array  # [Se] bool: the item starts its request (reset the slot)
    kind: jax.Array  # [Se] int32: index into requests.POOLING_KINDS
    normalize: jax.Array  # [Se] bool
    item_length: jax.Array  # [Se] int32: tokens of the request seen so far (for the head)


def _reset(state: PoolerState, slots) -> PoolerState:
    """Zero the running sums of `slots` (the buffer needs none: heads read `length` rows)."""
    zero = lambda x: x.at[slots].set(0.0)  # noqa: E731
    return state.replace(sum_h=zero(state.sum_h), sum_jh=zero(state.sum_jh),
                         count=zero(state.count), sum_j=zero(state.sum_j))


def update(state: PoolerState, hidden, positions, pb: PoolBatch, head=None):
    """hidden [T, d] (after the final norm), positions [T] -> (state, vectors [Se, d] f32).

    `head(hidden [Lb, d], length) -> [d]` is the buffered head (static; None: none). It sees
    every hidden state of the request, rows past `length` being stale, so it must mask them.
    """
    dummy = state.dummy_slot
    state = _reset(state, jnp.where(pb.item_first_chunk, pb.item_slot, dummy))
    h = hidden.astype(jnp.float32)
    w = (positions + 1).astype(jnp.float32)
    seg = lambda x: jax.ops.segment_sum(x, pb.token_slot, num_segments=dummy + 1)  # noqa: E731
    state = state.replace(
        sum_h=state.sum_h + seg(h), sum_jh=state.sum_jh + seg(h * w[:, None]),
        count=state.count + seg(jnp.ones_like(w)), sum_j=state.sum_j + seg(w),
        first=state.first.at[jnp.where(positions == 0, pb.token_slot, dummy)].set(h),
        last=state.last.at[pb.item_slot].set(h[pb.item_last_row]))
    s = pb.item_slot
    candidates = [state.sum_h[s] / jnp.maximum(state.count[s], 1.0)[:, None],
                  state.sum_jh[s] / jnp.maximum(state.sum_j[s], 1.0)[:, None],
                  state.first[s], state.last[s]]
    if head is not None:
        state = state.replace(buffer=state.buffer.at[pb.token_slot, positions].set(h))
        candidates.append(jax.vmap(head)(state.buffer[s], pb.item_length).astype(jnp.float32))
    return state, select_and_normalize(jnp.stack(candidates), pb.kind, pb.normalize)


def l2_normalize(x):
    """x [..., d] -> rows scaled to unit L2 norm (zero rows stay zero)."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def select_and_normalize(candidates, kind, normalize):
    """candidates [kinds, B, d] (in `requests.POOLING_KINDS` order), kind [B] int32,
    normalize [B] bool -> [B, d]: each row's pooling kind, L2-normalised where asked."""
    vec = jnp.take_along_axis(candidates, kind[None, :, None], axis=0)[0]
    return jnp.where(normalize[:, None], l2_normalize(vec), vec)
