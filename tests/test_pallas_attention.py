"""The Pallas ragged paged attention against the float64 reference and the XLA version.

Runs in Pallas interpret mode on CPU; HETERO_JAX_PALLAS_INTERPRET=0 runs the same cases through
the Triton lowering on a GPU (scripts/gpu_check.sh).
"""
import os

import jax
import numpy as np
import pytest

from hetero_jax.ops import ragged_paged_attention, ragged_paged_attention_reference
from hetero_jax.ops.pallas_attention import ragged_paged_attention_pallas
from tests.batches import random_batch

INTERPRET = os.environ.get("HETERO_JAX_PALLAS_INTERPRET", "1") != "0"
HEADS = [(4, 4, 64), (8, 4, 128), (8, 2, 64), (16, 2, 128)]  # (Hq, Hkv, D): GQA 1, 2, 4, 8


@pytest.fixture(autouse=True)
def ieee_float32():
    """float32 dots as IEEE float32: on a GPU the kernel would otherwise run them as TF32
    (its default), far from the 1e-5 the cases check; on a CPU nothing changes."""
    with jax.default_matmul_precision("highest"):
        yield


def pallas(b):
    return np.asarray(ragged_paged_attention(**b, impl="pallas", interpret=INTERPRET))


def xla(b):
    with jax.default_matmul_precision("float32"):  # no TF32 on GPU
        return np.asarray(ragged_paged_attention(**b))


def ragged_case(rng, kind, num_seqs, hq, hkv, d, page_size=16):
    """A random batch of `kind` decode / chunk / mixed (shuffled), contexts up to ~4 pages."""
    if kind == "decode":
        q_lens = [1] * num_seqs
    elif kind == "chunk":
        q_lens = list(rng.integers(2, 3 * page_size, num_seqs))
    else:
        q_lens = list(rng.permutation([1] * (num_seqs - num_seqs // 3)
                                      + list(rng.integers(2, 2 * page_size, num_seqs // 3))))
    ctx = list(rng.integers(0, 4 * page_size, num_seqs))
    return random_batch(rng, q_lens, ctx, hq, hkv, d, page_size, pad_tokens=5)


def assert_matches(b, got, rtol=1e-5, atol=1e-5):
    n = int(b["cu_q_lens"][b["num_seqs"]])
    np.testing.assert_allclose(got, ragged_paged_attention_reference(**b), rtol=rtol, atol=atol)
    assert np.all(got[n:] == 0), "padding rows must come back as zeros"


@pytest.mark.parametrize("kind,num_seqs", [("decode", 64), ("chunk", 3), ("mixed", 12)])
@pytest.mark.parametrize("hq,hkv,d", HEADS)
def test_matches_reference_and_xla(kind, num_seqs, hq, hkv, d):
    rng = np.random.default_rng(num_seqs * 1000 + hq * 10 + hkv + d)
    b = ragged_case(rng, kind, num_seqs, hq, hkv, d)
    got = pallas(b)
    assert_matches(b, got)
    np.testing.assert_allclose(got, xla(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_lens,ctx", [([1], [0]), ([37], [0]), ([1], [100]), ([20], [13])])
def test_single_sequence(q_lens, ctx):
    b = random_batch(np.random.default_rng(sum(q_lens) + ctx[0]), q_lens, ctx, 8, 2, 64,
                     page_size=16, pad_seqs=0)
    assert_matches(b, pallas(b))


@pytest.mark.parametrize("hq,hkv,d", [(8, 1, 128), (6, 2, 64)])  # GQA 8; 3 heads padded to 4
def test_bf16_within_tolerance(hq, hkv, d):
    b = ragged_case(np.random.default_rng(hq + d), "mixed", 9, hq, hkv, d)
    want = ragged_paged_attention_reference(**b)
    bf = {k: (v.astype("bfloat16") if k in ("q", "k_pages", "v_pages") else v)
          for k, v in b.items()}
    got = pallas(bf).astype(np.float32)
    assert np.abs(got - want).max() / np.abs(want).max() < 2e-2
    assert np.all(got[int(b["cu_q_lens"][b["num_seqs"]]):] == 0)


@pytest.mark.parametrize("block_q,pages_per_block", [(1, 1), (3, 2), (16, 8)])
def test_block_sizes_agree(block_q, pages_per_block):
    """Every tiling gives the same answer (odd sizes only run in interpret mode)."""
    if not INTERPRET and not all(n >= 16 and n & (n - 1) == 0 for n in (block_q * 2,
                                                                        pages_per_block * 8)):
        pytest.skip("Triton tiles need powers of two >= 16")
    b = ragged_case(np.random.default_rng(5), "mixed", 7, 8, 4, 64, page_size=8)
    got = np.asarray(ragged_paged_attention_pallas(
        **b, block_q=block_q, pages_per_block=pages_per_block, interpret=INTERPRET))
    assert_matches(b, got)


def test_constant_keys_give_causal_mean_of_values():
    """Hand-computed: with all keys equal, query i of a fresh chunk averages values 0..i."""
    rng = np.random.default_rng(11)
    b = random_batch(rng, [20], [0], 4, 2, 64, page_size=8, pad_seqs=0)
    b["k_pages"][:] = 0.5
    v = b["v_pages"][b["page_indices"][0]].reshape(-1, 2, 64)[:20]  # [20, Hkv, D]
    want = np.repeat(np.cumsum(v, 0) / np.arange(1, 21)[:, None, None], 2, axis=1)
    np.testing.assert_allclose(pallas(b)[:20], want, rtol=1e-5, atol=1e-5)


def test_garbage_never_leaks():
    """NaN in padding queries and in page 0 (behind unused page-table slots) never leaks."""
    rng = np.random.default_rng(3)
    b = random_batch(rng, [4, 1, 9], [3, 9, 30], 4, 2, 64, page_size=4, pad_tokens=7)
    base = pallas(b)
    n = int(b["cu_q_lens"][b["num_seqs"]])
    b["q"][n:] = np.nan
    b["k_pages"][0] = np.nan
    b["v_pages"][0] = np.nan
    b["page_indices"][b["num_seqs"]:] = 10_000  # padding sequences: out of range, clamped
    got = pallas(b)
    np.testing.assert_array_equal(got, base)
    assert np.all(got[n:] == 0)


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 48), (6, 2, 80), (8, 8, 96), (4, 1, 112)])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_any_head_size_matches_float64(hq, hkv, d, kind):
    """head_dim off the powers of two: padded inside the kernel, equal to the reference."""
    b = ragged_case(np.random.default_rng(d + hq), kind, 9, hq, hkv, d)
    assert_matches(b, pallas(b))


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
def test_kv_splits_agree(num_splits):
    """Flash-decoding: each item's KV blocks split over programs, merged by log-sum-exp; splits
    that get no block (8 splits of 4-block contexts) add nothing."""
    b = ragged_case(np.random.default_rng(7), "decode", 11, 8, 2, 64, page_size=8)
    got = np.asarray(ragged_paged_attention_pallas(
        **b, num_splits=num_splits, pages_per_block=2, interpret=INTERPRET))
    assert_matches(b, got)


def test_stacked_cache_reads_the_layer_it_is_given():
    """The whole [L, ...] cache with a traced layer index equals that layer's pages alone."""
    rng = np.random.default_rng(9)
    b = ragged_case(rng, "mixed", 7, 8, 2, 64)
    others = [rng.standard_normal(b["k_pages"].shape).astype(np.float32) for _ in range(2)]
    stacked = dict(b, k_pages=np.stack([others[0], b["k_pages"], others[1]]),
                   v_pages=np.stack([others[1], b["v_pages"], others[0]]))
    got = np.asarray(ragged_paged_attention(**stacked, layer=np.int32(1), impl="pallas",
                                            interpret=INTERPRET, num_multi_query_seqs=7))
    assert_matches(b, got)
    np.testing.assert_allclose(np.asarray(ragged_paged_attention(**stacked, layer=1)), got,
                               rtol=1e-5, atol=1e-5)


def test_a_plan_made_once_gives_the_same_answer():
    """The work list computed once per step (`plan_work`) equals the one made per call."""
    from hetero_jax.ops.pallas_attention import default_block_q, plan_work
    b = ragged_case(np.random.default_rng(4), "mixed", 9, 8, 4, 64)
    block_q = default_block_q(8, 4, decode_only=False)
    plan = plan_work(b["kv_lens"], b["page_indices"], b["cu_q_lens"], b["num_seqs"],
                     b["q"].shape[0], 16, block_q=block_q)
    got = np.asarray(ragged_paged_attention_pallas(**b, plan=plan, num_multi_query_seqs=9,
                                                   interpret=INTERPRET))
    np.testing.assert_array_equal(got, pallas(b))
