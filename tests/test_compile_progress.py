"""Compiling shows itself ("compiling step variant k/N (first run only; cached after)" per
build, in a run and in a warm-up), and progress bars leave its seconds out of their elapsed
time, rate and ETA. Counted and on an injected clock: no wall-clock assert."""
import io
import re
import types

import pytest
from tqdm import tqdm

from hetero_jax.runner.compile_progress import LOADING, NOTICE, BarClock, CompileNotice
from hetero_jax.runner.decoder import DecoderRunner
from hetero_jax.runner.executables import ExecutableCache

LINE = re.compile(r"(?:compiling step variant (\d+)/(\d+) \(first run only; cached after\)|"
                  r"loading step variant (\d+)/(\d+) from the compile cache)")


def test_each_build_is_announced_once_k_of_n():
    lines = []
    cache = ExecutableCache(lambda key: f"exe{key}", on_build=CompileNotice(5, lines.append))
    for key in [(1,), (2,), (1,), (3,), (2,)]:
        cache(key)
    assert lines == [NOTICE.format(k=k, n=5) for k in (1, 2, 3)] and cache.builds == 3
    assert lines[0] == "compiling step variant 1/5 (first run only; cached after)"


def test_a_warmup_numbers_the_variants_it_builds():
    """`DecoderRunner.warmup` announces 1..n of the n variants neither held nor on disk; a
    rebuild past N (a dropped variant) never reads k > N."""
    lines = []
    notice = CompileNotice(100, lines.append)
    runner = types.SimpleNamespace(executable=ExecutableCache(lambda key: key, on_build=notice),
                                   manifest=lambda: None, notice=notice)
    runner.executable((0,))
    lines.clear()
    assert DecoderRunner.warmup(runner, [(0,), (1,), (2,), (3,)]) == 3
    assert lines == [NOTICE.format(k=k, n=3) for k in (1, 2, 3)]
    notice((4,), loading=True)
    assert lines[-1] == LOADING.format(k=4, n=4)
    assert lines[-1] == "loading step variant 4/4 from the compile cache"


def fake_bar(clock, total=10):
    bar = tqdm(total=total, file=io.StringIO(), mininterval=0, miniters=1)
    bar._time = clock  # tqdm reads its clock here
    bar.start_t = bar.last_print_t = clock()
    return bar


@pytest.mark.parametrize("smoothing", [0.3, 0.0])
def test_bar_times_leave_compiling_out(smoothing):
    """30 s of compiling before the first row, then a row a second: the bar reads 4 rows in
    4 s at 1 row/s (the issue's bar read 33 s/row after the first)."""
    now, compiled = [100.0], [0.0]
    bar = fake_bar(lambda: now[0])
    bar.smoothing = smoothing
    clock = BarClock(bar, lambda: compiled[0], lambda: now[0])
    now[0] += 31.0
    compiled[0] += 30.0
    clock.update(1)
    for _ in range(3):
        now[0] += 1.0
        clock.update(1)
    d = bar.format_dict
    assert (d["n"], d["elapsed"]) == (4, pytest.approx(4.0)), d
    assert d["rate"] is None or d["rate"] == pytest.approx(1.0), d  # None: tqdm uses n/elapsed
    assert clock.serving_s() == pytest.approx(4.0)
    bar.close()


def test_compile_seconds_beyond_the_time_passed_are_not_left_out():
    """Replicas compile side by side, so their summed seconds can exceed the time passed:
    at most that time comes off, and the elapsed time never goes below zero."""
    now, compiled = [0.0], [0.0]
    bar = fake_bar(lambda: now[0])
    clock = BarClock(bar, lambda: compiled[0], lambda: now[0])
    now[0], compiled[0] = 10.0, 25.0  # 2.5 replicas' worth in 10 s
    clock.update(1)
    now[0] += 2.0
    clock.update(1)
    assert bar.format_dict["elapsed"] == pytest.approx(2.0)
    assert clock.serving_s() == pytest.approx(2.0)
    bar.close()


def test_a_disabled_bar_keeps_no_times_and_serving_time_still_counts():
    now, compiled = [0.0], [0.0]
    clock = BarClock(tqdm(total=3, disable=True), lambda: compiled[0], lambda: now[0])
    now[0], compiled[0] = 10.0, 4.0
    clock.update(2)
    assert clock.serving_s() == pytest.approx(6.0)


def announced(err: str) -> list:
    """(k, N) of every compile or load line in `err`."""
    return [tuple(int(g) for g in m.groups() if g) for m in LINE.finditer(err)]


def test_an_engine_announces_every_variant_it_compiles(capsys):
    """A run compiles on first use (k of every variant the configuration allows); a warm-up
    then numbers the ones it builds; one line per build either way. A second engine of the
    same configuration loads what the first wrote to the persistent cache, and says so."""
    from hetero_jax import Engine, EngineConfig, SamplingParams

    config = EngineConfig(token_budget=64, chunk_size=16, max_num_seqs=8, max_chunk_seqs=1,
                          max_model_len=256, token_buckets=(64,), page_buckets=(16,),
                          warmup="all")
    engine = Engine.from_preset("tiny", config=config)
    capsys.readouterr()
    engine.generate(["a prompt"], SamplingParams(max_tokens=4), use_tqdm=False)
    err = capsys.readouterr().err
    n = len(engine.config.variants())
    assert announced(err) == [(k, n) for k in range(1, engine.stats.compiles + 1)], err
    ran = engine.stats.compiles
    built = engine.warmup()
    assert announced(capsys.readouterr().err) == [(k, built) for k in range(1, built + 1)]
    assert engine.stats.compiles == ran + built and ran >= 1
    again = Engine.from_preset("tiny", config=config)
    capsys.readouterr()
    again.generate(["a prompt"], SamplingParams(max_tokens=4), use_tqdm=False)
    err = capsys.readouterr().err
    assert "compiling" not in err and err.count("from the compile cache") == ran, err
