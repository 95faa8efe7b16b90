"""ragged_paged_attention (XLA) against a float64 numpy loop, on random ragged batches."""
import numpy as np
import pytest

from hetero_jax.ops import ragged_paged_attention, ragged_paged_attention_reference
from tests.batches import random_batch


CASES = [  # (q_lens, cached context lengths)
    ([1], [0]),
    ([5, 1, 1, 1], [3, 17, 0, 40]),
    ([1] * 9, [0, 1, 15, 16, 17, 31, 32, 33, 64]),
    ([16, 7], [0, 21]),
    ([33, 2, 1, 1], [5, 0, 9, 70]),
]


@pytest.mark.parametrize("q_lens,ctx", CASES)
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (8, 2, 32), (8, 1, 64)])
def test_matches_float64_reference(q_lens, ctx, hq, hkv, d):
    rng = np.random.default_rng(len(q_lens) * 100 + hq + d)
    b = random_batch(rng, q_lens, ctx, hq, hkv, d, page_size=16)
    want = ragged_paged_attention_reference(**b)
    got = np.asarray(ragged_paged_attention(**b))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    multi = sum(q > 1 for q in q_lens)
    hinted = np.asarray(ragged_paged_attention(
        **b, max_q_len=max(q_lens), num_multi_query_seqs=max(multi, 1)))
    np.testing.assert_allclose(hinted, want, rtol=1e-5, atol=1e-5)
    assert np.all(got[sum(q_lens):] == 0), "padding rows must come back as zeros"


def test_bf16_within_tolerance():
    rng = np.random.default_rng(7)
    b = random_batch(rng, [12, 1, 1], [4, 30, 2], 8, 2, 32, page_size=8)
    want = ragged_paged_attention_reference(**b)
    bf = {k: (v.astype("bfloat16") if k in ("q", "k_pages", "v_pages") else v) for k, v in b.items()}
    got = np.asarray(ragged_paged_attention(**bf)).astype(np.float32)
    assert np.abs(got - want).max() / np.abs(want).max() < 2e-2


def test_padding_pages_do_not_leak():
    """Garbage in page 0 (the scratch page of padding rows) never reaches a real row."""
    rng = np.random.default_rng(3)
    b = random_batch(rng, [4, 1], [3, 9], 4, 2, 16, page_size=4)
    base = np.asarray(ragged_paged_attention(**b))
    b["k_pages"][0] = 1e4
    b["v_pages"][0] = -1e4
    np.testing.assert_array_equal(np.asarray(ragged_paged_attention(**b)), base)


@pytest.mark.parametrize("q_lens,ctx", [([16, 7, 1, 1], [0, 3, 90, 200]),
                                        ([33, 1, 1], [0, 150, 17]),
                                        ([5, 2, 1], [11, 0, 60])])
def test_chunk_group_at_its_own_pages(q_lens, ctx):
    """`chunk_pages` (the chunk group's own page bucket) reads only the first columns of the
    page table for the chunk sequences: the same result as reading every column, beside
    decodes whose contexts need many more pages."""
    rng = np.random.default_rng(sum(ctx))
    b = random_batch(rng, q_lens, ctx, 8, 2, 32, page_size=16)
    multi = sum(q > 1 for q in q_lens)
    own = max(-(-(c + q) // 16) for q, c in zip(q_lens[:multi], ctx[:multi]))
    assert own < b["page_indices"].shape[1], "the decodes' pages must reach past the chunks'"
    hints = dict(max_q_len=max(q_lens), num_multi_query_seqs=multi)
    got = np.asarray(ragged_paged_attention(**b, **hints, chunk_pages=own))
    np.testing.assert_allclose(got, ragged_paged_attention_reference(**b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, np.asarray(ragged_paged_attention(**b, **hints)),
                               rtol=1e-6, atol=1e-6)


DECODE_CASES = [  # (q_lens, cached context lengths): decodes across block edges, beside chunks
    ([1] * 9, [0, 1, 15, 16, 17, 31, 32, 33, 64]),
    ([16, 1, 1, 1], [0, 130, 47, 255]),
    ([1, 1], [0, 0]),
]


@pytest.mark.parametrize("q_lens,ctx", DECODE_CASES)
@pytest.mark.parametrize("block_pages", [1, 3, 8])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (12, 4, 64)])
def test_decode_blocks_match_reference(q_lens, ctx, block_pages, hq, hkv, d):
    """The decode group read `block_pages` pages at a time (the CPU runner's path) equals the
    float64 reference and the one-gather path, with the page table wider than any sequence
    (a page bucket: columns past the longest sequence hold page 0)."""
    rng = np.random.default_rng(block_pages * 10 + len(q_lens) + d)
    b = random_batch(rng, q_lens, ctx, hq, hkv, d, page_size=16)
    b["page_indices"] = np.pad(b["page_indices"], ((0, 0), (0, 5)))
    hints = dict(max_q_len=max(q_lens), num_multi_query_seqs=sum(q > 1 for q in q_lens))
    got = np.asarray(ragged_paged_attention(**b, **hints, decode_block_pages=block_pages))
    np.testing.assert_allclose(got, ragged_paged_attention_reference(**b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, np.asarray(ragged_paged_attention(**b, **hints)),
                               rtol=1e-5, atol=1e-5)
    assert np.all(got[sum(q_lens):] == 0), "padding rows must come back as zeros"


def test_decode_blocks_ignore_stale_slots():
    """NaN left in a page's slots past a sequence's kv_len (a failed request's page, reused)
    does not reach the output of the blocked decode path."""
    rng = np.random.default_rng(5)
    b = random_batch(rng, [1, 1], [20, 40], 8, 2, 32, page_size=16)
    decode = dict(max_q_len=1, num_multi_query_seqs=0, decode_block_pages=2)
    want = np.asarray(ragged_paged_attention(**b, **decode))
    for s, n in enumerate(b["kv_lens"][:2]):
        last = b["page_indices"][s, (n - 1) // 16]
        b["k_pages"][last, n % 16:] = np.nan
        b["v_pages"][last, n % 16:] = np.nan
    got = np.asarray(ragged_paged_attention(**b, **decode))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)


def test_decode_blocks_bf16_within_tolerance():
    rng = np.random.default_rng(8)
    b = random_batch(rng, [1, 1, 1], [70, 3, 200], 8, 2, 32, page_size=16)
    want = ragged_paged_attention_reference(**b)
    bf = dict(b, **{k: b[k].astype("bfloat16") for k in ("q", "k_pages", "v_pages")})
    got = np.asarray(ragged_paged_attention(**bf, max_q_len=1, num_multi_query_seqs=0,
                                            decode_block_pages=4)).astype(np.float32)
    assert np.abs(got - want).max() / np.abs(want).max() < 2e-2


def test_decode_blocks_only_where_the_loop_pays():
    """The runner loops over decode blocks on a CPU, in variants whose decode rows' page bucket
    spans more than one block and holds enough keys; a GPU's XLA path keeps one gather (a
    data-dependent loop's test would wait for the device); Pallas has its own kernel."""
    from hetero_jax.runner.decoder import DECODE_BLOCK_MIN_KEYS, DECODE_BLOCK_TOKENS, \
        decode_block_pages

    block = DECODE_BLOCK_TOKENS // 16
    rows = -(-DECODE_BLOCK_MIN_KEYS // (32 * 16))  # rows at a 32-page bucket
    key = lambda s, sc, pages: (64, s, sc, pages, 0)  # noqa: E731  (T, S, Sc, pages, second)
    assert decode_block_pages("xla", "cpu", 16, key(rows, 0, 32)) == block
    assert decode_block_pages("xla", "cpu", 16, key(rows + 2, 2, 32)) == block  # beside chunks
    assert decode_block_pages("xla", "cpu", 16, key(rows - 1, 0, 32)) is None  # too few keys
    assert decode_block_pages("xla", "cpu", 16, key(64, 0, block)) is None  # one block
    assert decode_block_pages("xla", "gpu", 16, key(64, 0, 32)) is None
    assert decode_block_pages("pallas", "cpu", 16, key(64, 0, 32)) is None
