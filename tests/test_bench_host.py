"""scripts/bench_host.py: the host's CPU a step, by phase."""
import collections
import itertools
import types

import pytest

from tests.script_loader import load_script


def test_each_phase_is_charged_its_own_calls_returned_or_raised():
    """An injected clock that ticks once per reading: each wrapped call adds exactly 1 to its
    own phase, a call that raises too, and the engine's calls still return their results."""
    bench = load_script("bench_host")

    def fail(*_):
        raise RuntimeError("broken step")
    scheduler = types.SimpleNamespace(schedule=lambda: "out", advance=lambda out: "ahead",
                                      settle=lambda ahead, got: ["done"])
    runner = types.SimpleNamespace(pack=lambda out: ("key", "batch"), launch=fail,
                                   collect=lambda launched: "got")
    engine = types.SimpleNamespace(scheduler=scheduler, runner=runner)
    spent, ticks = collections.defaultdict(float), itertools.count()
    bench.time_phases(engine, spent, clock=lambda: next(ticks))
    assert scheduler.schedule() == "out" and runner.pack("out") == ("key", "batch")
    with pytest.raises(RuntimeError, match="broken step"):
        runner.launch("key", "batch")
    assert runner.collect(None) == "got" and scheduler.advance("out") == "ahead"
    assert scheduler.settle("ahead", "got") == ["done"] and scheduler.schedule() == "out"
    assert dict(spent) == {"schedule": 2, "pack": 1, "launch": 1, "collect": 1, "advance": 1,
                           "settle": 1}


@pytest.mark.slow  # ~20 s: compiles the tiny preset's few steps of this configuration
def test_the_host_bench_times_every_phase_of_a_steady_decode_step():
    r = load_script("bench_host").bench("tiny", running=8, budget=64, queued=4, prompt_len=20,
                                        steps=2, repeats=2)
    ms = r["ms"]
    assert all(ms[name] > 0 for name in ("schedule", "pack", "launch", "collect", "advance"))
    assert ms["step"] >= ms["bar"] > 0 and r["best_ms"]["bar"] <= ms["bar"]
