"""The simulator charges attention by the KV it reads: cascade tiles read shared pages once
(hand-computed; the simulator and the engine share `sched.tiles.plan_tiles`), a shared-prefix
run reads less with cascade than without and the no-sharing control the same, every batching
policy runs in the simulator, and none of it imports jax."""
import dataclasses
import subprocess
import sys

import pytest

from hetero_jax.sched import BATCHING, DECODE, PREFILL, ScheduledItem, SchedulerConfig
from hetero_jax.sched.batching import FeatherConfig
from hetero_jax.sched.output import SchedulerOutput
from hetero_jax.sim import load_cost_model
from hetero_jax.sched.costmodel import StepShape
from hetero_jax.sched.tiles import CascadeSettings, kv_pages_saved
from hetero_jax.sim.simulate import (SimConfig, page_reuse, served_by_l2, simulate,
                                     without_kv_reads)
from hetero_jax.sim.workload import LengthDist, WorkloadConfig


def decode(rid, pages, kv_len, kind=DECODE):
    return ScheduledItem(rid, kind, kv_len - 1, 1, True, (1,), tuple(pages))


def test_a_tile_reads_its_shared_pages_once():
    shared = list(range(1, 11))  # 10 shared pages of 16 tokens
    items = [decode(i, shared + [100 + i], 10 * 16 + 5) for i in range(4)]
    cascade = CascadeSettings(rows=8, min_saved_pages=16, max_num_seqs=32)
    assert kv_pages_saved(items, 16, cascade) == 3 * 10  # 4 sequences, read once not 4 times
    shape = StepShape.from_output(SchedulerOutput(items, []), 16, cascade)
    assert shape.context_tokens == 4 * 165 and shape.kv_read_tokens == 4 * 165 - 30 * 16
    assert kv_pages_saved(items, 16, None) == 0
    assert kv_pages_saved(items, 16, dataclasses.replace(cascade, min_saved_pages=31)) == 0
    mixed = items[:3] + [decode(9, [50], 3, kind=PREFILL)]  # not decode-only: plain attention
    assert kv_pages_saved(mixed, 16, cascade) == 0
    assert CascadeSettings(rows=8, max_num_seqs=32).tiles(9) == (2, 8)  # S = 16


def shared_prefix(shared=True, groups=4):
    return WorkloadConfig(name="shared-prefix", groups=groups, prompts_per_group=8,
                          prefix_len=1024, suffix_len=16, gen_output=LengthDist((32,)),
                          embed_frac=0.0, arrival="closed", clients=32, shared=shared)


def run(workload, cascade, batching="fcfs"):
    sched = SchedulerConfig(token_budget=512, chunk_size=256, max_num_seqs=32,
                            max_chunk_seqs=4, num_pages=8192, max_model_len=2048,
                            prefix_caching=True, batching=batching)
    return simulate(SimConfig(sched, workload, cascade=cascade),
                    load_cost_model("roofline:h200", "llama-3-8b"))


def test_cascade_reads_less_kv_where_prompts_share_and_the_same_where_they_do_not():
    on = CascadeSettings(rows=8, min_saved_pages=16, max_num_seqs=32)
    with_c, without = run(shared_prefix(), on), run(shared_prefix(), None)
    assert with_c.cascade_steps > 0 and without.cascade_steps == 0
    assert with_c.kv_read_tokens < 0.5 * without.kv_read_tokens
    assert with_c.makespan_s < without.makespan_s
    control_on, control_off = run(shared_prefix(False), on), run(shared_prefix(False), None)
    assert control_on.cascade_steps == 0
    assert control_on.kv_read_tokens == control_off.kv_read_tokens


def test_no_sharing_of_kv_reads_undercuts_the_same_steps_run_with_no_kv_read():
    """`kv_free_s` is the run's steps at the cost model's price with no KV read: cascade on and
    off take the same steps here, so they share it, and each run's time lies above it."""
    on, off = run(shared_prefix(), CascadeSettings(max_num_seqs=32)), run(shared_prefix(), None)
    assert on.steps == off.steps and on.kv_free_s == pytest.approx(off.kv_free_s, rel=1e-12)
    assert on.kv_free_s < on.busy_s < off.busy_s
    step = StepShape(decode_tokens=4, seqs=4, context_tokens=4 * 2048, attn_pairs=4 * 2048,
                     sampled=4)
    cost = load_cost_model("roofline:h200", "llama-3-8b")
    assert cost.step_time(without_kv_reads(step)) == cost.step_time(
        dataclasses.replace(step, context_tokens=0))


@pytest.mark.parametrize("batching", BATCHING)
def test_every_batching_policy_completes_the_simulated_run(batching):
    r = run(shared_prefix(groups=2), CascadeSettings(max_num_seqs=32), batching)
    assert r.per_type["generate"]["completed"] == 16 and r.mean_decode_batch >= 1
    assert r.batching["batching"] == batching
    if batching == "feather-bandit":
        assert r.batching["rounds"] >= 1 and r.batching["best_mean_reward"] > 0


def test_the_simulator_and_the_batching_policies_import_no_jax():
    code = ("import sys; import hetero_jax.sim.simulate, hetero_jax.sched.tiles, "
            "hetero_jax.sched.batching, hetero_jax.sched.cht; "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_batching_table_puts_every_policy_beside_fcfs(tmp_path, capsys):
    from hetero_jax.sim.batching_table import main

    rows = main(["--groups", "2", "--prompts-per-group", "4", "--prefix-len", "256",
                 "--output-len", "8", "--clients", "8", "--control", "--json",
                 str(tmp_path / "t.json")])
    assert [(r["workload"], r["batching"], r["cascade"]) for r in rows] == [
        (w, b, c) for w in ("2 groups", "no sharing") for c in ("off", "on") for b in BATCHING]
    assert all(r["vs_fcfs"] == 1.0 for r in rows if r["batching"] == "fcfs")
    on = next(r for r in rows if r["workload"] == "2 groups" and r["cascade"] == "on")
    off = next(r for r in rows if r["workload"] == "2 groups" and r["cascade"] == "off")
    assert on["kv_gb"] < off["kv_gb"] and "x fcfs" in capsys.readouterr().out
    assert all(r["vs_plain"] <= r["kv_free_ceiling"] for r in rows)


SMALL_TABLE = ["--groups", "2", "--prompts-per-group", "4", "--prefix-len", "256",
               "--output-len", "8", "--clients", "8", "--cascade", "off"]


def test_the_batching_table_runs_the_planned_and_mixed_cascade_what_ifs():
    """--planned-tiles and --mixed-cascade reach `CascadeSettings` as themselves (they were
    once passed positionally into its sequence buckets, and the table crashed); planned
    tiles and cascade in mixed steps read no more KV than the engine's fixed tiles."""
    from hetero_jax.sim.batching_table import main

    on = SMALL_TABLE[:-1] + ["on"]
    fixed = {r["batching"]: r["kv_gb"] for r in main(on)}
    planned = {r["batching"]: r["kv_gb"] for r in main(on + ["--planned-tiles",
                                                             "--mixed-cascade"])}
    assert set(planned) == set(fixed) == set(BATCHING)
    assert all(planned[b] <= fixed[b] for b in BATCHING), (planned, fixed)


def test_the_arms_table_puts_the_bandit_beside_each_arm_run_alone_and_fcfs(tmp_path):
    import json

    from hetero_jax.sched.bandit import DEFAULT_ARMS
    from hetero_jax.sim.batching_table import main

    rows = main(SMALL_TABLE + ["--arms", "--embed-frac", "0,0.5", "--json",
                               str(tmp_path / "arms.json")])
    assert [(r["workload"], r["mix"], r["cascade"]) for r in rows] == [
        ("2 groups", "gen", "off"), ("2 groups", "50% emb", "off")]
    assert json.loads((tmp_path / "arms.json").read_text())["rows"][0]["arms"] == rows[0]["arms"]
    each = {r["batching"]: r for r in main(SMALL_TABLE + ["--each-arm"])}
    for row in rows:
        arms = row["arms"]
        assert set(arms) == {str(a) for a in DEFAULT_ARMS}
        assert row["arm_rps"] == arms[row["best_arm"]] == max(arms.values())
        assert row["worst_rps"] == min(arms.values())
        assert row["vs_arm"] == pytest.approx(row["bandit_rps"] / row["arm_rps"])
        assert row["vs_fcfs"] == pytest.approx(row["bandit_rps"] / row["fcfs_rps"])
    gen, mixed = rows
    for arm, rps in gen["arms"].items():  # generation only: the same runs as --each-arm's
        assert rps == pytest.approx(each[f"feather[{arm}]"]["gen_rps"])
    assert gen["bandit_rps"] == pytest.approx(each["feather-bandit"]["gen_rps"])
    gen_only = main(SMALL_TABLE + ["--embed-frac", "0.5"])[0]  # fcfs, generations alone
    assert mixed["fcfs_rps"] > gen_only["gen_rps"]  # the arms table counts the embeddings too


@pytest.mark.parametrize("bad", ["1.5", "0,x", "-0.1"])
def test_the_batching_table_refuses_an_embedding_fraction_outside_0_1(bad, capsys):
    from hetero_jax.sim.batching_table import main

    with pytest.raises(SystemExit):
        main(SMALL_TABLE + ["--embed-frac", bad])
    assert "--embed-frac" in capsys.readouterr().err


def _feather_share(homogeneous: bool):
    wl = WorkloadConfig(name="shared-prefix", groups=4, prompts_per_group=8, prefix_len=256,
                        suffix_len=32, gen_output=LengthDist((32,)), embed_frac=0,
                        arrival="closed", clients=32)
    sched = SchedulerConfig(token_budget=2048, chunk_size=512, max_num_seqs=32,
                            max_chunk_seqs=8, num_pages=4096, max_model_len=1024,
                            prefix_caching=True, batching="feather",
                            feather=FeatherConfig(homogeneous=homogeneous))
    return simulate(SimConfig(sched, wl), load_cost_model("roofline:h200", "llama-3-8b"))


def test_feathers_homogeneous_arm_keeps_decode_steps_on_one_prefix_group():
    """4 groups of 8 in one batch of 32: the default feather tops its lead group up to the
    floor, which grew to the batch (every decode step mixes the groups); the homogeneous arm
    runs one group's decodes a step, and every request still finishes."""
    mixed, homog = _feather_share(False), _feather_share(True)
    assert mixed.homogeneous_decode_share < 0.1
    assert homog.homogeneous_decode_share >= 0.8
    assert homog.per_type["generate"]["completed"] == mixed.per_type["generate"]["completed"] == 32
    assert homog.mean_decode_batch < mixed.mean_decode_batch
    with pytest.raises(ValueError, match="homogeneous"):
        FeatherConfig(homogeneous=1)


def test_planned_tiles_cover_every_group():
    """(G, M) = (S // 2, S) when the planner sizes the tiles (a tile has two members or
    more), else S // rows tiles of rows."""
    assert CascadeSettings(8, 16, 256).tiles(200) == (32, 8)
    assert CascadeSettings(8, 16, 256, planned=True).tiles(200) == (128, 256)


def test_mixed_cascade_reads_the_decodes_shared_pages_once_beside_a_prefill():
    """Two decodes on the same 32 cached pages beside a prefill chunk: cascade in decode-only
    steps (the XLA engine's) saves nothing; in mixed steps (the Pallas engine's) it saves 32
    page reads."""
    shared = tuple(range(1, 33))
    items = [ScheduledItem(9, PREFILL, 0, 16, False, pages=(40,)),
             ScheduledItem(1, DECODE, 520, 1, True, pages=shared + (50,)),
             ScheduledItem(2, DECODE, 520, 1, True, pages=shared + (51,))]
    assert kv_pages_saved(items, 16, CascadeSettings(8, 16, 32)) == 0
    assert kv_pages_saved(items, 16, CascadeSettings(8, 16, 32, mixed=True)) == 32
    assert kv_pages_saved(items[1:], 16, CascadeSettings(8, 16, 32)) == 32


def test_planned_tiles_are_read_once_per_block_of_members():
    """20 decodes on 32 shared pages, one planned tile: 19 x 32 reads saved read once, 18 x 32
    when each read serves 16 members (the Pallas kernel's block at 4 query heads a KV head)."""
    shared = tuple(range(1, 33))
    items = [ScheduledItem(i, DECODE, 520, 1, True, pages=shared + (100 + i,)) for i in range(20)]
    once = CascadeSettings(8, 16, 32, planned=True)
    assert kv_pages_saved(items, 16, once) == 19 * 32
    assert kv_pages_saved(items, 16, dataclasses.replace(once, block_rows=16)) == 18 * 32


def test_page_reuse_counts_each_page_past_its_first_read_and_the_pages_read_again():
    """4 decodes on 10 shared pages and one own page each read 44 pages, 14 distinct, 10 of
    them more than once; a page held past a sequence's KV length is not read."""
    items = [decode(i, list(range(1, 11)) + [100 + i], 10 * 16 + 5) for i in range(4)]
    assert page_reuse(items, 16) == (30, 10)
    ahead = [decode(7, list(range(1, 11)) + [200, 201], 10 * 16 + 5)]  # 201: the next page
    assert page_reuse(items + ahead, 16) == (40, 10)
    assert page_reuse(items[:1], 16) == (0, 0)


def test_l2_serves_the_repeated_reads_cascade_left_while_the_shared_pages_fit():
    """Plain attention: 660 context tokens, 480 of them repeated reads of 160 shared tokens.
    With those inside the L2 only the 180 distinct ones come from HBM; with half of them
    inside, half the repeats do. Cascade's saved reads are not served twice: whole tiles
    leave nothing to L2, 2-row tiles leave the repeats across tiles, and L2 then reads what it
    does for plain attention."""
    items = [decode(i, list(range(1, 11)) + [100 + i], 10 * 16 + 5) for i in range(4)]
    out = SchedulerOutput(items, [])
    repeated, reused = (16 * n for n in page_reuse(items, 16))
    plain = StepShape.from_output(out, 16)
    assert served_by_l2(plain, repeated, reused, 160).kv_read_tokens == 180
    assert served_by_l2(plain, repeated, reused, 80).kv_read_tokens == 660 - 240
    assert served_by_l2(plain, repeated, reused, 0).kv_read_tokens == 660
    whole = StepShape.from_output(out, 16, CascadeSettings(8, 16, 32))
    assert served_by_l2(whole, repeated, reused, 160) == whole
    pairs = StepShape.from_output(out, 16, CascadeSettings(2, 16, 32))
    assert 180 < pairs.kv_read_tokens < 660
    assert served_by_l2(pairs, repeated, reused, 160).kv_read_tokens == 180


def test_the_batching_table_credits_l2_on_a_roofline_only(capsys):
    """--l2-share: plain attention over 2 groups' shared 256-token prefixes reads less from
    HBM; refused with a cost model that has no L2, and outside [0, 1]."""
    from hetero_jax.sim.batching_table import main

    off = {r["batching"]: r for r in main(SMALL_TABLE)}
    on = {r["batching"]: r for r in main(SMALL_TABLE + ["--l2-share", "0.5"])}
    assert on["fcfs"]["kv_gb"] < 0.5 * off["fcfs"]["kv_gb"]
    assert on["fcfs"]["gen_rps"] > off["fcfs"]["gen_rps"]
    capsys.readouterr()
    for bad, says in ((["--cost", "calibration/small-cpu.json"], "--l2-share 0.5 needs a roofline"),
                      (["--l2-share", "1.5"], "--l2-share")):
        with pytest.raises(SystemExit):
            main(SMALL_TABLE + ["--l2-share", "0.5"] + bad)
        assert says in capsys.readouterr().err


def test_with_l2_credited_feathers_admission_order_reads_less_kv_than_fcfs():
    """The paper's mechanism in the model: 8 groups of 16 prompts on 256-token prefixes in a
    burst, 32 sequences. Without locality fcfs and feather read the same KV; with an L2 that
    holds two prefixes, fcfs's steps (every group at once) save under a quarter of their
    reads and feather's (a few groups at a time) read under a third of fcfs's KV."""
    wl = WorkloadConfig(name="shared-prefix", groups=8, prompts_per_group=16, prefix_len=256,
                        suffix_len=16, gen_output=LengthDist((32,)), embed_frac=0.0,
                        arrival="burst", clients=32)
    cost = load_cost_model("roofline:h200", "llama-3-8b")

    def kv(batching, l2):
        sched = SchedulerConfig(token_budget=512, chunk_size=256, max_num_seqs=32,
                                max_chunk_seqs=4, num_pages=8192, max_model_len=1024,
                                prefix_caching=True, batching=batching)
        return simulate(SimConfig(sched, wl, l2_kv_tokens=l2), cost).kv_read_tokens

    assert kv("feather", 0) == pytest.approx(kv("fcfs", 0), rel=0.01)
    assert kv("fcfs", 512) > 0.75 * kv("fcfs", 0)
    assert kv("feather", 512) < kv("fcfs", 512) / 3
