"""scripts/bench_forward.py's mixed step next to its parts: the same items, one step each."""
import pytest

from tests.script_loader import load_script


@pytest.mark.slow  # ~10 s: compiles the three steps of the tiny preset
def test_mixed_step_is_timed_next_to_its_two_parts():
    r = load_script("bench_forward").mixed_vs_parts("tiny", "2:16:4", context=32, repeats=2)
    assert r["spec"] == "2:16:4" and r["context"] == 32
    assert all(r[k] > 0 for k in ("mixed", "embed-only", "decode-only"))
    assert r["extra_over_decode"] == pytest.approx(
        (r["mixed"] - r["embed-only"]) / r["decode-only"])
