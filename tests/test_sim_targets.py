"""scripts/sim_targets.py re-runs issue 31's simulator rows against their thresholds: each row
carries its value, threshold and command, and 'met' follows the threshold's direction."""
import pytest

from tests.script_loader import load_script


def test_the_burst_rows_carry_value_threshold_and_command(capsys):
    script = load_script("sim_targets")
    rows = script.main(["--only", "burst"])
    assert [r["threshold"] for r in rows] == [1.08, 1.2]
    assert all(r["met"] == (r["value"] >= r["threshold"]) for r in rows)
    assert all(r["command"].startswith("hetero-jax sim --policy ibs,ibs-paper") for r in rows)
    assert "calibration/small-cpu.json" in rows[0]["command"]
    assert "burst 9:1 roofline:h200" in capsys.readouterr().out


def test_an_at_most_target_is_met_at_or_below_its_threshold():
    row = load_script("sim_targets").row
    assert row("p50", 1.5, 1.5, "", at_least=False)["met"]
    assert not row("p50", 1.51, 1.5, "", at_least=False)["met"]
    assert not row("x", 2.79, 2.8, "")["met"] and row("x", 2.8, 2.8, "")["met"]


def test_an_unknown_group_is_refused(capsys):
    with pytest.raises(SystemExit):
        load_script("sim_targets").main(["--only", "burst,nope"])
    assert "unknown group(s) ['nope']" in capsys.readouterr().err
