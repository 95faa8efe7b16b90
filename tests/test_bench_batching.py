"""`hetero-jax bench --batching`: bad flags name their value; a quick shared-prefix run puts
every batching policy side by side (and each fixed arm, and cascade off), with the bandit's
arm in its row."""
import json

import pytest

from hetero_jax.bench.cli import add_ratios
from hetero_jax.bench.config import parse_config
from hetero_jax.cli import main
from hetero_jax.sched.bandit import Arm


@pytest.mark.parametrize("flags, message", [
    (["--batching", "fcfs,sjf"], "unknown batching policy 'sjf'"),
    (["--arms", "0:8,2"], "bad arm '2': expected LOSS:CAP"),
    (["--arms", "0:0"], "cap=0 must be None or an integer >= 1"),
    (["--arms", "1:8,1:8"], "repeat an arm"),
    (["--chunk-pages", "0"], "argument --chunk-pages: 0 is outside [1, 1024]"),
    (["--cascade", "sometimes"], "bad value 'sometimes'"),
])
def test_bad_batching_flags_fail_naming_the_value(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_flags_reach_the_engine_config():
    cfg = parse_config(["--preset", "tiny", "--batching", "lpm,feather-bandit", "--arms",
                        "0:8,any:max", "--chunk-pages", "2", "--cascade", "on,off"])
    assert cfg.batching == ("lpm", "feather-bandit") and cfg.cascade == (True, False)
    feather = cfg.engine_config().feather
    assert feather.chunk_pages == 2 and feather.arms == (Arm(0, 8), Arm(None, None))


def test_rows_compare_with_the_same_schedulers_fcfs_batching():
    rows = [dict(ratio="1:1", scheduler=s, requests_per_s=v) for s, v in (
        ("ibs+fcfs", 2.0), ("ibs+lpm", 3.0), ("ibs+fcfs/plain", 1.0),
        ("ibs+feather[loss<=0,cap=8]/plain", 1.5))]
    add_ratios(rows)
    assert [r["vs_fcfs"] for r in rows] == [1.0, 1.5, 1.0, 1.5]


@pytest.mark.slow
def test_quick_shared_prefix_run_puts_every_batching_policy_side_by_side(tmp_path):
    out = tmp_path / "b.json"
    assert main(["bench", "--preset", "tiny", "--quick", "--workload", "shared-prefix",
                 "--groups", "2", "--prompts-per-group", "4", "--prefix-len", "48",
                 "--suffix-len", "4", "--output-len", "4", "--ratios", "0:1",
                 "--schedulers", "ibs", "--batching", "fcfs,lpm,feather,feather-bandit,each-arm",
                 "--arms", "0:2,any:max", "--cascade", "on,off",
                 "--compile-cache", str(tmp_path / "xla"),
                 "--no-progress", "--json", str(out)]) == 0
    rows = {r["scheduler"]: r for r in json.loads(out.read_text())["results"]}
    names = {f"ibs+{b}{c}" for b in ("fcfs", "lpm", "feather", "feather-bandit",
                                     "feather[loss<=0,cap=2]", "feather[loss<=any,cap=max]")
             for c in ("", "/plain")}
    assert set(rows) == names
    assert all(r["requests"] == 8 for r in rows.values())
    assert rows["ibs+feather-bandit"]["batching"]["best_arm"] in ("loss<=0,cap=2",
                                                                 "loss<=any,cap=max")
    assert rows["ibs+fcfs"]["vs_fcfs"] == 1.0
