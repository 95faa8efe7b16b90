"""Cascade (shared-prefix) attention equals the plain path: XLA and Pallas interpret mode,
ragged groups, chunks beside the decode group; and the host planner's tiles by hand."""
import os

import jax
import numpy as np
import pytest

from hetero_jax.ops import ragged_paged_attention, ragged_paged_attention_reference
from hetero_jax.ops.cascade import cascade_arrays, tile_list_arrays
from hetero_jax.ops.pallas_attention import default_block_q
from hetero_jax.sched import DECODE, EMBED, PREFILL, ScheduledItem
from hetero_jax.sched.request import GenKnobs
from hetero_jax.sched.tiles import (CascadeSettings, in_step, kernel_block_rows, plan_tiles,
                                    saved_pages)
from tests.batches import shared_prefix_batch
from tests.script_loader import load_script

PS = 8
CASES = {  # name: (groups [(shared pages, [kv_len of each member])], chunks [(q_len, cached)])
    "one group": ([(4, [33, 40, 57, 70])], []),
    "ragged groups": ([(3, [30, 25, 40]), (1, [9, 12]), (5, [41, 44, 60, 45, 50])], []),
    "with chunks": ([(2, [17, 30, 19]), (6, [49, 80])], [(5, 3), (12, 0)]),
    "unshared too": ([(0, [5, 20, 33]), (4, [40, 41, 42])], [(7, 9)]),
}


def plan_case(rng, groups, chunks, hq, hkv, d, num_tiles=3, rows=2):
    b, tables, lens = shared_prefix_batch(rng, groups, hq, hkv, d, PS, chunks)
    plan = plan_tiles(tables, lens, PS, num_tiles, rows, min_saved_pages=1)
    shared = max(n for _, n in plan[0]) + 1  # one spare page: padding must not matter
    rest = max(-(-n // PS) - o for n, o in zip(lens, plan[1])) + 1
    meta = cascade_arrays(tables, lens, PS, plan, num_tiles, rows, shared, rest,
                          b["kv_lens"].shape[0] - len(chunks))
    hints = dict(num_multi_query_seqs=len(chunks))
    return b, meta, hints


@pytest.mark.parametrize("name,hq,hkv,d", [("one group", 4, 4, 16), ("ragged groups", 8, 2, 32),
                                           ("with chunks", 12, 4, 64), ("unshared too", 8, 1, 32)])
def test_xla_cascade_equals_plain_and_reference(name, hq, hkv, d):
    rng = np.random.default_rng(hq + d + len(name))
    b, meta, hints = plan_case(rng, *CASES[name], hq, hkv, d)
    want = ragged_paged_attention_reference(**b)
    with jax.default_matmul_precision("highest"):  # no TF32 on a GPU (5e-4 off there)
        plain = np.asarray(ragged_paged_attention(**b, max_q_len=16, **hints))
        got = np.asarray(ragged_paged_attention(**b, max_q_len=16, **hints, cascade=meta))
    np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.all(got[int(b["cu_q_lens"][-1]):] == 0), "padding rows must come back as zeros"


PALLAS_CASES = dict(CASES, **{  # tiles past one block of members, and none at all
    "long tile": ([(3, [30 + i for i in range(20)]), (2, [20, 22])], [(9, 4)]),
    "nothing shared": ([(0, [5, 20, 33])], [(7, 9), (3, 0)]),
})


def tile_list_case(rng, groups, chunks, hq, hkv, d):
    """A batch and its plan as the Pallas kernel takes it: tiles of any size (planned, at most
    S // 2 of them), indices over the step's sequences, chunks first."""
    b, tables, lens = shared_prefix_batch(rng, groups, hq, hkv, d, PS, chunks)
    s = b["kv_lens"].shape[0]
    plan = in_step(plan_tiles(tables, lens, PS, s // 2, s, min_saved_pages=1), len(chunks))
    return b, tile_list_arrays(plan, s, PS), plan


@pytest.mark.parametrize("name,hq,hkv,d", [
    ("ragged groups", 8, 2, 32), ("with chunks", 8, 2, 32), ("unshared too", 12, 4, 48),
    ("long tile", 8, 2, 16), ("nothing shared", 4, 4, 32)])
def test_pallas_tile_list_equals_plain_and_reference(name, hq, hkv, d):
    """The kernel's tiles as data (mixed steps too, any tile size, 20 members spanning two
    blocks of 16) equal the plain kernel and the float64 reference at 1e-5, decode-only
    (split KV) and mixed; a step with no tiles runs its empty tile launch and is plain."""
    rng = np.random.default_rng(hq + d + len(name))
    b, tiles, plan = tile_list_case(rng, *PALLAS_CASES[name], hq, hkv, d)
    assert (plan is None) == (name == "nothing shared"), plan
    assert name != "long tile" or max(len(m) for m, _ in plan[0]) == 20
    interpret = os.environ.get("HETERO_JAX_PALLAS_INTERPRET", "1") != "0"  # gpu_check.sh: 0
    hints = dict(num_multi_query_seqs=len(PALLAS_CASES[name][1]))
    with jax.default_matmul_precision("highest"):  # no TF32 on a GPU
        plain = np.asarray(ragged_paged_attention(**b, impl="pallas", interpret=interpret,
                                                  **hints))
        got = np.asarray(ragged_paged_attention(**b, impl="pallas", interpret=interpret,
                                                **hints, cascade=tiles))
    np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, ragged_paged_attention_reference(**b), rtol=1e-5, atol=1e-5)
    assert np.all(got[int(b["cu_q_lens"][-1]):] == 0)


def test_plan_tiles_by_hand():
    """Sequences 0, 2, 3 share pages [9, 4]; 1 and 4 share [7]; 5 shares nothing."""
    tables = [[9, 4, 11], [7, 12], [9, 4, 13, 14], [9, 4, 15], [7, 16], [8, 17]]
    lens = [3 * PS, 2 * PS, 4 * PS, 3 * PS - 1, 2 * PS, 2 * PS]
    tiles, offsets = plan_tiles(tables, lens, PS, num_tiles=4, rows=8, min_saved_pages=1)
    assert tiles == [([0, 3, 2], 2), ([1, 4], 1)]
    assert offsets == [2, 1, 2, 2, 1, 0]
    # rows=2 cuts the first group into [0, 3] and [2] (alone: no tile); num_tiles=1 keeps the
    # tile that saves most reads
    assert plan_tiles(tables, lens, PS, 1, 2, 1)[0] == [([0, 3], 2)]
    assert plan_tiles(tables, lens, PS, 4, 8, min_saved_pages=6) is None  # saves 2*2 + 1 = 5


def test_the_planner_splits_a_run_where_that_saves_most():
    """8 sequences share a system page; two documents of 5 pages are each shared by 4: two
    tiles of 6 pages save 2 x 3 x 6 page reads, where one tile of the system page would save 7
    (and 8-row runs, the XLA engine's, are the old cut: whole). Where the documents differ
    late, one tile of all 8 saves more and is kept."""
    system, docs = [1], [list(range(10, 15)), list(range(20, 25))]
    tables = [system + docs[i // 4] + [100 + i] for i in range(8)]
    lens = [len(t) * PS for t in tables]
    tiles, offsets = plan_tiles(tables, lens, PS, 4, 8, min_saved_pages=1)
    assert sorted((sorted(m), n) for m, n in tiles) == [([0, 1, 2, 3], 6), ([4, 5, 6, 7], 6)]
    assert offsets == [6] * 8 and saved_pages(tiles) == 36
    late = [list(range(10, 20)) + [30 + i // 2, 100 + i] for i in range(8)]
    tiles, _ = plan_tiles(late, [len(t) * PS for t in late], PS, 4, 8, min_saved_pages=1)
    assert [(sorted(m), n) for m, n in tiles] == [(list(range(8)), 10)]  # 70 > 4 x 11


def test_split_run_equals_the_best_partition_by_brute_force():
    """On random runs of up to 8 page lists, the split saves exactly what the best of all
    contiguous partitions saves, and each tile shares its members' least common prefix."""
    from hetero_jax.sched.tiles import _split_run
    assert _split_run([3, 3, 3]) == (9, [(0, 3, 3)])  # one shared prefix: one tile
    assert _split_run([]) == (0, [])  # one list: no tile
    assert _split_run([2, 3, 5]) == (7, [(0, 1, 2), (2, 3, 5)])  # not cut at the least lcp
    rng = np.random.default_rng(5)
    for _ in range(300):
        n = int(rng.integers(2, 9))
        lcp = rng.integers(1, 6, n - 1).tolist()

        def best(lo, hi):  # positions lo..hi inclusive
            whole = (hi - lo) * min(lcp[lo:hi]) if hi > lo else 0
            return max([whole] + [best(lo, k) + best(k + 1, hi) for k in range(lo, hi)])

        saved, tiles = _split_run(lcp)
        assert saved == sum((hi - lo) * m for lo, hi, m in tiles) == best(0, n - 1), lcp
        assert all(m == min(lcp[lo:hi]) for lo, hi, m in tiles), (lcp, tiles)


def test_a_mixed_steps_plan_indexes_the_steps_sequences():
    """With `mixed` (the Pallas engine) the decodes after two chunks are planned, their tiles
    and offsets over the step's indices (chunks skip nothing); without it, or with a
    penalized decode, the step runs plain."""
    shared = (9, 4)
    items = [ScheduledItem(7, EMBED, 0, 5, False, pages=(30,)),
             ScheduledItem(8, PREFILL, 8, 8, False, pages=(31, 32)),
             ScheduledItem(1, DECODE, 3 * PS, 1, True, pages=shared + (11, 12)),
             ScheduledItem(2, DECODE, 2 * PS + 3, 1, True, pages=shared + (13,))]
    mixed = CascadeSettings(8, 1, 8, planned=True, mixed=True)
    assert mixed.plan(items, PS) == ([([3, 2], 2)], [0, 0, 2, 2])  # sorted by page table
    assert CascadeSettings(8, 1, 8).plan(items, PS) is None
    assert CascadeSettings(8, 1, 8).plan(items[2:], PS) == ([([1, 0], 2)], [2, 2])
    knobs = GenKnobs(0.0, 0, 1.0, 0, None, repetition=1.2)
    penalized = items[:3] + [items[3]._replace(knobs=knobs)]
    assert mixed.plan(penalized, PS) is None


def test_a_tile_saves_its_reads_less_one_per_block_of_members():
    """A tile of 20 on 3 shared pages saves 19 x 3 page reads read once, 18 x 3 when each
    Pallas program serves 16 members; the block is the kernel's for the model's heads."""
    tiles = [(list(range(20)), 3), ([20, 21], 5)]
    assert saved_pages(tiles) == 19 * 3 + 5 and saved_pages(tiles, 16) == 18 * 3 + 5
    for hq, hkv in ((32, 8), (14, 2), (12, 4), (8, 8), (64, 1)):
        assert kernel_block_rows(hq, hkv) == default_block_q(hq, hkv, decode_only=False)


def test_a_sequence_keeps_its_last_page():
    """A decode token's own page is never shared, even when the tables agree on it."""
    tiles, offsets = plan_tiles([[3, 5], [3, 5]], [PS + 1, PS + 2], PS, 1, 4, 1)
    assert tiles == [([0, 1], 1)] and offsets == [1, 1]
    assert plan_tiles([[3], [3]], [PS, PS - 2], PS, 1, 4, 1) is None


def test_bench_cascade_measures_both_paths():
    argv = ["--seqs", "4", "--prefix", "32", "--suffix", "3", "--rows", "2,4,8",
            "--heads", "4,2,16", "--iters", "1", "--repeats", "1"]
    with jax.default_matmul_precision("highest"):  # no TF32 on a GPU
        rows = load_script("bench_cascade").main(argv)
    assert [r["variant"] for r in rows] == ["plain", "cascade, 2 rows x 2 tiles",
                                            "cascade, 4 rows x 1 tiles"]
    assert all(r["max_diff"] < 1e-5 for r in rows)
    assert rows[1]["kv_mb"] < rows[0]["kv_mb"], "tiles read the shared pages once"


def test_bench_cascade_times_the_kernels_tiles_empty_and_planned():
    """`--impl pallas`: plain, an empty tile list (every step without sharing) and the
    planner's one tile of 4, read once per 16 members (8 query heads on 2), all equal."""
    argv = ["--seqs", "4", "--prefix", "32", "--suffix", "3", "--heads", "8,2,16", "--impl",
            "pallas", "--page-size", "8", "--iters", "1", "--repeats", "1"]
    with jax.default_matmul_precision("highest"):  # no TF32 on a GPU
        rows = load_script("bench_cascade").main(argv)
    assert [r["variant"] for r in rows] == ["plain", "tiles, none shared",
                                            "tiles of 4, 16 a read"]
    assert all(r["max_diff"] < 1e-5 for r in rows)
    assert rows[2]["kv_mb"] < rows[1]["kv_mb"] == rows[0]["kv_mb"]

