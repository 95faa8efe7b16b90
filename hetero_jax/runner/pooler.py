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

With prefix caching, `PageSidecar` keeps beside every KV page the pooler's partial sums of
that page's tokens (`sum_h`, position-weighted `sum_jh`, and the state of its first token,
the CLS state of a request's first page), written by every decoder step for every row
(`write_sidecar`; generation prefill and decode too), so that an embedding request whose
prefix hit the cache starts its running sums from its hit pages' sidecars and runs only its
tail. A page is registered in the cache only after a step wrote it, so its sidecar is
complete; it is overwritten when the page is reused (a row at offset 0 resets it).

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
class PageSidecar:
    sum_h: jax.Array  # [P, d] f32: the sum of the page's tokens' final hidden states
    sum_jh: jax.Array  # [P, d] f32: the same weighted by position + 1
    first: jax.Array  # [P, d] f32: the state of the page's first token

    @classmethod
    def zeros(cls, num_pages: int, dim: int) -> "PageSidecar":
        return cls(*(jnp.zeros((num_pages, dim), jnp.float32) for _ in range(3)))


def write_sidecar(side: PageSidecar, hidden, positions, slots, page_size: int) -> PageSidecar:
    """Add the step's rows to their pages' sums: hidden [T, d], positions [T], slots [T]
    (page * page_size + offset; padding rows write the scratch page 0)."""
    page, first = slots // page_size, slots % page_size == 0
    start = jnp.where(first, page, 0)  # a page's first token resets its sums
    h = hidden.astype(jnp.float32)
    hw = h * (positions + 1).astype(jnp.float32)[:, None]
    return PageSidecar(sum_h=side.sum_h.at[start].set(0.0).at[page].add(h),
                       sum_jh=side.sum_jh.at[start].set(0.0).at[page].add(hw),
                       first=side.first.at[start].set(h))


def _from_sidecar(side: PageSidecar, pages, num_hit, page_size: int):
    """The running sums of the cached prefix of each item: pages [Se, P] (the request's page
    table), num_hit [Se] -> sum_h, sum_jh [Se, d], count, sum_j [Se], first [Se, d]."""
    hit = (jnp.arange(pages.shape[1])[None, :] < num_hit[:, None])[:, :, None]  # [Se, P, 1]
    total = lambda x: jnp.sum(jnp.where(hit, x[pages], 0.0), axis=1)  # noqa: E731
    n = (num_hit * page_size).astype(jnp.float32)
    return total(side.sum_h), total(side.sum_jh), n, n * (n + 1) / 2, side.first[pages[:, 0]]


@flax.struct.dataclass
class PoolBatch:
    token_slot: jax.Array  # [T] int32: the slot of each embedding row, dummy elsewhere
    item_slot: jax.Array  # [Se] int32: the slot of each embedding item, dummy for padding
    item_last_row: jax.Array  # [Se] int32: the item's last row on the token axis
    item_first_chunk: jax.Array  # [Se] bool: the item starts its request (reset the slot)
    kind: jax.Array  # [Se] int32: index into requests.POOLING_KINDS
    normalize: jax.Array  # [Se] bool
    item_length: jax.Array  # [Se] int32: tokens of the request seen so far (for the head)
    item_hit_pages: jax.Array  # [Se] int32: the request's pages found in the prefix cache


def _start(state: PoolerState, pb: PoolBatch, side, pages, page_size: int) -> PoolerState:
    """Set the running sums of the items that start their request: zero, or with a cache hit
    the hit pages' sidecar sums (the buffer needs none: heads read `length` rows)."""
    slots = jnp.where(pb.item_first_chunk, pb.item_slot, state.dummy_slot)
    if side is None:
        zero = lambda x: x.at[slots].set(0.0)  # noqa: E731
        return state.replace(sum_h=zero(state.sum_h), sum_jh=zero(state.sum_jh),
                             count=zero(state.count), sum_j=zero(state.sum_j))
    sum_h, sum_jh, count, sum_j, first = _from_sidecar(side, pages, pb.item_hit_pages,
                                                       page_size)
    hit_slots = jnp.where(pb.item_hit_pages > 0, slots, state.dummy_slot)
    return state.replace(sum_h=state.sum_h.at[slots].set(sum_h),
                         sum_jh=state.sum_jh.at[slots].set(sum_jh),
                         count=state.count.at[slots].set(count),
                         sum_j=state.sum_j.at[slots].set(sum_j),
                         first=state.first.at[hit_slots].set(first))


def update(state: PoolerState, hidden, positions, pb: PoolBatch, head=None, side=None,
           pages=None, page_size: int = 0):
    """hidden [T, d] (after the final norm), positions [T] -> (state, vectors [Se, d] f32).

    `head(hidden [Lb, d], length) -> [d]` is the buffered head (static; None: none). It sees
    every hidden state of the request, rows past `length` being stale, so it must mask them.
    With prefix caching, `side` is the page sidecar and `pages [Se, P]` the items' page tables.
    """
    dummy = state.dummy_slot
    state = _start(state, pb, side, pages, page_size)
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
