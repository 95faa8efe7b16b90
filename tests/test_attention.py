"""ragged_paged_attention (XLA) against a float64 numpy loop, on random ragged batches."""
import numpy as np
import pytest

from hetero_jax.ops import ragged_paged_attention, ragged_paged_attention_reference


def random_batch(rng, q_lens, ctx_extra, hq, hkv, d, page_size, pad_tokens=3, pad_seqs=2):
    """Sequences with q_lens new tokens after ctx_extra cached ones, on shuffled pages."""
    kv_lens = [q + c for q, c in zip(q_lens, ctx_extra)]
    pps = max(-(-n // page_size) for n in kv_lens)
    num_pages = 1 + sum(-(-n // page_size) for n in kv_lens)
    perm = rng.permutation(np.arange(1, num_pages))
    page_indices = np.zeros((len(q_lens) + pad_seqs, pps), np.int32)
    used = 0
    for s, n in enumerate(kv_lens):
        k = -(-n // page_size)
        page_indices[s, :k] = perm[used:used + k]
        used += k
    t = sum(q_lens) + pad_tokens
    cu = np.concatenate([[0], np.cumsum(q_lens), np.full(pad_seqs, sum(q_lens))]).astype(np.int32)
    return dict(
        q=rng.standard_normal((t, hq, d)).astype(np.float32),
        k_pages=rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32),
        v_pages=rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32),
        kv_lens=np.array(kv_lens + [0] * pad_seqs, np.int32), page_indices=page_indices,
        cu_q_lens=cu, num_seqs=np.int32(len(q_lens)))


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
