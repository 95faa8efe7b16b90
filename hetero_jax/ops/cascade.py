"""Shared-prefix (cascade) attention for decode tokens: the shared K/V read once per tile.

When decode sequences share leading KV pages (prefix-cache hits hand them the same physical
pages), reading those pages once per sequence is most of a decode step's memory traffic. Here
the decode sequences are cut into tiles of up to M sequences with a common page prefix; each
tile's M queries attend to its shared pages in one matrix product per KV head (M x G query
rows against the shared keys, read once for the tile), every sequence attends to its own
remaining pages separately, and the two softmax parts are merged by their log-sum-exp. The
result equals plain attention over the whole page table up to float reduction order.

Host side: `sched.tiles.plan_tiles(page_tables, kv_lens, page_size, ...)` (plain Python, no
jax, shared with the simulator) picks the tiles from the page tables, or returns None when too
little would be saved; `cascade_arrays` lays a plan out as numpy arrays. Device side:
`CascadeMeta` (the plan as arrays of static shapes) and `attend_decode_cascade`, the XLA
version used by `attention.ragged_paged_attention(..., cascade=meta)`.

Shapes: G tiles of M rows; Ps shared pages per tile; Sd decode sequences with Pr remaining
pages each. Empty tile rows hold -1; an unused tile has `tile_lens == 0`.

The Pallas kernel takes the same plan in another form, `TileList` (`tile_list_arrays`): tiles
of any size as one flat list of members with offsets, every index a sequence of the step, so
it is present in every step at shapes fixed by S (a step with nothing shared has no tiles) and
needs no variant of its own; each sequence's own part starts `skip_pages` into its page table.
"""
from __future__ import annotations

import itertools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

_MASKED = -1e30


@flax.struct.dataclass
class CascadeMeta:
    tile_seqs: jax.Array  # [G, M] int32: decode-group index of each tile row, -1 empty
    tile_pages: jax.Array  # [G, Ps] int32: each tile's shared pages
    tile_lens: jax.Array  # [G] int32: shared tokens (whole pages; 0 = unused tile)
    rest_pages: jax.Array  # [Sd, Pr] int32: each decode sequence's pages after its tile's
    rest_lens: jax.Array  # [Sd] int32: tokens on those pages (its kv_len minus the shared)


def cascade_spec(num_tiles: int, rows: int, shared_pages: int, num_seqs: int,
                 rest_pages: int) -> CascadeMeta:
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    return CascadeMeta(i32(num_tiles, rows), i32(num_tiles, shared_pages), i32(num_tiles),
                       i32(num_seqs, rest_pages), i32(num_seqs))


def cascade_arrays(page_tables: list, kv_lens: list, page_size: int, plan: tuple,
                   num_tiles: int, rows: int, shared_pages: int, rest_pages: int,
                   num_seqs: int) -> CascadeMeta:
    """The plan of `plan_tiles` as numpy arrays of the given static shapes (padding: decode
    sequences past len(page_tables) have no pages)."""
    held = np.fromiter(map(len, page_tables), np.int64, len(page_tables))
    flat = np.fromiter(itertools.chain.from_iterable(page_tables), np.int64, int(held.sum()))
    return cascade_arrays_flat(flat, np.cumsum(held) - held, np.asarray(kv_lens, np.int64),
                               page_size, plan, num_tiles, rows, shared_pages, rest_pages,
                               num_seqs)


def cascade_arrays_flat(flat: np.ndarray, first: np.ndarray, kv_lens: np.ndarray,
                        page_size: int, plan: tuple, num_tiles: int, rows: int,
                        shared_pages: int, rest_pages: int, num_seqs: int) -> CascadeMeta:
    """`cascade_arrays` of the page tables laid end to end in `flat`, table j from
    `first[j]` (as the runner packs them: every page below is one numpy gather)."""
    tiles, offsets = plan
    n, g = len(first), len(tiles)
    size = np.fromiter((len(members) for members, _ in tiles), np.int64, g)
    shared = np.fromiter((k for _, k in tiles), np.int64, g)
    lead = np.fromiter((members[0] for members, _ in tiles), np.int64, g)
    tile_seqs = np.full((num_tiles, rows), -1, np.int32)
    tile_seqs[:g][np.arange(rows) < size[:, None]] = np.fromiter(
        itertools.chain.from_iterable(members for members, _ in tiles), np.int64, int(size.sum()))
    col = np.arange(shared_pages)
    fill = col < shared[:, None]  # [g, shared_pages]: a tile's shared pages, its lead's first
    tile_pages = np.zeros((num_tiles, shared_pages), np.int32)
    tile_pages[:g][fill] = flat[(first[lead][:, None] + col)[fill]]
    tile_lens = np.zeros(num_tiles, np.int32)
    tile_lens[:g] = shared * page_size
    # each sequence's own pages: columns offsets[j]:ceil(kv_len / page_size) of its table
    off = np.asarray(offsets, np.int64)
    col = np.arange(rest_pages)
    fill = col < (-(-kv_lens // page_size) - off)[:, None]  # [n, rest_pages]
    rest = np.zeros((num_seqs, rest_pages), np.int32)
    rest[:n][fill] = flat[((first + off)[:, None] + col)[fill]]
    rest_lens = np.zeros(num_seqs, np.int32)
    rest_lens[:n] = kv_lens - off * page_size
    return CascadeMeta(tile_seqs, tile_pages, tile_lens, rest, rest_lens)


@flax.struct.dataclass
class TileList:
    """Cascade tiles as data (the Pallas kernel's form): G = S // 2 tiles at most, each of two
    or more of the step's S sequences."""

    tile_rows: jax.Array  # [S] int32: the tiles' members (sequence indices), by tile; -1 after
    tile_starts: jax.Array  # [G + 1] int32: tile g's members are tile_rows[starts[g]:starts[g+1]]
    tile_lead: jax.Array  # [G] int32: a member whose page table begins with the shared pages
    tile_lens: jax.Array  # [G] int32: shared tokens (whole pages; 0 = no tile)
    skip_pages: jax.Array  # [S] int32: pages before a sequence's own part (its tile's shared)


def tile_list_spec(num_seqs: int) -> TileList:
    """Shape structs of the `TileList` of a step with `num_seqs` (S) sequence slots."""
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    g = num_seqs // 2
    return TileList(i32(num_seqs), i32(g + 1), i32(g), i32(g), i32(num_seqs))


def tile_list_arrays(plan: tuple | None, num_seqs: int, page_size: int) -> TileList:
    """A plan of `plan_tiles` ([(members, shared pages)], pages to skip [n]; its indices the
    step's sequences) as a `TileList` for S = `num_seqs` slots; None: no tiles."""
    g = num_seqs // 2
    rows, skip = np.full(num_seqs, -1, np.int32), np.zeros(num_seqs, np.int32)
    starts, lead, lens = np.zeros(g + 1, np.int32), np.zeros(g, np.int32), np.zeros(g, np.int32)
    if plan is not None:
        tiles, offsets = plan
        n = len(tiles)
        assert n <= g, f"{n} tiles in a step of {num_seqs} sequence slots"
        members = list(itertools.chain.from_iterable(m for m, _ in tiles))
        rows[:len(members)] = members
        starts[1:n + 1] = np.cumsum([len(m) for m, _ in tiles])
        starts[n + 1:] = len(members)
        lead[:n] = [m[0] for m, _ in tiles]
        lens[:n] = [k * page_size for _, k in tiles]
        skip[:len(offsets)] = offsets
    return TileList(rows, starts, lead, lens, skip)


def _gather(pages, table):
    """[P, ps, Hkv, D], [N, n] -> [N, n * ps, Hkv, D]."""
    return pages[table].reshape(table.shape[0], -1, *pages.shape[2:])


def _softmax_parts(scores, visible, v, contract: str):
    """Masked softmax of `scores` over their key axis, applied to `v`: (out, lse), fp32."""
    s = jnp.where(visible, scores, _MASKED)
    m = s.max(axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    out = jnp.einsum(contract, (p / l).astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out, (m + jnp.log(l))[..., 0]


def _shared_part(q, k_pages, v_pages, meta: CascadeMeta, sm_scale):
    """Each tile's queries against its shared keys: q [Sd, Hq, D] -> ([Sd, Hq, D], lse [Sd, Hq]);
    sequences in no tile get lse = -1e30 (weight 0 in the merge)."""
    sd, hq, d = q.shape
    g_tiles, rows = meta.tile_seqs.shape
    hkv = k_pages.shape[2]
    grp = hq // hkv
    qt = q[jnp.clip(meta.tile_seqs, 0, sd - 1)]  # [G, M, Hq, D]
    qt = qt.reshape(g_tiles, rows, hkv, grp, d).transpose(0, 2, 1, 3, 4)
    qt = qt.reshape(g_tiles, hkv, rows * grp, d)  # row = (tile row, head in group)
    k = _gather(k_pages, meta.tile_pages).transpose(0, 2, 1, 3)  # [G, Hkv, Ls, D]
    v = _gather(v_pages, meta.tile_pages).transpose(0, 2, 1, 3)
    scores = jnp.einsum("ghmd,ghkd->ghmk", qt, k, preferred_element_type=jnp.float32)
    visible = (jnp.arange(k.shape[2]) < meta.tile_lens[:, None, None, None])
    v = jnp.where(visible.transpose(0, 1, 3, 2), v, 0)  # stale slots: 0 * NaN is NaN
    out, lse = _softmax_parts(scores * sm_scale, visible, v, "ghmk,ghkd->ghmd")
    out = out.reshape(g_tiles, hkv, rows, grp, d).transpose(0, 2, 1, 3, 4)
    lse = lse.reshape(g_tiles, hkv, rows, grp).transpose(0, 2, 1, 3)
    dest = jnp.where(meta.tile_seqs >= 0, meta.tile_seqs, sd).reshape(-1)  # sd: dropped
    out_s = jnp.zeros((sd, hq, d), jnp.float32).at[dest].set(
        out.reshape(g_tiles * rows, hq, d), mode="drop")
    lse_s = jnp.full((sd, hq), _MASKED, jnp.float32).at[dest].set(
        lse.reshape(g_tiles * rows, hq), mode="drop")
    return out_s, lse_s


def _rest_part(q, k_pages, v_pages, meta: CascadeMeta, sm_scale):
    """Each sequence's query against its own remaining keys -> ([Sd, Hq, D], lse [Sd, Hq])."""
    sd, hq, d = q.shape
    hkv = k_pages.shape[2]
    k, v = _gather(k_pages, meta.rest_pages), _gather(v_pages, meta.rest_pages)  # [Sd, L, Hkv, D]
    qg = q.reshape(sd, hkv, hq // hkv, d)
    scores = jnp.einsum("shgd,slhd->shgl", qg, k, preferred_element_type=jnp.float32)
    visible = (jnp.arange(k.shape[1]) < meta.rest_lens[:, None])[:, None, None, :]
    v = jnp.where(visible[:, 0, 0, :, None, None], v, 0)  # stale slots: 0 * NaN is NaN
    out, lse = _softmax_parts(scores * sm_scale, visible, v, "shgl,slhd->shgd")
    return out.reshape(sd, hq, d), lse.reshape(sd, hq)


def merge_parts(out_a, lse_a, out_b, lse_b):
    """Two softmax parts over disjoint keys -> the softmax over their union: [N, H, D]."""
    m = jnp.maximum(lse_a, lse_b)
    wa, wb = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
    return (wa[..., None] * out_a + wb[..., None] * out_b) / (wa + wb)[..., None]


def attend_decode_cascade(q, k_pages, v_pages, meta: CascadeMeta, sm_scale):
    """One query per decode sequence, q [Sd, Hq, D], over its tile's shared pages and its own
    rest -> [Sd, Hq, D] fp32."""
    shared = _shared_part(q, k_pages, v_pages, meta, sm_scale)
    return merge_parts(*shared, *_rest_part(q, k_pages, v_pages, meta, sm_scale))
