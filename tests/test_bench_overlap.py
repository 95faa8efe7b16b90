"""scripts/bench_overlap.py: the same engine stepped with the overlap off and on, in turn."""
import pytest

from tests.script_loader import load_script


@pytest.mark.slow  # ~15 s: compiles the tiny preset's few steps of this configuration
def test_the_overlap_bench_times_both_modes_and_the_executable_alone():
    r = load_script("bench_overlap").bench("tiny", running=8, queued=4, prompt_len=20, steps=2,
                                           repeats=1)
    assert (r["running"], r["queued"]) == (8, 4) and r["device_s"] > 0
    for mode in ("off", "on"):
        m = r[mode]
        assert m["wall_s"] > 0 and m["host_s"] > 0
        assert m["wall_over_max"] == m["wall_s"] / max(m["host_s"], r["device_s"])
