"""The simulator (no jax): cost models by hand, workloads, the event loop, the prefix cache's
hit rate and what it saves, the CLI, scripts."""
import dataclasses
import json
import random
import subprocess
import sys

import pytest

from hetero_jax.sched import (DECODE, EMBED, GENERATE, POLICIES, PREFILL, ScheduledItem,
                              SchedulerConfig, SchedulerOutput)
from hetero_jax.sim import (HARDWARE, Hardware, LengthDist, LinearCostModel, ModelSpec,
                            RooflineCostModel, SimConfig, Simulation, StepShape, WorkloadConfig,
                            format_table, load_cost_model, percentile, request_specs, simulate)
from hetero_jax.sim.cli import sim_main
from tests.script_loader import ROOT, load_script


def test_step_shape_counts_tokens_context_and_pairs():
    out = SchedulerOutput([ScheduledItem(0, EMBED, 32, 8, ends=True),
                           ScheduledItem(1, PREFILL, 16, 4, ends=True),
                           ScheduledItem(2, DECODE, 9, 1, ends=True)], [])
    s = StepShape.from_output(out)
    assert (s.embed_tokens, s.prefill_tokens, s.decode_tokens, s.tokens) == (8, 4, 1, 13)
    assert (s.seqs, s.context_tokens, s.sampled) == (3, 40 + 20 + 10, 2)
    assert s.attn_pairs == (8 * 32 + 36) + (4 * 16 + 10) + (9 + 1)


def test_roofline_hand_computed():
    m = ModelSpec("toy", num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2,
                  num_kv_heads=1, head_dim=4, vocab_size=10, bytes_per_param=2)
    assert m.layer_params == 2 * (2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16)
    assert m.kv_bytes_per_token == 2 * 2 * 1 * 4 * 2
    hw = Hardware("toy", peak_flops=1e6, bandwidth=1e5, memory_bytes=1e9, mfu=0.5, mbu=0.5,
                  step_overhead_s=0.01)
    cost = RooflineCostModel(m, hw)
    s = StepShape(decode_tokens=1, seqs=1, context_tokens=10, attn_pairs=10, sampled=1)
    flops = 2 * 1152 * 1 + 2 * 8 * 10 + 4 * 2 * 2 * 4 * 10
    byts = (1152 + 80) * 2 + 32 * (10 + 1)
    assert cost.flops(s) == flops and cost.bytes(s) == byts
    assert cost.step_time(s) == pytest.approx(max(flops / 5e5, byts / 5e4) + 0.01)
    assert cost.step_time(StepShape()) == 0.0


def test_roofline_decode_is_memory_bound_and_a_full_prefill_compute_bound_on_a100():
    cost = load_cost_model("roofline:a100-40gb", "mistral-7b")
    decode = StepShape(decode_tokens=32, seqs=32, context_tokens=32 * 512, attn_pairs=32 * 512,
                       sampled=32)
    prefill = StepShape(prefill_tokens=2048, seqs=4, context_tokens=2048,
                        attn_pairs=4 * 512 * 513 // 2, sampled=4)
    hw = HARDWARE["a100-40gb"]
    assert cost.bytes(decode) / (hw.bandwidth * hw.mbu) > cost.flops(decode) / (hw.peak_flops * hw.mfu)
    assert cost.flops(prefill) / (hw.peak_flops * hw.mfu) > cost.bytes(prefill) / (hw.bandwidth * hw.mbu)
    h200 = load_cost_model("roofline:h200", "mistral-7b")
    assert h200.step_time(decode) < cost.step_time(decode) / 2


def test_linear_cost_model_json_round_trip_and_token_buckets(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"type": "linear", "intercept_s": 0.001,
                                "coef_s": {"tokens": 1e-5, "context_tokens": 1e-7},
                                "token_buckets": [16, 32, 64]}))
    cost = load_cost_model(str(path))
    assert isinstance(cost, LinearCostModel)
    s = StepShape(prefill_tokens=20, seqs=1, context_tokens=100)
    assert cost.step_time(s) == pytest.approx(0.001 + 32 * 1e-5 + 100 * 1e-7)
    assert LinearCostModel.from_dict(cost.to_dict()) == cost
    with pytest.raises(ValueError, match="unknown cost features"):
        LinearCostModel.from_dict({"coef_s": {"flops": 1.0}})
    with pytest.raises(ValueError, match="hardware"):
        load_cost_model("roofline:tpu")
    path.write_text(json.dumps({"type": "magic"}))
    with pytest.raises(ValueError, match="magic"):
        load_cost_model(str(path))


def test_length_specs():
    assert LengthDist.parse("128").mean == 128
    assert LengthDist.parse("96,224").mean == 160
    assert LengthDist.parse("96:0.55,224:0.45").mean == pytest.approx(96 * 0.55 + 224 * 0.45)
    d = LengthDist.parse("64-256")
    assert d.mean == 160
    rng = random.Random(0)
    assert all(64 <= d.sample(rng) <= 256 for _ in range(100))
    for bad in ("0", "abc", "10-5", "5:x"):
        with pytest.raises(ValueError, match="length spec"):
            LengthDist.parse(bad)


def test_workload_mix_and_order():
    wl = WorkloadConfig(num_requests=10, embed_frac=0.3, order="gen-first")
    specs = request_specs(wl)
    assert [s.kind for s in specs] == [GENERATE] * 7 + [EMBED] * 3
    assert all(s.max_tokens == 0 for s in specs if s.kind == EMBED)
    assert request_specs(wl) == specs, "seeded"


def test_requests_share_tokens_only_where_the_workload_shares_them():
    """Mixed: every request its own token ids. Shared-prefix, 3 groups x 4 at embed_frac 0.5:
    2 embeddings and 2 generations per group, each 10 prefix tokens of its group's and 3 of
    its own; the control issues the same kinds and lengths in the same order, nothing shared."""
    mixed = request_specs(WorkloadConfig(num_requests=50, vocab_size=256))
    assert [s.input_len for s in mixed] == [len(s.token_ids) for s in mixed]
    assert len({s.token_ids[:16] for s in mixed}) == 50, "no first page in common"
    assert all(0 <= t < 256 for s in mixed for t in s.token_ids)
    wl = WorkloadConfig(name="shared-prefix", groups=3, prompts_per_group=4, prefix_len=10,
                        suffix_len=3, embed_frac=0.5, gen_output=LengthDist((5,)))
    specs = request_specs(wl)
    assert (wl.size, wl.num_embed, len(specs)) == (12, 6, 12)
    groups = {}
    for s in specs:
        assert s.input_len == 13 and s.max_tokens == (0 if s.kind == EMBED else 5)
        groups.setdefault(s.token_ids[:10], []).append(s.kind)
    assert sorted(sorted(kinds) for kinds in groups.values()) == [[EMBED] * 2 + [GENERATE] * 2] * 3
    assert len({s.token_ids[10:] for s in specs}) == 12, "every suffix its own"
    control = request_specs(dataclasses.replace(wl, shared=False))
    assert [(s.kind, s.input_len, s.max_tokens) for s in control] == \
        [(s.kind, s.input_len, s.max_tokens) for s in specs]
    assert len({s.token_ids[:10] for s in control}) == 12
    gen_first = request_specs(dataclasses.replace(wl, order="gen-first"))
    assert [s.kind for s in gen_first] == [GENERATE] * 6 + [EMBED] * 6
    with pytest.raises(ValueError, match="prefix_len=-1"):
        WorkloadConfig(name="shared-prefix", prefix_len=-1)


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([4, 1, 3, 2], 90) == pytest.approx(3.7)


def test_format_table_aligns_text_left_numbers_right_and_dashes_missing_values():
    rows = [dict(name="ibs", rate=1.234, n=7), dict(name="homogeneous", rate=None)]
    columns = [("name", "name", "{}"), ("rate/s", "rate", "{:.1f}"), ("n", "n", "{}")]
    assert format_table(rows, columns).splitlines() == [
        "name         rate/s  n",
        "----------------------",
        "ibs             1.2  7",
        "homogeneous       -  -"]


def small_sim(policy="ibs", **wl):
    sched = SchedulerConfig(policy=policy, token_budget=128, chunk_size=32, max_num_seqs=32,
                            max_chunk_seqs=4, num_pages=4096, max_model_len=1024)
    workload = WorkloadConfig(**{"num_requests": 60, "gen_output": LengthDist((32,)),
                                 "rate": 50.0, **wl})
    return sched, workload


@pytest.mark.parametrize("policy", ["ibs", "fcfs", "homogeneous"])
def test_simulation_completes_every_request_and_accounts_tokens(policy):
    sched, workload = small_sim(policy)
    cost = load_cost_model("roofline:h200")
    r = simulate(SimConfig(sched, workload), cost)
    g, e = r.per_type[GENERATE], r.per_type[EMBED]
    assert g["completed"] + e["completed"] == 60 and e["completed"] == 12
    assert 0 < r.avg_budget_fill <= 1 and 0 < r.embed_token_share < 1
    assert r.busy_s <= r.makespan_s + 1e-12
    assert g["ttft_p50_s"] <= g["latency_p50_s"] and g["latency_p50_s"] <= g["latency_p99_s"]
    assert e["ttft_p99_s"] == e["latency_p99_s"], "an embedding's first result is its vector"
    assert simulate(SimConfig(sched, workload), cost).to_dict() == r.to_dict(), "deterministic"


def test_closed_loop_and_replicas():
    sched, workload = small_sim(arrival="closed", clients=4)
    cost = load_cost_model("roofline:a100-40gb")
    one = simulate(SimConfig(sched, workload, replicas=1), cost)
    assert one.per_type[GENERATE]["completed"] + one.per_type[EMBED]["completed"] == 60
    sched, burst = small_sim(arrival="burst")
    r1 = simulate(SimConfig(sched, burst, replicas=1), UnitSteps())
    r2 = simulate(SimConfig(sched, burst, replicas=2), UnitSteps())
    # every step costs 1 simulated second, so a makespan is the busiest replica's step
    # count: the check counts steps, it reads no clock
    busiest_one, busiest_two = round(r1.makespan_s), round(r2.makespan_s)
    assert (busiest_one, busiest_two) == (r1.makespan_s, r2.makespan_s)
    assert busiest_one == r1.steps and busiest_two < r2.steps
    assert 10 * busiest_two < 7 * busiest_one, "two replicas share a burst"


class UnitSteps:
    """A cost model whose every step costs 1 s: simulated time is a step count."""

    def step_time(self, shape) -> float:
        return 1.0


def test_dedicated_split_routes_each_type_to_its_own_replicas():
    sched, workload = small_sim("fcfs", arrival="closed", clients=8)
    sim = Simulation(SimConfig(sched, workload, replicas=3, embed_replicas=1),
                     load_cost_model("roofline:h200"))
    seen = [set() for _ in sim.replicas]
    for replica, kinds in zip(sim.replicas, seen):
        schedule = replica.sched.schedule
        replica.sched.schedule = lambda schedule=schedule, kinds=kinds: _record(schedule(), kinds)
    r = sim.run()
    assert r.per_type[GENERATE]["completed"] + r.per_type[EMBED]["completed"] == 60
    assert seen == [{EMBED}, {PREFILL, DECODE}, {PREFILL, DECODE}]
    with pytest.raises(AssertionError, match="at least one"):
        Simulation(SimConfig(sched, workload, replicas=2, embed_replicas=2), None)


def _record(out, kinds: set):
    kinds.update(it.kind for it in out.items)
    return out


def test_head_of_line_burst_ibs_serves_embeddings_before_fcfs():
    """Generation first, then embeddings, all at time 0: FCFS makes embeddings wait; IBS as
    published interleaves them (the default first starts decode chains: 30 generations fill
    half the slots, so it is near fcfs here; the bench_hol test checks what it keeps)."""
    cost = load_cost_model("roofline:h200")
    p50 = {}
    for policy in ("ibs", "fcfs"):
        sched, wl = small_sim(policy, arrival="burst", order="gen-first", embed_frac=0.5)
        sched = dataclasses.replace(sched, thin_batch=0.0)
        p50[policy] = simulate(SimConfig(sched, wl), cost).per_type[EMBED]["latency_p50_s"]
    assert p50["ibs"] < 0.8 * p50["fcfs"]


def test_sim_cli_prints_and_writes_json(tmp_path, capsys):
    path = tmp_path / "sim.json"
    results = sim_main(["--policy", "all", "--requests", "40", "--gen-output", "16",
                        "--arrival", "burst", "--json", str(path)])
    assert set(results) == {"ibs", "fcfs", "homogeneous"}
    printed = capsys.readouterr().out
    assert "fill" in printed and "homogeneous" in printed
    data = json.loads(path.read_text())
    assert set(data["results"]) == set(results) and data["config"]["requests"] == 40
    assert {"avg_budget_fill", "embed_token_share", "per_type"} <= set(data["results"]["ibs"])
    with pytest.raises(SystemExit) as e:
        sim_main(["--policy", "dedicated"])
    assert e.value.code == 2 and "dedicated needs --replicas >= 2" in capsys.readouterr().err
    two = sim_main(["--policy", "all", "--replicas", "2", "--requests", "40", "--gen-output",
                    "16", "--arrival", "burst"])
    assert set(two) == {"ibs", "fcfs", "homogeneous", "dedicated"}
    assert two["dedicated"].per_type[EMBED]["completed"] == 8
    with pytest.raises(SystemExit):
        sim_main(["--gen-prompt", "x"])


def shared_prefix_sim(caching: bool, shared: bool = True) -> tuple:
    """4 groups x 8 requests (4 embeddings, 4 generations of 8 tokens each), 120 shared + 16
    own tokens, pages of 16, 8 closed-loop clients; the cost model records every step."""
    sched, _ = small_sim()
    workload = WorkloadConfig(name="shared-prefix", groups=4, prompts_per_group=8,
                              prefix_len=120, suffix_len=16, embed_frac=0.5,
                              gen_output=LengthDist((8,)), arrival="closed", clients=8,
                              shared=shared)
    cost = Recording(load_cost_model("roofline:h200"))
    cfg = SimConfig(dataclasses.replace(sched, prefix_caching=caching), workload)
    return simulate(cfg, cost), cost


class Recording:
    """A cost model that keeps the `StepShape` of every step it is asked about."""

    def __init__(self, inner):
        self.inner, self.shapes = inner, []

    def step_time(self, shape: StepShape) -> float:
        self.shapes.append(shape)
        return self.inner.step_time(shape)


def test_shared_prefix_sim_hits_the_hand_computed_fraction_and_serves_faster():
    """Per request 136 tokens: a lookup covers (136 - 1) // 16 = 8 pages (128 tokens); the 7
    full pages of the 120-token prefix are computed once per group and hit by its 7 other
    requests (the scheduler holds them back while the first computes them; 4096 pages: no
    eviction). Hit rate = 4 * 7 * 7 pages / (32 * 8 pages) = 196 / 256."""
    on, _ = shared_prefix_sim(True)
    off, _ = shared_prefix_sim(False)
    assert on.preemptions == off.preemptions == 0
    assert (on.cache_query_tokens, on.cache_hit_tokens) == (32 * 8 * 16, 4 * 7 * 7 * 16)
    assert on.cache_hit_rate == 196 / 256
    assert off.cache_hit_rate is None and off.cache_query_tokens == 0
    for kind in (GENERATE, EMBED):
        assert on.per_type[kind]["completed"] == off.per_type[kind]["completed"] == 16
        assert on.per_type[kind]["throughput_rps"] > 1.5 * off.per_type[kind]["throughput_rps"]
    control, _ = shared_prefix_sim(True, shared=False)
    assert control.cache_hit_tokens == 0 and control.cache_query_tokens == 32 * 8 * 16
    unshared_off, _ = shared_prefix_sim(False, shared=False)
    assert unshared_off.to_dict() == off.to_dict(), "caching off: the tokens do not matter"


def test_the_cost_model_is_charged_only_for_uncached_tokens():
    """32 inputs of 136 tokens and 16 generations of 8 tokens (the first sampled by the
    prefill, 7 decode steps each): off, every token is scheduled; on, the hits are not."""
    every = 32 * 136 + 16 * 7
    for caching in (False, True):
        r, cost = shared_prefix_sim(caching)
        # each step is asked twice: as it runs, and with no KV read (`SimResult.kv_free_s`)
        steps = [s for s in cost.shapes if s.kv_read_tokens]
        assert len(steps) == r.steps and len(cost.shapes) == 2 * r.steps
        charged = sum(s.tokens for s in steps)
        assert charged == r.scheduled_tokens == every - r.cache_hit_tokens, caching
    assert every - r.cache_hit_tokens == 4464 - 3136


def test_mixed_requests_never_hit_so_caching_changes_nothing():
    sched, workload = small_sim()
    on, off = (simulate(SimConfig(dataclasses.replace(sched, prefix_caching=caching), workload),
                        load_cost_model("roofline:h200")) for caching in (True, False))
    assert on.cache_hit_tokens == 0 and on.cache_query_tokens > 0
    assert dataclasses.replace(on, cache_query_tokens=0, cache_hit_rate=None) == off


def test_sim_cli_runs_the_cache_on_and_off_side_by_side(tmp_path, capsys):
    path = tmp_path / "sp.json"
    results = sim_main(["--workload", "shared-prefix", "--groups", "4", "--prompts-per-group",
                        "8", "--prefix-len", "120", "--suffix-len", "16", "--gen-output", "8",
                        "--embed-frac", "0.5", "--arrival", "closed", "--clients", "8",
                        "--prefix-caching", "on,off", "--control", "--json", str(path)])
    assert list(results) == ["ibs", "ibs unshared", "ibs/no-cache", "ibs/no-cache unshared"]
    assert results["ibs"].cache_hit_rate == 196 / 256, "as in the hand-computed sim above"
    assert results["ibs unshared"].cache_hit_rate == 0
    printed = capsys.readouterr().out
    assert "8 requests sharing a 120-token prefix" in printed and "hit rate" in printed
    rows = {line.split()[0] + (" u" if "unshared" in line else ""): line
            for line in printed.splitlines() if line.startswith("ibs")}
    assert "76.6%" in rows["ibs"] and "0.0%" in rows["ibs u"] and " - " in rows["ibs/no-cache"]
    data = json.loads(path.read_text())
    assert data["config"]["prefix_caching"] == [True, False]
    assert data["results"]["ibs"]["cache_hit_rate"] == 196 / 256
    assert data["results"]["ibs/no-cache"]["cache_hit_rate"] is None


def test_sim_cli_runs_batching_policies_side_by_side(tmp_path):
    """`--batching` gives a row per policy x batching policy, each with its own scheduler's
    batching (the bandit's stats in the row), on the same trace."""
    path = tmp_path / "b.json"
    results = sim_main(["--workload", "shared-prefix", "--groups", "4", "--prompts-per-group",
                        "8", "--prefix-len", "128", "--suffix-len", "16", "--gen-output", "16",
                        "--embed-frac", "0", "--arrival", "closed", "--clients", "16",
                        "--policy", "ibs,fcfs", "--batching", "fcfs,feather-bandit,fcfs",
                        "--json", str(path)])
    assert list(results) == ["ibs+fcfs", "ibs+feather-bandit", "fcfs+fcfs",
                             "fcfs+feather-bandit"]
    assert results["ibs+fcfs"].batching == {"batching": "fcfs"}
    bandit = results["ibs+feather-bandit"].batching
    assert bandit["batching"] == "feather-bandit" and bandit["rounds"] >= 1, bandit
    for r in results.values():  # every row served the whole trace
        assert r.per_type["generate"]["completed"] == 32
    data = json.loads(path.read_text())
    assert data["config"]["batching"] == ["fcfs", "feather-bandit"]
    assert data["results"]["ibs+feather-bandit"]["batching"] == bandit
    assert list(sim_main(["--requests", "20", "--batching", "lpm"])) == ["ibs"]  # one: no suffix


@pytest.mark.parametrize("flags, message", [
    (["--batching", "fcfs,best"], "argument --batching: unknown batching policy 'best'; "
     "expected a comma-separated subset of fcfs,lpm,feather,feather-bandit"),
    (["--batching", ","], "argument --batching: unknown batching policy ','"),
    (["--prefix-len", "-1"], "argument --prefix-len: -1 is outside [0, "),
    (["--suffix-len", "0"], "argument --suffix-len: 0 is outside [1, "),
    (["--groups", "-2"], "argument --groups: -2 is outside [1, "),
    (["--prompts-per-group", "0"], "argument --prompts-per-group: 0 is outside [1, "),
    (["--prefix-caching", "maybe"], "argument --prefix-caching: bad value 'maybe': 'maybe' is "
     "not on or off"),
    (["--prefix-caching", "on,on"], "bad value 'on,on': 'on' is not on or off, or comes twice"),
    (["--prefix-caching", ""], "bad value '': '' is not on or off"),
    (["--workload", "rag"], "argument --workload: invalid choice: 'rag'"),
    (["--prefix-len", "4000"], "a generation request of up to 4032 + 256 = 4288 tokens does "
     "not fit --max-model-len 4096"),
    (["--groups", "10000", "--prompts-per-group", "10000"], "--groups 10000 x "
     "--prompts-per-group 10000 = 100000000 requests; at most 10000000"),
])
def test_sim_shared_prefix_bad_flags_are_argparse_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        sim_main(["--workload", "shared-prefix", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_sim_control_needs_the_shared_prefix_workload(capsys):
    with pytest.raises(SystemExit) as e:
        sim_main(["--control"])
    assert e.value.code == 2 and "--control needs --workload shared-prefix" in \
        capsys.readouterr().err


def test_packing_sim_chunked_fills_the_budget(tmp_path):
    path = tmp_path / "packing.json"
    packing = load_script("packing_sim")
    packing.main(["--steps", "3000", "--warmup", "500", "--json", str(path)])
    res = json.loads(path.read_text())
    assert set(res) == {"atomic", "chunked"}
    for r in res.values():
        assert {"budget_fill", "gen_throughput", "embed_throughput"} <= set(r)
    assert res["chunked"]["budget_fill"] >= 0.8
    assert res["chunked"]["budget_fill"] >= 1.5 * res["atomic"]["budget_fill"]


def test_packing_sim_gen_throughput_tracks_fill_in_one_queue_and_not_in_split_queues(tmp_path):
    """One FCFS queue: requests finish in the arrival mix, so generation throughput moves with
    fill. Split queues with generation first: it stays put while chunks fill the leftover."""
    packing = load_script("packing_sim")
    shared = packing.main(["--steps", "3000", "--warmup", "500"])
    fill = shared["chunked"]["budget_fill"] / shared["atomic"]["budget_fill"]
    gen = shared["chunked"]["gen_throughput"] / shared["atomic"]["gen_throughput"]
    assert gen == pytest.approx(fill, rel=0.05)
    split = packing.main(["--queues", "split", "--max-seqs", "16", "--steps", "3000",
                          "--warmup", "500"])
    a, c = split["atomic"], split["chunked"]
    assert c["gen_throughput"] == pytest.approx(a["gen_throughput"], rel=0.02)
    assert c["budget_fill"] >= 0.8 and c["budget_fill"] >= a["budget_fill"] + 0.2
    assert c["embed_throughput"] > a["embed_throughput"]
    with pytest.raises(SystemExit):
        packing.main(["--queues", "split"])


# Generations of 128 + 256 tokens at 64-token chunks and 8 decode tokens a step spend ~34 steps
# in the engine, so at 0.2 arrivals/step ~7 are inside: over 2,000 steps (~400 arrivals) the
# finished count and the arrived count of one window differ by at most ~7, under 2%: rel=0.03.
OPEN_LOOP = ["--arrivals", "open", "--gen-rate", "20", "--embed-rate", "10", "--embed-lengths",
             "96,256", "--atomic-wait", "skip", "--steps", "2000", "--warmup", "500"]


@pytest.mark.parametrize("queues", [[], ["--queues", "split", "--max-seqs", "16"]])
def test_packing_sim_open_loop_generation_finishes_at_its_arrival_rate(queues):
    """Atomic embeddings of the whole budget never fit beside the decodes and wait (the end's
    queue holds them), chunked ones run: chunked fill is higher, generation is not moved."""
    res = load_script("packing_sim").main(OPEN_LOOP + queues)
    a, c = res["atomic"], res["chunked"]
    for r in (a, c):
        assert r["gen_arrivals"] == pytest.approx(0.2, rel=0.1)  # 20/s at 10 ms; 2 sd of 400
        assert r["gen_throughput"] == pytest.approx(r["gen_arrivals"], rel=0.03)
    assert c["embed_throughput"] == pytest.approx(c["embed_arrivals"], rel=0.05)
    assert c["embed_waiting"] == 0 and a["embed_waiting"] > 20
    assert c["budget_fill"] >= a["budget_fill"]
    assert c["embed_throughput"] > a["embed_throughput"]


def test_packing_sim_open_loop_reproduces_table_8():
    """The docs' command, fewer steps: the paper's 8.8% -> 85.7% fill, 93.3 generation
    requests/s both, 25.5 -> 26.9 embedding requests/s."""
    res = load_script("packing_sim").main([
        "--arrivals", "open", "--gen-rate", "93.3", "--embed-rate", "26.9", "--step-ms", "550",
        "--process", "fixed", "--budget", "32768", "--chunk", "4096", "--embed-lengths",
        "30,32768", "--embed-long-frac", "0.052", "--prefill", "32", "--decode", "16",
        "--decode-step", "1", "--atomic-wait", "skip", "--steps", "1000", "--warmup", "300"])
    a, c = res["atomic"], res["chunked"]
    per_s = 1000 / 550
    assert a["budget_fill"] == pytest.approx(0.088, abs=0.01)
    # ~1,000 long embeddings arrive in 1,300 steps, Bernoulli(0.052) each: +-3% (1 sd) on
    # the long tokens, which are nearly all of chunked's fill; 2 sd is 0.05 of the 0.857.
    assert c["budget_fill"] == pytest.approx(0.857, abs=0.05)
    for r in (a, c):  # fixed intervals: 51,315 and 14,795 arrivals, +-1 (Poisson: +-226, 122)
        assert r["gen_arrivals"] * per_s == pytest.approx(93.3, rel=1e-3)
        assert r["embed_arrivals"] * per_s == pytest.approx(26.9, rel=1e-3)
        assert r["gen_throughput"] * per_s == pytest.approx(93.3, rel=0.01)
    assert c["embed_throughput"] / a["embed_throughput"] == pytest.approx(26.9 / 25.5, abs=0.02)


def test_packing_sim_open_arrivals_join_the_queue_in_arrival_order():
    """Fixed gaps of 0.25 steps (embeddings) and 0.4 (generation): step 0 gets E.25 G.4 E.5
    E.75 G.8 in that order; step 1, from 1.0 to just before 2.0, E1 G1.2 E1.25 E1.5 G1.6 E1.75."""
    packing = load_script("packing_sim")
    args = packing.parse_args(["--arrivals", "open", "--process", "fixed", "--step-ms", "1000",
                               "--gen-rate", "2.5", "--embed-rate", "4"])
    arrivals, queues = packing.OpenArrivals(args), {"all": []}
    assert arrivals.arrive(0, queues) == {"gen": 2, "embed": 3}
    assert [r.embed for r in queues["all"]] == [True, False, True, True, False]
    assert arrivals.arrive(1, queues) == {"gen": 2, "embed": 4}
    assert [r.embed for r in queues["all"][5:]] == [True, False, True, True, False, True]


@pytest.mark.parametrize("flags, message", [
    (["--gen-rate", "-1"], "--gen-rate must be a finite rate >= 0 requests/s, got -1.0"),
    (["--embed-rate", "nan"], "--embed-rate must be a finite rate >= 0 requests/s, got nan"),
    (["--gen-rate", "0", "--embed-rate", "0"], "--gen-rate 0 and --embed-rate 0: no request"),
    (["--step-ms", "0"], "--step-ms must be a positive number of milliseconds, got 0.0"),
    (["--embed-rate", None], "--arrivals open needs --embed-rate (requests/s)"),
    (["--arrivals", "backlog"], "--gen-rate needs --arrivals open"),
])
def test_packing_sim_bad_rates_are_argparse_errors_naming_the_value(flags, message, capsys):
    argv = ["--arrivals", "open", "--gen-rate", "20", "--embed-rate", "6"]
    for flag, value in zip(flags[::2], flags[1::2]):
        i = argv.index(flag) if flag in argv else len(argv)
        argv[i:i + 2] = [] if value is None else [flag, value]
    with pytest.raises(SystemExit) as e:
        load_script("packing_sim").main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bench_hol_sim_only_meets_the_targets_and_imports_no_jax(tmp_path):
    """32 generation requests (128 + 256 tokens, the bench's shape) then 32 embeddings at t=0.
    FCFS gives every sequence slot to generation, so embeddings wait for whole decodes;
    homogeneous steps leave them half the steps; IBS as published (--thin-batch 0)
    interleaves them from the first step. The default IBS starts 16 decode chains first: its
    embeddings still beat fcfs's at p99, by less (the price of starting decode chains early)."""
    path = tmp_path / "hol.json"
    hol = load_script("bench_hol")
    data = hol.main(["--sim-only", "--thin-batch", "0", "--json", str(path)])
    res, targets = data["results"]["sim"], data["targets"]["sim"]
    assert set(res) == {"ibs", "fcfs", "homogeneous"}
    assert targets["emb_p99_fcfs_over_ibs"] >= 2 and targets["emb_p99_homogeneous_over_ibs"] >= 2
    assert targets["gen_p99_ibs_vs_fcfs"] <= 0.10
    assert json.loads(path.read_text())["targets"]["sim"] == pytest.approx(targets)
    thin = hol.main(["--sim-only"])["targets"]["sim"]
    assert thin["emb_p99_fcfs_over_ibs"] >= 1.3 and thin["gen_p99_ibs_vs_fcfs"] <= 0.10
    code = ("import runpy, sys; sys.argv = ['bench_hol', '--sim-only', '--n', '4']; "
            "runpy.run_path('scripts/bench_hol.py', run_name='__main__'); "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')]")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)


def test_bench_hol_short_outputs_credits_drain_both_queues_together():
    """With 32-token outputs slots free quickly; credits proportional to the work left then
    finish both queues' input at about the same time: IBS halves the median embedding
    latency but its p99 stays near FCFS's, the end of all prefill work."""
    res = load_script("bench_hol").main(["--sim-only", "--max-tokens", "32"])["results"]["sim"]
    ibs, fcfs = res["ibs"], res["fcfs"]
    assert ibs["emb_p50_s"] < 0.6 * fcfs["emb_p50_s"]
    assert fcfs["emb_p99_s"] < 1.6 * ibs["emb_p99_s"]


def test_bench_schedule_runs(tmp_path):
    """Every policy timed over exactly the steps asked, each step within the token budget."""
    path = tmp_path / "schedule.json"
    rows = load_script("bench_schedule").main(["--queued", "50", "--steps", "20", "--warmup",
                                               "5", "--json", str(path)])
    assert [(r["policy"], r["prefix_caching"]) for r in rows] == [
        (p, on) for p in POLICIES for on in ("on", "off")]
    for r in rows:
        assert (r["hit_rate"] > 0) == (r["prefix_caching"] == "on"), r  # 8 shared prefixes
        assert (r["queued"], r["steps"]) == (50, 20), r
        assert 0 < r["scheduled_tokens"] <= 20 * 256, r  # --budget 256
        assert 0 < r["running"] <= 32, r  # --max-num-seqs 32
        assert 0 < r["schedule_p50_us"] <= r["schedule_p99_us"], r
        assert r["schedule_mean_us"] > 0 and r["update_mean_us"] > 0, r
    assert json.loads(path.read_text()) == rows


def test_async_scheduling_lets_a_closed_loop_request_in_a_step_late():
    """A client whose embedding finished submits its next one: it runs in the next step, or
    with `async_scheduling` in the one after (the engine scheduled the next step already),
    while a generation keeps the steps going; with nothing running it starts at once."""
    from hetero_jax.sim.workload import RequestSpec

    sched, _ = small_sim("fcfs")
    gen, emb = RequestSpec(GENERATE, tuple(range(3, 11)), 6), RequestSpec(EMBED, (5,) * 8, 0)
    for late, (second_end, lone_end) in ((False, (2.0, 2.0)), (True, (3.0, 2.0))):
        ends = []
        for specs, clients in (([gen, emb, emb], 2), ([emb, emb], 1)):
            sim = Simulation(SimConfig(sched, WorkloadConfig(arrival="closed", clients=clients),
                                       async_scheduling=late), UnitSteps())
            sim.specs = specs
            sim.run()
            embeds = sorted(r.finish_time for r in sim.done if r.kind == EMBED)
            ends.append(embeds[1])
        assert tuple(ends) == (second_end, lone_end), late
