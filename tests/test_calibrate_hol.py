"""scripts/calibrate.py and scripts/bench_hol.py on the tiny preset (smoke tests, real engine)."""
import json

import numpy as np

from hetero_jax.sched import SchedulerConfig
from hetero_jax.sim import (LinearCostModel, SimConfig, StepShape, WorkloadConfig,
                            load_cost_model, simulate)
from tests.script_loader import load_script


def test_nonnegative_least_squares_hand_cases():
    fit = load_script("calibrate").fit_nonnegative
    x = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    np.testing.assert_allclose(fit(x, 2.0 + 0.5 * x[:, 1]), [2.0, 0.5], atol=1e-12)
    # the unconstrained slope is -1: clamped to 0, the intercept becomes the mean
    np.testing.assert_allclose(fit(x, 3.0 - x[:, 1]), [1.5, 0.0], atol=1e-12)


def test_calibrate_fits_a_cost_model_the_simulator_loads(tmp_path, capsys):
    path = tmp_path / "cost.json"
    data = load_script("calibrate").main(["--fast", "--out", str(path)])
    printed = capsys.readouterr().out
    assert "R^2" in printed and "held_out" in printed
    cost = load_cost_model(str(path))
    assert isinstance(cost, LinearCostModel) and cost.intercept_s >= 0
    assert all(c > 0 for _, c in cost.coef_s) and dict(cost.coef_s).get("tokens", 0) > 0
    assert cost.token_buckets == tuple(data["token_buckets"]) == (16, 256)
    small, big = StepShape(embed_tokens=16, seqs=1), StepShape(embed_tokens=64, seqs=1)
    assert cost.step_time(big) > cost.step_time(small) > 0
    fit = json.loads(path.read_text())["fit"]
    assert fit["all"]["n"] >= 20 and fit["held_out"]["n"] >= 5
    # Held-out steps (every fourth, not fitted): R^2 0.96-1.00 in 8 runs on a 2-core machine
    # at load average 2-3, 0.76 once with compiles running beside it. A fit that misses how the
    # step time depends on the step's shape scores about 0 or below: -0.5..0.01 with the step
    # times shuffled before the fit. 0.5 keeps that margin on both sides. With the suite in 2
    # processes it failed once (a full-suite run beside the other process's compiles, passing
    # alone), so a second calibration is taken before failing: a fit that misses the shapes
    # fails both.
    if fit["held_out"]["r2"] < 0.5:
        load_script("calibrate").main(["--fast", "--out", str(path)])
        capsys.readouterr()
        fit = json.loads(path.read_text())["fit"]
    assert fit["held_out"]["r2"] >= 0.5, fit["held_out"]
    r = simulate(SimConfig(SchedulerConfig(token_budget=64, chunk_size=32, num_pages=512),
                           WorkloadConfig(num_requests=10, arrival="burst")), cost)
    assert r.makespan_s > 0


def test_bench_hol_real_and_sim_on_tiny(tmp_path, capsys):
    path = tmp_path / "hol.json"
    load_script("bench_hol").main([
        "--preset", "tiny", "--n", "3", "--gen-prompt", "20", "--max-tokens", "3",
        "--embed-len", "40", "--budget", "64", "--chunk", "32", "--max-num-seqs", "8",
        "--max-model-len", "128", "--json", str(path)])
    printed = capsys.readouterr().out
    lines = [line.split()[:2] for line in printed.splitlines()]
    assert ["real", "ibs"] in lines and ["sim", "homogeneous"] in lines
    data = json.loads(path.read_text())
    for where in ("real", "sim"):
        results = data["results"][where]
        assert set(results) == {"ibs", "fcfs", "homogeneous"}
        for m in results.values():
            assert 0 < m["gen_p50_s"] <= m["gen_p99_s"] <= m["makespan_s"] + 1e-9
            assert 0 < m["emb_p99_s"] <= m["makespan_s"] + 1e-9
        assert {"emb_p99_fcfs_over_ibs", "gen_p99_ibs_vs_fcfs"} <= set(data["targets"][where])
    assert all(m["compiles_while_timed"] == 0 for m in data["results"]["real"].values())
