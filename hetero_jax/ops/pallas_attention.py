"""Ragged paged attention as one Pallas kernel (Triton lowering on GPU, interpret mode on CPU).

In: the same arrays as `attention.ragged_paged_attention` (`q [T, Hq, D]`, pages
`[P, page_size, Hkv, D]`, `kv_lens [S]`, `page_indices [S, pps]`, `cu_q_lens [S+1]`, `num_seqs`).
Out: `[T, Hq, D]`, rows past `cu_q_lens[num_seqs]` zero. The float64 ground truth is
`attention.ragged_paged_attention_reference`.

Design. The wrapper cuts every sequence's new tokens into query blocks of `block_q` tokens and
lists them as work items `[W, 5]` (seq, first token, token count, position of the first token,
KV tokens to read); the padding tail after `cu_q_lens[num_seqs]` is one more pseudo-sequence
with no KV, so its rows are written as zeros. `W` is a static bound (about
`T / block_q + S + 1`, at most `T`); spare items have no tokens and return at once. The grid is
`(Hkv, W)`: one program per (kv head, query block) takes the `Hq // Hkv` query heads of its kv
head together, so its tile is `block_q * group_pad` rows of (token, head) pairs (`group_pad` =
the group rounded up to a power of two for Triton). It streams KV blocks of `pages_per_block`
whole pages through an online softmax, gathering rows through the page table, masks causally,
and stores only its valid rows. Decode tokens (one query) and chunks (many) share the one
launch: a decode sequence is simply a work item with one token. That wastes tile rows on decode
items, which is compute the memory-bound decode can afford; there is no split over the KV axis
yet, so few long sequences leave most of the GPU idle.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
import numpy as np

from hetero_jax.ops.cascade import merge_parts

_MASKED = -0.7 * float(np.finfo(np.float32).max)


def _ragged_paged_attention_kernel(work_ref, page_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
                                   sm_scale, block_q, group, group_pad, num_kv_heads, page_size,
                                   pages_per_block, spare_rows):
    """One (kv head, query block): work_ref [W, 5], page_ref [S, pps'], q_ref [T * Hq, D],
    k_ref/v_ref [P * page_size * Hkv, D] (row = (page * page_size + slot) * Hkv + head),
    o_ref [T * Hq (+ M spare rows in interpret mode), D], lse_ref [T * Hq (+ M)]: each row's
    log-sum-exp of its scaled scores (for merging with another part, as cascade does)."""
    h, w = pl.program_id(0), pl.program_id(1)
    seq, q_start, q_count = work_ref[w, 0], work_ref[w, 1], work_ref[w, 2]
    q_pos0, kv_end = work_ref[w, 3], work_ref[w, 4]
    m_rows = block_q * group_pad
    rows = jnp.arange(m_rows)
    qi, g = rows // group_pad, rows % group_pad  # [M] token within the block, head in group
    row_ok = (qi < q_count) & (g < group)
    q_rows = jnp.where(row_ok, (q_start + qi) * (num_kv_heads * group) + h * group + g, 0)
    q = q_ref[q_rows, :]  # [M, D]
    q_pos = q_pos0 + qi  # [M]
    block_k = pages_per_block * page_size
    slot = jnp.arange(block_k)

    def body(kb, carry):
        o, m, l = carry
        page = page_ref[seq, kb * pages_per_block + slot // page_size]  # [block_k]
        kv_rows = (page * page_size + slot % page_size) * num_kv_heads + h
        key_pos = kb * block_k + slot  # [block_k]
        k = k_ref[kv_rows, :]  # [block_k, D]
        v = jnp.where((key_pos < kv_end)[:, None], v_ref[kv_rows, :], 0)  # stale slots: 0 * NaN
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32) * sm_scale  # [M, block_k]
        s = jnp.where((key_pos[None, :] <= q_pos[:, None]) & (key_pos < kv_end)[None, :], s,
                      _MASKED)
        m_next = jnp.maximum(m, s.max(axis=-1))
        correction = jnp.exp(m - m_next)
        p = jnp.exp(s - m_next[:, None])
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return correction[:, None] * o + pv, m_next, correction * l + p.sum(axis=-1)

    init = (jnp.zeros((m_rows, q.shape[-1]), jnp.float32),
            jnp.full((m_rows,), jnp.finfo(jnp.float32).min, jnp.float32),
            jnp.zeros((m_rows,), jnp.float32))
    o, m, l = lax.fori_loop(0, pl.cdiv(kv_end, block_k), body, init)
    out = o / jnp.where(l == 0.0, 1.0, l)[:, None]  # items without KV (padding) give zeros
    # Interpret mode writes masked rows back with their old value, so they must not alias a
    # valid row: there they go to this program's spare rows. On GPU they are never written.
    o_rows = jnp.where(row_ok, q_rows, (q_ref.shape[0] + rows) if spare_rows else 0)
    cols = jnp.arange(q.shape[-1])  # all-array indices: interpret mode has no masked mixed store
    pltriton.store(o_ref.at[o_rows[:, None], cols[None, :]], out.astype(o_ref.dtype),
                   mask=row_ok[:, None])
    lse = jnp.where(l == 0.0, _MASKED, m + jnp.log(jnp.where(l == 0.0, 1.0, l)))
    pltriton.store(lse_ref.at[o_rows], lse, mask=row_ok)


def _work_list(kv_lens, cu_q_lens, num_seqs, num_tokens, block_q, num_items, max_kv):
    """kv_lens [S], cu_q_lens [S+1] -> work [W, 5] int32, one row per query block:
    (seq, q_start, q_count, q_pos0, kv_end). Item seq == S is the zero-filled padding tail;
    kv_end <= max_kv (the page table's capacity) keeps reads in bounds whatever kv_lens says."""
    s = kv_lens.shape[0]
    seq_valid = jnp.arange(s) < num_seqs
    end = cu_q_lens[num_seqs]
    starts = jnp.append(cu_q_lens[:-1], end)  # [S+1]
    lens = jnp.append(jnp.where(seq_valid, cu_q_lens[1:] - cu_q_lens[:-1], 0), num_tokens - end)
    ctx = jnp.append(jnp.where(seq_valid, kv_lens, 0), 0)
    blocks = pl.cdiv(lens, block_q)  # [S+1]
    first_block = jnp.cumsum(blocks) - blocks
    w = jnp.arange(num_items)
    seq = jnp.clip(jnp.searchsorted(first_block + blocks, w, side="right"), 0, s)  # [W]
    live = w < first_block[-1] + blocks[-1]
    off = (w - first_block[seq]) * block_q
    q_count = jnp.where(live, jnp.clip(lens[seq] - off, 0, block_q), 0)
    q_pos0 = ctx[seq] - lens[seq] + off
    kv_end = jnp.where(live & (seq < s), jnp.minimum(q_pos0 + q_count, max_kv), 0)
    q_start = jnp.where(live, starts[seq] + off, 0)
    work = [jnp.minimum(seq, s - 1), q_start, q_count, jnp.where(live, q_pos0, 0), kv_end]
    return jnp.stack(work, axis=1).astype(jnp.int32)


def _launch(work, page_indices, q, k_pages, v_pages, *, sm_scale, block_q, pages_per_block,
            num_warps, num_stages, interpret):
    """The kernel over work items `[W, 5]` whose seq column indexes `page_indices [N, pps]`:
    q [T, Hq, D] -> (out [T, Hq, D], lse [T, Hq] fp32)."""
    t, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_pages.shape
    group = hq // hkv
    group_pad = pl.next_power_of_2(group)
    block_k = pages_per_block * page_size
    if not interpret:
        for name, n in (("block_q * group_pad", block_q * group_pad), ("block_k", block_k),
                        ("head_dim", d)):
            assert n >= 16 and n & (n - 1) == 0, f"Triton needs {name}={n} a power of two >= 16"
    pad_cols = -page_indices.shape[1] % pages_per_block
    page_indices = jnp.pad(jnp.clip(page_indices, 0, num_pages - 1), ((0, 0), (0, pad_cols)))
    kernel = functools.partial(
        _ragged_paged_attention_kernel, sm_scale=sm_scale, block_q=block_q, group=group,
        group_pad=group_pad, num_kv_heads=hkv, page_size=page_size,
        pages_per_block=pages_per_block, spare_rows=interpret)
    spare = block_q * group_pad if interpret else 0
    out, lse = pl.pallas_call(
        kernel,
        grid=(hkv, work.shape[0]),
        out_shape=(jax.ShapeDtypeStruct((t * hq + spare, d), q.dtype),
                   jax.ShapeDtypeStruct((t * hq + spare,), jnp.float32)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_{block_q=}_{pages_per_block=}",
    )(work, page_indices, q.reshape(t * hq, d), k_pages.reshape(-1, d), v_pages.reshape(-1, d))
    return out[:t * hq].reshape(t, hq, d), lse[:t * hq].reshape(t, hq)


def ragged_paged_attention_unjitted(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                                    num_seqs, *, block_q, **tunables):
    """Builds the work list and calls the kernel; shapes as in the module docstring.
    Returns (out [T, Hq, D], lse [T, Hq])."""
    t = q.shape[0]
    s, pps = page_indices.shape
    num_items = min(t, (t + (s + 1) * (block_q - 1)) // block_q)
    work = _work_list(kv_lens, cu_q_lens, num_seqs, t, block_q, num_items,
                      pps * k_pages.shape[1])
    return _launch(work, page_indices, q, k_pages, v_pages, block_q=block_q, **tunables)


def _tile_work(tile_lens, rows: int, block_q: int):
    """One work item per (tile, query block) of the tiles' gathered rows: [G * nb, 5]; the
    query position is past every shared key, so all of them are visible."""
    g = tile_lens.shape[0]
    nb = -(-rows // block_q)
    tile, blk = jnp.repeat(jnp.arange(g), nb), jnp.tile(jnp.arange(nb), g)
    ends = tile_lens[tile]
    work = [tile, tile * rows + blk * block_q, jnp.minimum(block_q, rows - blk * block_q), ends,
            ends]
    return jnp.stack(work, axis=1).astype(jnp.int32)


def cascade_attention_unjitted(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                               cascade, num_multi_query_seqs, *, block_q, **tunables):
    """Two launches: every sequence over its own pages (the decode group's rest pages), then
    each tile's decode queries over its shared pages; the decode rows merged by log-sum-exp."""
    t = q.shape[0]
    sa = num_multi_query_seqs
    sd = kv_lens.shape[0] - sa
    width = max(page_indices.shape[1], cascade.rest_pages.shape[1])
    widen = lambda a: jnp.pad(a, ((0, 0), (0, width - a.shape[1])))  # noqa: E731
    tables = jnp.concatenate([widen(page_indices[:sa]), widen(cascade.rest_pages)])
    lens = jnp.concatenate([kv_lens[:sa], cascade.rest_lens])
    out, lse = ragged_paged_attention_unjitted(q, k_pages, v_pages, lens, tables, cu_q_lens,
                                               num_seqs, block_q=block_q, **tunables)
    last = jnp.clip(cu_q_lens[sa + 1:] - 1, 0, t - 1)  # [Sd] each decode sequence's row
    g, rows = cascade.tile_seqs.shape
    tile_tok = last[jnp.clip(cascade.tile_seqs, 0, sd - 1)].reshape(-1)  # [G * M]
    out_t, lse_t = _launch(_tile_work(cascade.tile_lens, rows, block_q), cascade.tile_pages,
                           q[tile_tok], k_pages, v_pages, block_q=block_q, **tunables)
    dest = jnp.where(cascade.tile_seqs >= 0, cascade.tile_seqs, sd).reshape(-1)
    out_s = jnp.zeros((sd,) + q.shape[1:], jnp.float32).at[dest].set(out_t, mode="drop")
    lse_s = jnp.full((sd, q.shape[1]), _MASKED, jnp.float32).at[dest].set(lse_t, mode="drop")
    merged = merge_parts(out_s, lse_s, out[last].astype(jnp.float32), lse[last])
    rows_out = jnp.where(jnp.arange(sa, sa + sd) < num_seqs, last, t)  # padding seqs: dropped
    return out.at[rows_out].set(merged.astype(out.dtype), mode="drop")


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_q", "pages_per_block",
                                             "num_warps", "num_stages", "interpret",
                                             "num_multi_query_seqs"))
def ragged_paged_attention_pallas(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                                  num_seqs, *, sm_scale=None, block_q=None, pages_per_block=None,
                                  num_warps=4, num_stages=2, interpret=False, cascade=None,
                                  num_multi_query_seqs=0):
    """Pallas ragged paged attention; same arguments and result as `ragged_paged_attention`.

    q [T, Hq, D]; k_pages, v_pages [P, page_size, Hkv, D]; kv_lens [S]; page_indices [S, pps];
    cu_q_lens [S+1]; num_seqs int32 scalar -> [T, Hq, D]. Tunables: `block_q` query tokens per
    program (default: 64 tile rows of (token, head)), `pages_per_block` pages per KV step
    (default: 64 tokens), Triton `num_warps` and `num_stages`. With `cascade` (a
    `cascade.CascadeMeta` for the sequences after the first `num_multi_query_seqs`), shared
    prefixes are read once per tile by a second launch.
    """
    t, hq, d = q.shape
    hkv, page_size = k_pages.shape[2], k_pages.shape[1]
    assert hq % hkv == 0, f"{hq=} is not a multiple of {hkv=}"
    assert k_pages.shape == v_pages.shape, f"{k_pages.shape=} != {v_pages.shape=}"
    sm_scale = 1.0 / float(np.sqrt(d)) if sm_scale is None else sm_scale
    group_pad = pl.next_power_of_2(hq // hkv)
    block_q = max(1, 64 // group_pad) if block_q is None else block_q
    pages_per_block = max(1, 64 // page_size) if pages_per_block is None else pages_per_block
    tunables = dict(sm_scale=sm_scale, block_q=block_q, pages_per_block=pages_per_block,
                    num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    if cascade is not None:
        return cascade_attention_unjitted(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                                          num_seqs, cascade, num_multi_query_seqs, **tunables)
    return ragged_paged_attention_unjitted(q, k_pages, v_pages, kv_lens, page_indices,
                                           cu_q_lens, num_seqs, **tunables)[0]
