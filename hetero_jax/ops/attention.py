"""Ragged paged attention: one call over a flat token axis that mixes chunks and decode tokens.

In: `q [T, Hq, D]` (the new tokens of every sequence, back to back), one layer's KV pages
`[P, page_size, Hkv, D]` or the stacked cache `[L, P, page_size, Hkv, D]` with `layer` (the new
tokens' K/V already written; the Pallas kernel reads the stacked cache in place), `kv_lens [S]`,
`page_indices [S, pages_per_seq]`, `cu_q_lens [S+1]`, `num_seqs` (int32 scalar).
Out: `[T, Hq, D]`; rows past `cu_q_lens[num_seqs]` are padding and come back as zeros.

The XLA version splits the sequences into two groups so that padding stays low:
- the first `num_multi_query_seqs` sequences, each with up to `max_q_len` queries (chunks);
- the last (only) query of each later sequence (decode tokens).
A token of sequence `s >= num_multi_query_seqs` must therefore be that sequence's only token;
the runner sorts chunks before decode tokens, so this holds by construction. A third hint,
`chunk_pages`, bounds the first group's pages, so fresh chunks beside long decodes attend over
their own few keys. Left at their defaults (`None`) the hints make the first group cover
everything, which is always correct.
With a `cascade` plan (`cascade.CascadeMeta`, indices relative to the decode group) the decode
group reads the pages its sequences share once per tile (`cascade.attend_decode_cascade`); the
result is the same. The Pallas kernel takes the plan as a `cascade.TileList`. With
`decode_block_pages` (the CPU runner's choice) the decode group reads its keys that many pages
at a time, only as far as its longest sequence.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.ops.cascade import CascadeMeta, TileList, attend_decode_cascade
from hetero_jax.ops.pallas_attention import KernelPlan, ragged_paged_attention_pallas

_MASKED = -1e30


def _gather_kv(pages, page_indices, layer=None):
    """[P, ps, Hkv, D] (or the stacked [L, P, ps, Hkv, D] with `layer`), [S, pps] ->
    [S, pps * ps, Hkv, D]."""
    s, pps = page_indices.shape
    ps, hkv, d = pages.shape[-3:]
    got = pages[page_indices] if layer is None else pages[layer, page_indices]
    return got.reshape(s, pps * ps, hkv, d)


def _attend(q, k, v, q_pos, kv_lens, sm_scale):
    """q [S, Q, Hq, D], k/v [S, L, Hkv, D], q_pos [S, Q] -> [S, Q, Hq, D] (fp32 softmax).

    The query heads of one KV head and the Q queries form one matrix [G*Q, D] per
    (sequence, kv head), so XLA sees a few large batched matmuls instead of many tiny ones.
    """
    s, nq, hq, d = q.shape
    hkv, length = k.shape[2], k.shape[1]
    g = hq // hkv
    qm = q.reshape(s, nq, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(s, hkv, g * nq, d)
    km, vm = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [S, Hkv, L, D]
    scores = jnp.einsum("shmd,shkd->shmk", qm, km, preferred_element_type=jnp.float32)
    key_pos = jnp.arange(length)
    pos = jnp.tile(q_pos, (1, g))  # [S, G*Q], row m = (head m // Q, query m % Q)
    visible = (key_pos <= pos[:, :, None]) & (key_pos < kv_lens[:, None, None])
    probs = jax.nn.softmax(jnp.where(visible[:, None], scores * sm_scale, _MASKED), axis=-1)
    probs = probs.astype(v.dtype)
    # stale slots past kv_len get weight 0, and 0 * NaN is NaN: a page a failed request left
    # NaN must not reach the next request it is given to (the Pallas kernel does the same)
    vm = jnp.where((key_pos < kv_lens[:, None])[:, None, :, None], vm, 0)
    out = jnp.einsum("shmk,shkd->shmd", probs, vm, preferred_element_type=jnp.float32)
    return out.reshape(s, hkv, g, nq, d).transpose(0, 3, 1, 2, 4).reshape(s, nq, hq, d)


def _attend_last(q, k, v, kv_lens, sm_scale):
    """One query per sequence (its last token, at position kv_len - 1): q [S, Hq, D],
    k/v [S, L, Hkv, D] -> [S, Hq, D]. Contracting D with (S, Hkv) as batch dims keeps the
    keys on the long axis: on a CPU about 5x faster than one tiny matmul per (seq, head)."""
    s, hq, d = q.shape
    hkv, length = k.shape[2], k.shape[1]
    qg = q.reshape(s, hkv, hq // hkv, d)
    scores = jnp.einsum("shgd,slhd->slhg", qg, k, preferred_element_type=jnp.float32)
    visible = (jnp.arange(length)[None, :] < kv_lens[:, None])[:, :, None, None]
    probs = jax.nn.softmax(jnp.where(visible, scores * sm_scale, _MASKED), axis=1)
    v = jnp.where(visible, v, 0)  # stale slots: 0 * NaN (see _attend)
    out = jnp.einsum("slhg,slhd->shgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(s, hq, d)


def _attend_last_blocks(q, k_pages, v_pages, layer, page_indices, kv_lens, sm_scale,
                        block_pages):
    """`_attend_last` over the paged KV read `block_pages` pages at a time, with an online
    softmax, for as many blocks as the longest sequence fills (a data-dependent trip count):
    no copy of the whole page bucket, and no keys past the longest `kv_len` gathered.
    q [S, Hq, D], pages [P, ps, Hkv, D] (or stacked [L, ...] with `layer`: each block gathers
    from the stack, so the loop holds no copy of the layer), page_indices [S, pps] ->
    [S, Hq, D]."""
    s, hq, d = q.shape
    ps, hkv = k_pages.shape[-3], k_pages.shape[-2]
    g, width = hq // hkv, block_pages * ps
    blocks = -(-page_indices.shape[1] // block_pages)
    page_indices = jnp.pad(page_indices, ((0, 0), (0, blocks * block_pages
                                                   - page_indices.shape[1])))
    qg = q.reshape(s, hkv, g, d)

    def block(i, carry):
        top, total, acc = carry  # running max, softmax denominator, weighted values
        pages = jax.lax.dynamic_slice_in_dim(page_indices, i * block_pages, block_pages, 1)
        k, v = _gather_kv(k_pages, pages, layer), _gather_kv(v_pages, pages, layer)
        visible = ((i * width + jnp.arange(width))[None, :] < kv_lens[:, None])[..., None, None]
        scores = jnp.einsum("shgd,slhd->slhg", qg, k, preferred_element_type=jnp.float32)
        scores = jnp.where(visible, scores * sm_scale, _MASKED)
        new_top = jnp.maximum(top, scores.max(axis=1))
        probs = jnp.where(visible, jnp.exp(scores - new_top[:, None]), 0.0)
        scale = jnp.exp(top - new_top)
        v = jnp.where(visible, v, 0)  # stale slots: 0 * NaN (see _attend)
        values = jnp.einsum("slhg,slhd->shgd", probs.astype(v.dtype), v,
                            preferred_element_type=jnp.float32)
        return new_top, total * scale + probs.sum(axis=1), acc * scale[..., None] + values

    init = (jnp.full((s, hkv, g), _MASKED, jnp.float32), jnp.zeros((s, hkv, g), jnp.float32),
            jnp.zeros((s, hkv, g, d), jnp.float32))
    trips = jnp.minimum((jnp.max(kv_lens, initial=0) + width - 1) // width, blocks)
    _, total, acc = jax.lax.fori_loop(0, trips, block, init)
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]  # a sequence with no keys: 0
    return out.reshape(s, hq, d)


def _ragged_paged_attention_xla(q, k_cache, v_cache, layer, kv_lens, page_indices, cu_q_lens,
                                num_seqs, sm_scale, max_q_len, num_multi_query_seqs, chunk_pages,
                                cascade, decode_block_pages):
    k_pages, v_pages = (k_cache, v_cache) if layer is None else (k_cache[layer], v_cache[layer])
    t = q.shape[0]
    s = kv_lens.shape[0]
    seq_valid = jnp.arange(s) < num_seqs
    q_lens = jnp.where(seq_valid, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]
    kv_lens = jnp.where(seq_valid, kv_lens, 0)
    tok = jnp.arange(t)
    seq_of_tok = jnp.clip(jnp.searchsorted(cu_q_lens[1:], tok, side="right"), 0, s - 1)  # [T]
    tok_valid = tok < cu_q_lens[num_seqs]
    out = jnp.zeros(q.shape, jnp.float32)

    sa = num_multi_query_seqs
    if sa > 0:
        offs = jnp.arange(max_q_len)
        idx = jnp.clip(cu_q_lens[:sa, None] + offs[None, :], 0, t - 1)  # [Sa, Q]
        q_pos = kv_lens[:sa, None] - q_lens[:sa, None] + offs[None, :]
        pages_a = page_indices[:sa, :chunk_pages]
        out_a = _attend(q[idx], _gather_kv(k_pages, pages_a), _gather_kv(v_pages, pages_a),
                        q_pos, kv_lens[:sa], sm_scale)
        in_a = seq_of_tok < sa
        local = jnp.clip(tok - cu_q_lens[seq_of_tok], 0, max_q_len - 1)
        out = jnp.where(in_a[:, None, None], out_a[jnp.clip(seq_of_tok, 0, sa - 1), local], out)
    if sa < s:  # the single-query sequences sa.. (decode tokens)
        last = jnp.clip(cu_q_lens[sa + 1:] - 1, 0, t - 1)  # [S - sa]
        if cascade is None and decode_block_pages:
            out_b = _attend_last_blocks(q[last], k_cache, v_cache, layer, page_indices[sa:],
                                        kv_lens[sa:], sm_scale, decode_block_pages)
        elif cascade is None:
            out_b = _attend_last(q[last], _gather_kv(k_pages, page_indices[sa:]),
                                 _gather_kv(v_pages, page_indices[sa:]), kv_lens[sa:], sm_scale)
        else:
            out_b = attend_decode_cascade(q[last], k_pages, v_pages, cascade, sm_scale)
        out = jnp.where((seq_of_tok >= sa)[:, None, None],
                        out_b[jnp.clip(seq_of_tok - sa, 0, s - sa - 1)], out)
    return jnp.where(tok_valid[:, None, None], out, 0.0).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "impl", "max_q_len",
                                             "num_multi_query_seqs", "chunk_pages", "interpret",
                                             "decode_block_pages"))
def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           layer=None, sm_scale=None, impl="xla", max_q_len=None,
                           num_multi_query_seqs=None, chunk_pages=None, interpret=False,
                           cascade: CascadeMeta | TileList | None = None,
                           plan: KernelPlan | None = None,
                           decode_block_pages: int | None = None):
    """Attention of ragged new tokens over paged KV; see the module docstring.

    q [T, Hq, D]; k_pages, v_pages [P, page_size, Hkv, D], or with `layer` (an int or int32
    scalar) the whole stacked cache [L, P, page_size, Hkv, D] of which layer `layer` is read;
    kv_lens [S]; page_indices [S, pps]; cu_q_lens [S+1]; num_seqs int32 scalar. Static hints:
    `max_q_len` bounds the queries of each of the first `num_multi_query_seqs` sequences; all
    later sequences have one query. `cascade` reads shared prefixes once per tile: for XLA a
    `CascadeMeta` (its decode group is sequences num_multi_query_seqs.. of S; their rows of
    `page_indices` are then not read), for Pallas a `TileList`. `plan` (Pallas only:
    `pallas_attention.plan_work` of the step) is the kernel's work list, computed once per step.
    `decode_block_pages` (XLA only): read the decode group's keys that many pages at a time,
    looping only as far as its longest sequence (a data-dependent loop: for a CPU, where the
    loop's test is cheap and a gather of the whole page bucket is not); None gathers the bucket
    at once.
    """
    t, hq, d = q.shape
    s = kv_lens.shape[0]
    assert hq % k_pages.shape[-2] == 0, f"{hq=} is not a multiple of Hkv={k_pages.shape[-2]}"
    sm_scale = 1.0 / float(np.sqrt(d)) if sm_scale is None else sm_scale
    max_q_len = t if max_q_len is None else min(max_q_len, t)
    num_multi_query_seqs = s if num_multi_query_seqs is None else min(num_multi_query_seqs, s)
    if impl == "xla":
        assert cascade is None or isinstance(cascade, CascadeMeta), type(cascade)
        return _ragged_paged_attention_xla(q, k_pages, v_pages, layer, kv_lens, page_indices,
                                           cu_q_lens, num_seqs, sm_scale, max_q_len,
                                           num_multi_query_seqs, chunk_pages, cascade,
                                           decode_block_pages)
    if impl == "pallas":
        assert cascade is None or isinstance(cascade, TileList), type(cascade)
        return ragged_paged_attention_pallas(q, k_pages, v_pages, kv_lens, page_indices,
                                             cu_q_lens, num_seqs, layer=layer, plan=plan,
                                             sm_scale=sm_scale, interpret=interpret,
                                             cascade=cascade,
                                             num_multi_query_seqs=num_multi_query_seqs)
    raise ValueError(f"unknown attention impl {impl!r}; expected 'xla' or 'pallas'")


def ragged_paged_attention_reference(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                                     num_seqs, *, sm_scale=None):
    """Float64 numpy loop over sequences: the ground truth for tests. Same layout as above."""
    q, k_pages, v_pages = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
    t, hq, d = q.shape
    hkv = k_pages.shape[2]
    sm_scale = 1.0 / np.sqrt(d) if sm_scale is None else sm_scale
    out = np.zeros_like(q)
    for s in range(int(num_seqs)):
        lo, hi, kv_len = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        k = k_pages[np.asarray(page_indices[s])].reshape(-1, hkv, d)[:kv_len]
        v = v_pages[np.asarray(page_indices[s])].reshape(-1, hkv, d)[:kv_len]
        k, v = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
        for i in range(hi - lo):
            pos = kv_len - (hi - lo) + i
            scores = np.einsum("hd,khd->hk", q[lo + i], k[:pos + 1]) * sm_scale
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[lo + i] = np.einsum("hk,khd->hd", p / p.sum(-1, keepdims=True), v[:pos + 1])
    return out
