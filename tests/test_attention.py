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
