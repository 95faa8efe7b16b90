"""Ragged paged attention as one Pallas kernel (Triton lowering on GPU, interpret mode on CPU).

In: the same arrays as `attention.ragged_paged_attention` (`q [T, Hq, D]`, pages
`[P, page_size, Hkv, D]` or the stacked cache `[L, P, page_size, Hkv, D]` with a layer index,
`kv_lens [S]`, `page_indices [S, pps]`, `cu_q_lens [S+1]`, `num_seqs`). Out: `[T, Hq, D]`, rows
past `cu_q_lens[num_seqs]` zero. The float64 ground truth is
`attention.ragged_paged_attention_reference`.

Design. `plan_work` (once per step) cuts every sequence's new tokens into query blocks of
`block_q` tokens and lists them as work items `[W, 6]` (seq, first token, token count, position
of the first token, KV tokens to read, first page to read); the padding tail after
`cu_q_lens[num_seqs]` is one more pseudo-sequence with no KV, so its rows are written as zeros.
`W` is a static bound (about `T / block_q + S + 1`, at most `T`); spare items have no tokens and
return at once. The grid is `(Hkv, W, splits)`: one program per (kv head, query block, KV split)
takes the `Hq // Hkv` query heads of its kv head together, so its tile is `block_q * group_pad`
rows of (token, head) pairs (`group_pad` = the group rounded up to a power of two for Triton).
It streams its split's KV blocks of `pages_per_block` whole pages through an online softmax,
gathering rows of the stacked cache in place through the page table and the layer index (no
layer is sliced out: a copy), masks causally, and stores only its valid rows with their
log-sum-exp; splits are merged by log-sum-exp after the launch. Decode tokens (one query) and
chunks (many) share the one launch: a decode sequence is simply a work item with one token. A
decode-only launch uses 16-row tiles and splits the KV axis (flash-decoding) when kv heads x
items would leave SMs idle. Any head size runs: `q` is padded to a power of two and K/V's padded
columns are masked on load.

Cascade (`cascade.TileList`, in every step of a Pallas engine): a second launch whose work items
are (tile, block of 64 (token, head) rows) reads each tile's shared pages once per item, the
first launch reads each sequence's pages after them (the item's first page), and the two parts
merge by log-sum-exp. A step without tiles runs the second launch over items that are all
empty, so sharing is data, not a variant, and works in mixed steps as in decode-only ones.
"""
from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
import numpy as np

from hetero_jax.ops.cascade import TileList, merge_parts

_MASKED = -0.7 * float(np.finfo(np.float32).max)
H200_SMS = 132  # streaming multiprocessors of the GPU the defaults are sized for


def _ragged_paged_attention_kernel(work_ref, page_ref, layer_ref, *refs, sm_scale, block_q,
                                   group, group_pad, num_kv_heads, page_size, pages_per_block,
                                   head_dim, num_splits, precision, spare_rows, mapped):
    """One (kv head, query block, KV split): work_ref [W, 6], page_ref [S, pps'], layer_ref [1],
    (with `mapped`, tok_ref [R]: the token of each query row position), q_ref [T * Hq, Dp],
    k_ref/v_ref [L, P * page_size * Hkv, D] (the whole stacked cache, read in place: row =
    (page * page_size + slot) * Hkv + head of layer `layer_ref[0]`), o_ref [splits, R * Hq
    (+ M spare rows in interpret mode), Dp], lse_ref [splits, R * Hq (+ M)]: each row's
    log-sum-exp of its scaled scores over this split's keys (for merging splits, and with
    another part as cascade does). R = T unless `mapped`. Dp is D rounded up to a power of two:
    columns past D are masked on load and never stored by the caller."""
    tok_ref, q_ref, k_ref, v_ref, o_ref, lse_ref = refs if mapped else (None, *refs)
    h, w, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq, q_start, q_count = work_ref[w, 0], work_ref[w, 1], work_ref[w, 2]
    q_pos0, kv_end, first_page = work_ref[w, 3], work_ref[w, 4], work_ref[w, 5]
    layer = layer_ref[0]
    m_rows = block_q * group_pad
    rows = jnp.arange(m_rows)
    qi, g = rows // group_pad, rows % group_pad  # [M] token within the block, head in group
    row_ok = (qi < q_count) & (g < group)
    pos = jnp.where(row_ok, q_start + qi, 0)  # the row's position in the output
    tok = tok_ref[pos] if mapped else pos  # and its token in q
    q_rows = jnp.where(row_ok, tok * (num_kv_heads * group) + h * group + g, 0)
    out_rows = pos * (num_kv_heads * group) + h * group + g
    q = q_ref[q_rows, :]  # [M, Dp]
    q_pos = q_pos0 + qi  # [M]
    block_k = pages_per_block * page_size
    slot = jnp.arange(block_k)
    cols = jnp.arange(q.shape[-1])  # [Dp]

    def load_kv(ref, kv_rows):  # -> [block_k, Dp]; the padded columns read as 0
        if head_dim == q.shape[-1]:
            return ref[layer, kv_rows, :]
        return pltriton.load(ref.at[layer, kv_rows[:, None], cols[None, :]],
                             mask=(cols < head_dim)[None, :], other=0.0)

    def body(kb, carry):
        o, m, l = carry
        page = page_ref[seq, first_page + kb * pages_per_block + slot // page_size]
        kv_rows = (page * page_size + slot % page_size) * num_kv_heads + h
        key_pos = kb * block_k + slot  # [block_k]
        k = load_kv(k_ref, kv_rows)
        v = jnp.where((key_pos < kv_end)[:, None], load_kv(v_ref, kv_rows), 0)  # stale: 0 * NaN
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * sm_scale  # [M, block_k]
        s = jnp.where((key_pos[None, :] <= q_pos[:, None]) & (key_pos < kv_end)[None, :], s,
                      _MASKED)
        m_next = jnp.maximum(m, s.max(axis=-1))
        correction = jnp.exp(m - m_next)
        p = jnp.exp(s - m_next[:, None])
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)
        return correction[:, None] * o + pv, m_next, correction * l + p.sum(axis=-1)

    init = (jnp.zeros((m_rows, q.shape[-1]), jnp.float32),
            jnp.full((m_rows,), jnp.finfo(jnp.float32).min, jnp.float32),
            jnp.zeros((m_rows,), jnp.float32))
    blocks = pl.cdiv(kv_end, block_k)
    per_split = pl.cdiv(blocks, num_splits)  # flash-decoding: split `split` of the KV blocks
    first = jnp.minimum(split * per_split, blocks)
    o, m, l = lax.fori_loop(first, jnp.minimum(first + per_split, blocks), body, init)
    out = o / jnp.where(l == 0.0, 1.0, l)[:, None]  # no keys here (padding, empty split): 0
    # Interpret mode writes masked rows back with their old value, so they must not alias a
    # valid row: there they go to this program's spare rows. On GPU they are never written.
    o_rows = jnp.where(row_ok, out_rows, (o_ref.shape[1] - m_rows + rows) if spare_rows else 0)
    pltriton.store(o_ref.at[split, o_rows[:, None], cols[None, :]], out.astype(o_ref.dtype),
                   mask=row_ok[:, None])
    lse = jnp.where(l == 0.0, _MASKED, m + jnp.log(jnp.where(l == 0.0, 1.0, l)))
    pltriton.store(lse_ref.at[split, o_rows], lse, mask=row_ok)


def _work_list(kv_lens, cu_q_lens, num_seqs, num_tokens, block_q, num_items, max_kv,
               skip_pages=None, page_size: int = 1):
    """kv_lens [S], cu_q_lens [S+1] -> work [W, 6] int32, one row per query block:
    (seq, q_start, q_count, q_pos0, kv_end, first_page). Item seq == S is the zero-filled
    padding tail; kv_end <= max_kv (the page table's capacity) keeps reads in bounds whatever
    kv_lens says. With `skip_pages` [S] (a cascade's shared pages) a sequence's keys start
    that many pages into its table, and its positions count from there."""
    s = kv_lens.shape[0]
    seq_valid = jnp.arange(s) < num_seqs
    end = cu_q_lens[num_seqs]
    starts = jnp.append(cu_q_lens[:-1], end)  # [S+1]
    lens = jnp.append(jnp.where(seq_valid, cu_q_lens[1:] - cu_q_lens[:-1], 0), num_tokens - end)
    skip = jnp.zeros(s + 1, jnp.int32) if skip_pages is None else jnp.append(
        jnp.where(seq_valid, skip_pages, 0), 0)
    ctx = jnp.append(jnp.where(seq_valid, kv_lens, 0), 0) - skip * page_size
    blocks = pl.cdiv(lens, block_q)  # [S+1]
    first_block = jnp.cumsum(blocks) - blocks
    w = jnp.arange(num_items)
    # compare_all, not the default scan: no while loop, which a GPU runs from the host
    seq = jnp.clip(jnp.searchsorted(first_block + blocks, w, side="right",
                                    method="compare_all"), 0, s)  # [W]
    live = w < first_block[-1] + blocks[-1]
    off = (w - first_block[seq]) * block_q
    q_count = jnp.where(live, jnp.clip(lens[seq] - off, 0, block_q), 0)
    q_pos0 = ctx[seq] - lens[seq] + off
    kv_end = jnp.where(live & (seq < s),
                       jnp.minimum(q_pos0 + q_count, max_kv - skip[seq] * page_size), 0)
    q_start = jnp.where(live, starts[seq] + off, 0)
    work = [jnp.minimum(seq, s - 1), q_start, q_count, jnp.where(live, q_pos0, 0), kv_end,
            jnp.where(live, skip[seq], 0)]
    return jnp.stack(work, axis=1).astype(jnp.int32)


@flax.struct.dataclass
class KernelPlan:
    """The kernel's work lists of one step, computed once per step (not once per layer)."""

    work: jax.Array  # [W, 6] int32: the query blocks of every sequence (`_work_list`)
    block_q: int = flax.struct.field(pytree_node=False)  # query tokens per work item
    tile_work: jax.Array | None = None  # [Wt, 6] int32: the cascade tiles' blocks of members
    tile_tokens: jax.Array | None = None  # [S] int32: the members' tokens, in tile order
    token_slot: jax.Array | None = None  # [T] int32: each token's place among them, or -1
    tile_block_q: int = flax.struct.field(pytree_node=False, default=0)  # members per item


@dataclasses.dataclass(frozen=True)
class Tunables:
    """The kernel's static tiling: `block_q` query tokens per program, `pages_per_block` pages
    per KV step, `num_splits` programs over one item's KV axis (flash-decoding), Triton's
    `num_warps` / `num_stages`, the dots' `precision`, `interpret` mode off GPU."""

    sm_scale: float
    block_q: int
    pages_per_block: int
    num_splits: int
    num_warps: int
    num_stages: int
    precision: lax.Precision
    interpret: bool


def kv_splits(num_items: int, num_kv_heads: int, target_programs: int = 2 * H200_SMS,
              max_splits: int = 8) -> int:
    """KV splits per item for a decode-only launch: enough (kv heads x items x splits) programs
    to fill the GPU's SMs twice over, at most `max_splits`; 1 when the grid is full already."""
    return max(1, min(max_splits, -(-target_programs // max(1, num_items * num_kv_heads))))


def _merge_splits(out, lse, dtype):
    """out [N, R, Dp] and lse [N, R] of N softmax parts over disjoint keys -> [R, Dp] in
    `dtype`, [R]."""
    if out.shape[0] == 1:
        return out[0].astype(dtype), lse[0]
    m = lse.max(axis=0)
    w = jnp.exp(lse - m)  # [N, R]; empty parts (lse = _MASKED) weigh 0
    total = w.sum(axis=0)
    merged = (w[..., None] * out).sum(axis=0) / total[:, None]  # out: float32 when split
    return merged.astype(dtype), m + jnp.log(total)


def _launch(work, page_indices, layer, q, k_cache, v_cache, tun: Tunables, tokens=None):
    """The kernel over work items `[W, 6]` whose seq column indexes `page_indices [N, pps]`, on
    layer `layer` of the stacked cache k_cache/v_cache [L, P, page_size, Hkv, D]:
    q [T, Hq, D] -> (out [R, Hq, D], lse [R, Hq] fp32), R = T; with `tokens` [R] the items'
    rows are positions in it, each reading the query of its token (no copy of those rows)."""
    t, hq, d = q.shape
    r = t if tokens is None else tokens.shape[0]
    num_layers, num_pages, page_size, hkv, _ = k_cache.shape
    group = hq // hkv
    group_pad, d_pad = pl.next_power_of_2(group), max(16, pl.next_power_of_2(d))
    block_k = tun.pages_per_block * page_size
    if not tun.interpret:
        for name, n in (("block_q * group_pad", tun.block_q * group_pad), ("block_k", block_k)):
            assert n >= 16 and n & (n - 1) == 0, f"Triton needs {name}={n} a power of two >= 16"
    pad_cols = tun.pages_per_block - 1  # an item's last KV block may run past its table
    page_indices = jnp.pad(jnp.clip(page_indices, 0, num_pages - 1), ((0, 0), (0, pad_cols)))
    kernel = functools.partial(
        _ragged_paged_attention_kernel, sm_scale=tun.sm_scale, block_q=tun.block_q, group=group,
        group_pad=group_pad, num_kv_heads=hkv, page_size=page_size,
        pages_per_block=tun.pages_per_block, head_dim=d, num_splits=tun.num_splits,
        precision=tun.precision, spare_rows=tun.interpret, mapped=tokens is not None)
    rows = r * hq + (tun.block_q * group_pad if tun.interpret else 0)
    flat = (num_layers, num_pages * page_size * hkv, d)  # a bitcast: the cache is not copied
    out, lse = pl.pallas_call(
        kernel,
        grid=(hkv, work.shape[0], tun.num_splits),
        out_shape=(jax.ShapeDtypeStruct((tun.num_splits, rows, d_pad),
                                        q.dtype if tun.num_splits == 1 else jnp.float32),
                   jax.ShapeDtypeStruct((tun.num_splits, rows), jnp.float32)),
        compiler_params=pltriton.CompilerParams(num_warps=tun.num_warps,
                                                num_stages=tun.num_stages),
        interpret=tun.interpret,
        name=f"ragged_paged_attention_bq{tun.block_q}_ppb{tun.pages_per_block}"
             f"_split{tun.num_splits}",
    )(work, page_indices, jnp.reshape(layer, (1,)).astype(jnp.int32),
      *(() if tokens is None else (tokens.astype(jnp.int32),)),
      jnp.pad(q.reshape(t * hq, d), ((0, 0), (0, d_pad - d))), k_cache.reshape(flat),
      v_cache.reshape(flat))
    out, lse = _merge_splits(out[:, :r * hq], lse[:, :r * hq], q.dtype)
    return out[:, :d].reshape(r, hq, d), lse.reshape(r, hq)


def _num_items(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """A static bound on the query blocks of `num_seqs` sequences (+ the padding tail)."""
    return min(num_tokens, (num_tokens + (num_seqs + 1) * (block_q - 1)) // block_q)


def plan_work(kv_lens, page_indices, cu_q_lens, num_seqs, num_tokens: int, page_size: int, *,
              block_q: int, cascade: TileList | None = None, tile_block_q: int = 0) -> KernelPlan:
    """The work lists of one step (shapes as in `ragged_paged_attention_pallas`): run once per
    step, outside the layer loop, and pass the result to every layer as `plan`. With
    `cascade`, the tiles' work list too, `tile_block_q` members per item."""
    s, pps = page_indices.shape
    work = _work_list(kv_lens, cu_q_lens, num_seqs, num_tokens, block_q,
                      _num_items(num_tokens, s, block_q), pps * page_size,
                      None if cascade is None else cascade.skip_pages, page_size)
    g = 0 if cascade is None else cascade.tile_lens.shape[0]
    if not g:
        return KernelPlan(work, block_q)
    assert tile_block_q > 0, "a cascade plan needs the tiles' block size"
    items = min(s, (s + g * (tile_block_q - 1)) // tile_block_q)  # sum of ceil(members / bq)
    member = cascade.tile_rows  # [S] tile by tile; -1 after the last member
    tokens = jnp.clip(cu_q_lens[jnp.clip(member, 0, s - 1) + 1] - 1, 0, num_tokens - 1)
    slot = jnp.full(num_tokens, -1, jnp.int32).at[jnp.where(member >= 0, tokens, num_tokens)].set(
        jnp.arange(s, dtype=jnp.int32), mode="drop")
    return KernelPlan(work, block_q, _tile_work(cascade, tile_block_q, items), tokens, slot,
                      tile_block_q)


def _tile_work(tiles: TileList, block_q: int, num_items: int):
    """One work item per (tile, block of `block_q` members): [Wt, 6]. Its seq is the tile's
    lead, whose page table begins with the shared pages; its rows are the members' queries
    gathered in tile order; their position lies past every shared key, so all are visible."""
    g = tiles.tile_lens.shape[0]
    sizes = tiles.tile_starts[1:] - tiles.tile_starts[:-1]  # [G]; 0 past the last tile
    blocks = pl.cdiv(sizes, block_q)
    first_block = jnp.cumsum(blocks) - blocks
    w = jnp.arange(num_items)
    tile = jnp.clip(jnp.searchsorted(first_block + blocks, w, side="right",
                                     method="compare_all"), 0, g - 1)  # [Wt]
    live = w < first_block[-1] + blocks[-1]
    off = (w - first_block[tile]) * block_q
    end = jnp.where(live, tiles.tile_lens[tile], 0)
    work = [tiles.tile_lead[tile], jnp.where(live, tiles.tile_starts[tile] + off, 0),
            jnp.where(live, jnp.clip(sizes[tile] - off, 0, block_q), 0), end, end,
            jnp.zeros_like(w)]
    return jnp.stack(work, axis=1).astype(jnp.int32)


def _cascade(q, k_cache, v_cache, layer, page_indices, plan: KernelPlan, tun: Tunables):
    """Two launches: every sequence over its own pages (past its tile's shared ones), then
    each tile's members' queries over the shared pages; the members' rows merged by
    log-sum-exp (a member has one query: its decode token), in one pass over the rows."""
    out, lse = _launch(plan.work, page_indices, layer, q, k_cache, v_cache, tun)
    tile_tun = dataclasses.replace(tun, block_q=plan.tile_block_q, num_splits=1)
    out_t, lse_t = _launch(plan.tile_work, page_indices, layer, q, k_cache, v_cache, tile_tun,
                           tokens=plan.tile_tokens)
    slot = plan.token_slot  # [T]
    at = jnp.maximum(slot, 0)
    merged = merge_parts(out_t[at].astype(jnp.float32), lse_t[at], out.astype(jnp.float32), lse)
    return jnp.where((slot >= 0)[:, None, None], merged.astype(out.dtype), out)


def default_block_q(num_heads: int, num_kv_heads: int, decode_only: bool) -> int:
    """Query tokens per program: 64 tile rows of (token, head) where chunks run; 16 rows (the
    smallest Triton dot) in a decode-only step, whose items hold one token each."""
    return max(1, (16 if decode_only else 64) // pl.next_power_of_2(num_heads // num_kv_heads))


def _precision() -> lax.Precision:
    """HIGHEST (IEEE fp32 dots) when jax's default matmul precision asks for it, else DEFAULT:
    tensor cores, which run float32 inputs as TF32 on a GPU."""
    asked = jax.config.jax_default_matmul_precision
    return lax.Precision.HIGHEST if asked in ("highest", "float32") else lax.Precision.DEFAULT


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_q", "pages_per_block",
                                             "num_splits", "num_warps", "num_stages",
                                             "interpret", "num_multi_query_seqs"))
def ragged_paged_attention_pallas(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                                  num_seqs, *, layer=None, plan: KernelPlan | None = None,
                                  sm_scale=None, block_q=None, pages_per_block=None,
                                  num_splits=None, num_warps=4, num_stages=2, interpret=False,
                                  cascade=None, num_multi_query_seqs=0):
    """Pallas ragged paged attention; same arguments and result as `ragged_paged_attention`.

    q [T, Hq, D] (any D: padded to a power of two inside); k_pages, v_pages [P, page_size, Hkv,
    D], or with `layer` (an int32 scalar) the whole stacked cache [L, P, page_size, Hkv, D],
    read in place; kv_lens [S]; page_indices [S, pps]; cu_q_lens [S+1]; num_seqs int32 scalar
    -> [T, Hq, D]. `plan` (`plan_work`, same block_q) saves recomputing the work list per
    layer. Tunables: `block_q` query tokens per program (default `default_block_q`),
    `pages_per_block` pages per KV step (default: 64 tokens), `num_splits` over the KV axis
    (default `kv_splits` in a decode-only call, else 1), Triton `num_warps` and `num_stages`.
    With `cascade` (a `cascade.TileList`: tiles of the step's decode sequences, in a step
    with chunks too), shared prefixes are read once per tile and block of members by a second
    launch; `num_multi_query_seqs` = 0 marks a decode-only call.
    """
    t, hq, d = q.shape
    if layer is None:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    hkv, page_size = k_pages.shape[3], k_pages.shape[2]
    assert hq % hkv == 0, f"{hq=} is not a multiple of {hkv=}"
    assert k_pages.shape == v_pages.shape, f"{k_pages.shape=} != {v_pages.shape=}"
    decode_only = num_multi_query_seqs == 0
    if block_q is None:
        block_q = default_block_q(hq, hkv, decode_only) if plan is None else plan.block_q
    assert plan is None or plan.block_q == block_q, f"{plan.block_q=} != {block_q=}"
    if num_splits is None:
        num_splits = kv_splits(_num_items(t, kv_lens.shape[0], block_q), hkv) if (
            decode_only) else 1
    tun = Tunables(sm_scale=1.0 / float(np.sqrt(d)) if sm_scale is None else sm_scale,
                   block_q=block_q, num_splits=num_splits,
                   pages_per_block=max(1, 64 // page_size) if pages_per_block is None
                   else pages_per_block, num_warps=num_warps, num_stages=num_stages,
                   precision=_precision(), interpret=interpret)
    if plan is None:
        plan = plan_work(kv_lens, page_indices, cu_q_lens, num_seqs, t, page_size,
                         block_q=block_q, cascade=cascade,
                         tile_block_q=default_block_q(hq, hkv, decode_only=False))
    assert (plan.tile_work is not None) == (cascade is not None and cascade.tile_lens.size > 0), (
        "the plan's tile work list and the cascade tiles disagree")
    if plan.tile_work is not None:
        return _cascade(q, k_pages, v_pages, layer, page_indices, plan, tun)
    return _launch(plan.work, page_indices, layer, q, k_pages, v_pages, tun)[0]
