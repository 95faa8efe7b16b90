"""The offline bound on mixing's gain (sim/bound.py): hand-computed least work, that no
simulated schedule beats the bound of its kind (no jax), `hetero-jax sim --policy
ibs-cost`, and the budget a cost model asks for (`ridge_budget`)."""
import dataclasses
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero_jax.sched import SchedulerConfig
from hetero_jax.sim.bound import bound_row, bound_table, group_work, main, parse_ratios
from hetero_jax.sim.cli import sim_main
from hetero_jax.sched.costmodel import (FEATURES, LinearCostModel, StepCost, load_cost_model,
                                        ridge_budget)
from hetero_jax.sim.simulate import SimConfig, simulate
from hetero_jax.sim.workload import RequestSpec, ratio_workload, request_specs


def spec(kind, length, outputs):
    return RequestSpec(kind, tuple(range(length)), outputs)


def test_least_work_hand_computed():
    cfg = SchedulerConfig(token_budget=64, chunk_size=64, max_num_seqs=4, max_chunk_seqs=2)
    # an embedding of 130 tokens: chunks of 2, 64, 64 (the short one first) end at 2, 66, 130;
    # a generation of 10 + 3 outputs: one chunk, then decodes at positions 10 and 11
    work = group_work([spec("embed", 130, 0), spec("generate", 10, 3)], cfg)
    assert work.features == dict(tokens=142, embed_tokens=130, prefill_tokens=10,
                                 decode_tokens=2, seqs=6, context_tokens=198 + 10 + 11 + 12,
                                 attn_pairs=130 * 131 // 2 + 55 + 11 + 12, sampled=3)
    # steps >= ceil(142 / 64) = 3 (tokens), ceil(4 chunks / 2) = 2, the longest chain 3
    assert work.min_steps == 3


@st.composite
def cases(draw):
    model = LinearCostModel(
        draw(st.floats(1e-3, 1)), tuple((f, draw(st.floats(0, 1e-2))) for f in FEATURES),
        token_buckets=draw(st.sampled_from([(), (8, 16, 32, 64), (16, 64)])))
    ratio = (draw(st.integers(0, 4)), draw(st.integers(1, 4)))
    workload = ratio_workload(ratio, draw(st.integers(1, 10)), draw(st.integers(1, 40)),
                              draw(st.integers(1, 40)), draw(st.integers(1, 12)),
                              seed=draw(st.integers(0, 3)), arrival="burst")
    cfg = SchedulerConfig(token_budget=64, chunk_size=draw(st.sampled_from([8, 16, 64])),
                          max_num_seqs=draw(st.integers(1, 6)),
                          max_chunk_seqs=draw(st.integers(1, 3)), page_size=8, num_pages=200,
                          max_model_len=64)
    return model, workload, cfg


@settings(max_examples=60, deadline=None)
@given(cases())
def test_no_simulated_schedule_beats_the_bound_of_its_kind(case):
    model, workload, cfg = case
    row = bound_row(model, request_specs(workload), cfg)
    cost_aware = StepCost(model, cfg.page_size)
    for policy, step_cost, bound in (
            ("ibs", None, "mixed_bound_s"), ("ibs", cost_aware, "mixed_bound_s"),
            ("fcfs", None, "mixed_bound_s"), ("homogeneous", None, "homo_bound_s")):
        sched = dataclasses.replace(cfg, policy=policy, step_cost=step_cost)
        result = simulate(SimConfig(sched, workload), model)
        assert result.makespan_s >= row[bound] * (1 - 1e-9), f"{policy}: {result.makespan_s=}"
    assert row["mixed_bound_s"] <= row["homo_bound_s"] * (1 + 1e-9)


def test_the_table_on_the_calibrated_cpu_model(capsys, tmp_path):
    rows = main(["--cost", "calibration/small-cpu.json", "--ratios", "5:5",
                 "--json", str(tmp_path / "bound.json")])
    (row,) = rows
    assert row["ratio"] == "5:5" and row["requests"] == 48
    assert row["homo_bound_rps"] <= row["mixed_bound_rps"]
    assert all(row[p]["rps"] <= row["mixed_bound_rps"] for p in ("ibs", "ibs-cost", "fcfs"))
    assert row["homogeneous"]["rps"] <= row["homo_bound_rps"]
    assert "ibs-cost captured" in capsys.readouterr().out and (tmp_path / "bound.json").exists()


def test_bad_arguments_are_refused():
    for text in ("9:0", "x", "1:2:3"):
        try:
            parse_ratios(text)
        except Exception as e:  # argparse.ArgumentTypeError
            assert "bad ratios" in str(e)
        else:
            raise AssertionError(f"{text!r} accepted")
    assert bound_table(load_cost_model("calibration/small-cpu.json"), ratios=()) == []


def test_sim_cli_runs_the_cost_aware_ibs(capsys):
    results = sim_main(["--policy", "ibs,ibs-cost", "--cost", "calibration/small-cpu.json",
                        "--requests", "12", "--gen-output", "8", "--embed-frac", "0.5"])
    assert set(results) == {"ibs", "ibs-cost"}
    assert all(sum(t["completed"] for t in r.per_type.values()) == 12 for r in results.values())


def test_the_bound_and_the_cost_aware_policy_import_no_jax():
    code = ("import sys; import hetero_jax.sim.bound, hetero_jax.sched.policies; "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ridge_budget_hand_computed():
    """A linear fit: cost(n) / n <= 9/8 x 1 ms when 40 ms / n <= 0.125 ms, n >= 320: 512. A
    7B bf16 roofline: the ridge is about 150 tokens on an A100 (2 x 7e9 FLOPs a token at
    187 TFLOP/s against 14 GB at 1.24 TB/s): 256; the budget never leaves [lo, hi]."""
    linear = LinearCostModel(0.04, (("tokens", 0.001),))
    assert ridge_budget(linear) == 512
    assert ridge_budget(linear, amortized=0.5) == 128  # 40 / n <= 0.5: n >= 80
    assert ridge_budget(load_cost_model("roofline:a100-40gb", "mistral-7b")) == 256
    assert ridge_budget(load_cost_model("calibration/small-cpu.json")) == 256
    assert ridge_budget(LinearCostModel(1.0, (("tokens", 1e-9),)), hi=4096) == 4096


def test_sim_defaults_the_budget_to_the_cost_model_and_runs_the_paper_ibs(capsys):
    results = sim_main(["--policy", "ibs,ibs-paper", "--cost", "calibration/small-cpu.json",
                        "--requests", "12", "--gen-output", "8", "--embed-frac", "0.5"])
    assert "budget 256, chunk 64" in capsys.readouterr().out
    assert all(sum(t["completed"] for t in r.per_type.values()) == 12 for r in results.values())
    with pytest.raises(SystemExit) as e:
        sim_main(["--budget", "32", "--chunk", "64", "--requests", "4"])
    assert e.value.code == 2 and "--chunk 64 exceeds --budget 32" in capsys.readouterr().err
