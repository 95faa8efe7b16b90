"""Host -> device: the scheduler's items packed into one bucketed `StepBatch`.

In: the decoder's `ScheduledItem`s of one step (plain data, sorted embedding chunks, prefill
chunks, decode tokens), the scheduler's cascade plan of the step (`SchedulerOutput.cascade`)
and the `EngineConfig` bucket lists. Out: the variant key `(T, S, Sc, pages_per_seq,
second_pages)` of the step-shape rule (`sched/shapes.py`) and numpy arrays of exactly those
shapes. Padding
tokens write their K/V to the scratch page 0 and pool into the dummy slot; padding sequences
have kv_len 0. In a step with chunks, second_pages is the chunk group's own page bucket (the
smallest bucket when every one of the first Sc sequences fits it), so fresh chunks beside long
decodes attend over their own few keys (the first second_pages columns of `page_indices`). A
decode-only step whose sequences share enough pages (prefix-cache hits) has a cascade plan
from the scheduler (`ops.cascade`): second_pages > 0 is then its tiles' shared page bucket and
pages_per_seq counts each sequence's pages after the shared ones. On the Pallas kernel
(`EngineConfig.tiles_as_data`) the plan is no part of the key: every step carries a `TileList`
of S // 2 tiles, empty where the scheduler planned none. `batch_spec` gives the same structure
as shapes, for ahead-of-time lowering.
"""
from __future__ import annotations

import itertools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.config import EngineConfig
from hetero_jax.models import llama
from hetero_jax.ops.cascade import (cascade_arrays_flat, cascade_spec, tile_list_arrays,
                                    tile_list_spec)
from hetero_jax.runner import pooler
from hetero_jax.runner.sampler import SamplingKnobs
from hetero_jax.sched import DECODE, EMBED
from hetero_jax.sched.shapes import key_of_step

# A sampled row's knobs that change nothing (embedding rows and padding): temperature, top_k,
# top_p, seed, step, presence, frequency, repetition, kv_len.
_NEUTRAL = (0.0, 0, 1.0, 0, 0, 0.0, 0.0, 1.0, 0)
_KNOB_DTYPES = (np.float32, np.int32, np.float32, np.uint32, np.int32, np.float32, np.float32,
                np.float32, np.int32)


@flax.struct.dataclass
class StepBatch:
    tokens: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    slots: jax.Array  # [T] int32: page * page_size + offset where the token's K/V goes
    meta: llama.AttnMeta  # kv_lens [S], page_indices [S, P], cu_q_lens [S+1], num_seqs []
    sample_rows: jax.Array  # [S] int32: the token row whose logits each sequence samples
    knobs: SamplingKnobs  # [S] each
    pool: pooler.PoolBatch  # token_slot [T]; per embedding item [Sc]
    adapter_ids: jax.Array  # [T] int32: each token's LoRA adapter, 0 = base model
    prev_rows: jax.Array  # [T] int32: the row of the step before whose sampled token this
    # token is (read on the device: `link_tokens`), or -1: `tokens` holds it


def is_cascade(key: tuple) -> bool:
    """Whether variant `key` is a cascade step of the XLA attention: decode-only (Sc = 0)
    with shared pages."""
    _, _, sc, _, second = key
    return sc == 0 and second > 0


def uses_cascade(batch: StepBatch) -> bool:
    """Whether a packed step reads shared pages once per tile (it has a tile in use)."""
    cascade = batch.meta.cascade
    return cascade is not None and bool(np.any(np.asarray(cascade.tile_lens)))


def _cascade_spec(cfg: EngineConfig, key: tuple):
    """The cascade arrays' shape structs in a step of variant `key`, or None."""
    _, s, _, p, second = key
    if cfg.tiles_as_data():
        return tile_list_spec(s)
    return cascade_spec(*cfg.cascade_tiles(s), second, s, p) if is_cascade(key) else None


def _cascade_arrays(cfg: EngineConfig, plan: tuple | None, key: tuple, pages, first_page,
                    kv_lens):
    """The cascade arrays of a step of variant `key` under the scheduler's `plan`, or None."""
    _, s, _, p, second = key
    if cfg.tiles_as_data():
        return tile_list_arrays(plan, s, cfg.page_size)
    if plan is None:
        return None
    return cascade_arrays_flat(pages, first_page, kv_lens, cfg.page_size, plan,
                               *cfg.cascade_tiles(s), second, p, s)


def batch_spec(cfg: EngineConfig, t: int, s: int, sc: int, p: int, second: int) -> StepBatch:
    """Shape/dtype structs of a StepBatch variant, for ahead-of-time lowering."""
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    bool_ = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bool_)  # noqa: E731
    return StepBatch(
        tokens=i32(t), positions=i32(t), slots=i32(t),
        meta=llama.AttnMeta(kv_lens=i32(s), page_indices=i32(s, p), cu_q_lens=i32(s + 1),
                            num_seqs=i32(),
                            cascade=_cascade_spec(cfg, (t, s, sc, p, second))),
        sample_rows=i32(s),
        knobs=SamplingKnobs(temperature=f32(s), top_k=i32(s), top_p=f32(s),
                            seed=jax.ShapeDtypeStruct((s,), jnp.uint32), step=i32(s),
                            presence=f32(s), frequency=f32(s), repetition=f32(s),
                            kv_len=i32(s), prompt_len=i32(s)),
        pool=pooler.PoolBatch(token_slot=i32(t), item_slot=i32(sc), item_last_row=i32(sc),
                              item_first_chunk=bool_(sc), kind=i32(sc), normalize=bool_(sc),
                              item_length=i32(sc), item_hit_pages=i32(sc)),
        adapter_ids=i32(t), prev_rows=i32(t))


def _pack_sampling(items: list, s: int) -> SamplingKnobs:
    """Sampling knobs, one row per generation item (embedding rows and padding keep the
    neutral ones). A knob out of its dtype's range raises numpy's OverflowError, naming it."""
    rows = [_NEUTRAL if it.kind == EMBED else
            (it.knobs.temperature, it.knobs.top_k, it.knobs.top_p, it.knobs.seed,
             it.num_output_tokens, it.knobs.presence, it.knobs.frequency, it.knobs.repetition,
             it.start + it.num_tokens) for it in items] + [_NEUTRAL] * (s - len(items))
    temperature, top_k, top_p, seed, step, presence, frequency, repetition, kv_len = (
        np.array(column, dtype) for column, dtype in zip(zip(*rows), _KNOB_DTYPES))
    return SamplingKnobs(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         step=step, presence=presence, frequency=frequency,
                         repetition=repetition, kv_len=kv_len, prompt_len=kv_len - step)


def _pack_pooling(items: list, rows: list, t: int, sc: int, dummy: int,
                  page_size: int) -> pooler.PoolBatch:
    """Pool arrays for the embedding items (the first ones of the step, in order)."""
    token_slot = np.full(t, dummy, np.int32)
    item_slot, last_row = np.full(sc, dummy, np.int32), np.zeros(sc, np.int32)
    first, normalize = np.zeros(sc, bool), np.zeros(sc, bool)
    kind, length, hit = (np.zeros(sc, np.int32) for _ in range(3))
    for i, it in enumerate(it for it in items if it.kind == EMBED):
        lo, hi = rows[i]
        token_slot[lo:hi], item_slot[i], last_row[i] = it.pool_slot, it.pool_slot, hi - 1
        first[i], length[i] = it.first_chunk, it.start + it.num_tokens
        hit[i] = it.num_cached_tokens // page_size
        kind[i], normalize[i] = it.knobs.kind, it.knobs.normalize
    return pooler.PoolBatch(token_slot=token_slot, item_slot=item_slot, item_last_row=last_row,
                            item_first_chunk=first, kind=kind, normalize=normalize,
                            item_length=length, item_hit_pages=hit)


def pack_batch(items: list, cfg: EngineConfig,
               plan: tuple | None = None) -> tuple[tuple, StepBatch]:
    """Host arrays for one step and its variant key (T, S, Sc, pages_per_seq, second_pages);
    `plan`: the step's cascade plan (`SchedulerOutput.cascade`), None for plain attention.
    Whole-array numpy over the step's tokens: a per-item loop of small numpy writes cost
    about 6 us an item (1.6 ms of host at 256 decodes; 0.3 ms this way)."""
    ps, n = cfg.page_size, len(items)
    counts, starts, num_pages, multi = np.array(
        [(it.num_tokens, it.start, len(it.pages), it.kind != DECODE) for it in items],
        np.int64).reshape(n, 4).T
    key = key_of_step(int(counts.sum()), int(multi.sum()),
                      (-(-(starts + counts) // ps)).tolist(), cfg.buckets(),
                      None if cfg.tiles_as_data() else plan)  # step_key
    t, s, sc, p, _ = key
    cu = np.zeros(s + 1, np.int32)
    np.cumsum(counts, out=cu[1:n + 1])
    n_tok = int(cu[n])
    cu[n + 1:] = n_tok
    owner = np.repeat(np.arange(n), counts)  # each token's item
    pos = np.arange(n_tok) - cu[owner] + starts[owner]
    pages = np.fromiter(itertools.chain.from_iterable(it.pages for it in items), np.int64,
                        int(num_pages.sum()))
    first_page = np.cumsum(num_pages) - num_pages  # each item's offset in `pages`
    tokens, positions, slots, adapter_ids = (np.zeros(t, np.int32) for _ in range(4))
    ids = np.fromiter(itertools.chain.from_iterable(it.token_ids for it in items), np.int32)
    if len(ids) != n_tok:
        raise ValueError(f"the step's items hold {len(ids)} token ids for {n_tok} tokens")
    tokens[:n_tok] = ids
    past = np.flatnonzero(pos // ps >= num_pages[owner])
    if past.size:
        it = items[owner[past[0]]]
        raise ValueError(f"request {it.request_id}: position {pos[past[0]]} lies past its "
                         f"{len(it.pages)} pages of {ps} tokens")
    positions[:n_tok] = pos
    slots[:n_tok] = pages[first_page[owner] + pos // ps] * ps + pos % ps
    adapter_ids[:n_tok] = np.repeat([it.knobs.adapter_id if it.kind == EMBED else 0
                                     for it in items], counts)
    col = np.arange(p)
    held = col < num_pages[:, None]  # [n, p]: the columns an item's pages fill
    page_indices = np.zeros((s, p), np.int32)
    page_indices[:n][held] = pages[(first_page[:, None] + col)[held]]
    kv_lens, sample_rows = np.zeros(s, np.int32), np.zeros(s, np.int32)
    kv_lens[:n], sample_rows[:n] = starts + counts, cu[1:n + 1] - 1
    rows = list(zip(cu[:n].tolist(), cu[1:n + 1].tolist()))
    batch = StepBatch(
        tokens=tokens, positions=positions, slots=slots,
        meta=llama.AttnMeta(kv_lens=kv_lens, page_indices=page_indices, cu_q_lens=cu,
                            num_seqs=np.int32(n),
                            cascade=_cascade_arrays(cfg, plan, key, pages, first_page,
                                                    kv_lens[:n].astype(np.int64))),
        sample_rows=sample_rows, knobs=_pack_sampling(items, s),
        pool=_pack_pooling(items, rows, t, sc, cfg.max_num_seqs, ps), adapter_ids=adapter_ids,
        prev_rows=np.full(t, -1, np.int32))
    return key, batch


def link_tokens(batch: StepBatch, items: list, rows_before: dict,
                placeholder: int) -> StepBatch:
    """`batch` (packed from `items`) with each `placeholder` token, the last token of a decode
    whose request's previous step is still running, linked to the row that step samples it in
    (`rows_before`: request_id -> row), so the device reads it from that step's output and the
    host need not wait for it. Asserts that every placeholder is linked."""
    prev_rows, lo = np.array(batch.prev_rows), 0  # [T] int32
    for it in items:
        if it.token_ids and it.token_ids[-1] == placeholder:
            prev_rows[lo + it.num_tokens - 1] = rows_before[it.request_id]
        lo += it.num_tokens
    left = (np.asarray(batch.tokens[:lo]) == placeholder) & (prev_rows[:lo] < 0)
    assert not left.any(), f"a placeholder token is left: {batch.tokens[:lo]}"
    return batch.replace(prev_rows=prev_rows)
