"""Step variants and their executables: exactly the reachable variants, a cache bounded by the
process's memory mappings, and a second process that compiles nothing (persistent cache)."""
import itertools
import json
import os
import subprocess
import sys
import warnings

import pytest

from hetero_jax import Engine, EngineConfig, SamplingParams
from hetero_jax.runner.batch import is_cascade
from hetero_jax.runner.executables import CPU_COMPILE_OPTIONS, ExecutableCache, WarmManifest, \
    compile_options, enable_compile_cache
from hetero_jax.sched import DECODE, PREFILL, ScheduledItem
from hetero_jax.sched.shapes import step_key


def _item(kind, num_tokens, pages):
    start = pages * 16 - num_tokens  # the item's last token ends its last page
    return ScheduledItem(0, kind, start, num_tokens, True, pages=tuple(range(1, pages + 1)))


def test_variants_are_exactly_the_reachable_steps():
    """Every split of a step into d decodes and c chunks of 1..chunk_size tokens under the
    budget, chunks and decodes each at any page count, lands in variants(), and every plain
    variant is the key of such a step."""
    cfg = EngineConfig(token_budget=48, chunk_size=16, max_num_seqs=12, max_chunk_seqs=3,
                       page_size=16, max_model_len=512, cascade_rows=0,
                       token_buckets=(8, 16, 32, 48), seq_buckets=(4, 8, 12),
                       chunk_seq_buckets=(0, 1, 3)).resolve(512, 64)
    seen = set()
    for c in range(cfg.max_chunk_seqs + 1):
        for d in range(0 if c else 1, cfg.max_num_seqs - c + 1):
            for lengths in itertools.combinations_with_replacement(range(1, 17), c):
                if d + sum(lengths) > cfg.token_budget:
                    continue
                for chunk_pages, decode_pages in itertools.product(cfg.page_buckets, repeat=2):
                    items = ([_item(PREFILL, n, chunk_pages) for n in lengths]
                             + [_item(DECODE, 1, decode_pages) for _ in range(d)])
                    seen.add(step_key(items, cfg.buckets(), cfg.page_size))
    assert seen == set(cfg.variants())


def test_default_variants_stay_few():
    """The defaults compile 106 variants (51 plain, 28 with the chunk group at the smallest
    page bucket beside longer decodes, 27 cascade), not the 216 of the full product of the
    old bucket lists, whose warm-up crashed near vm.max_map_count."""
    variants = EngineConfig().resolve(2048, 6144).variants()
    own_chunk_pages = sum(v[2] > 0 and v[4] < v[3] for v in variants)
    cascade = sum(map(is_cascade, variants))
    assert (len(variants), own_chunk_pages, cascade) == (106, 28, 27)


def test_a_cpu_runs_decode_steps_of_up_to_8_sequences_at_8_tokens():
    """The default token buckets start at 8 on a CPU (`SMALLEST_TOKEN_BUCKET`: XLA:CPU's
    few-row matmuls cost by their rows) and at 16 elsewhere; on a CPU that adds 5 variants
    (those at 16 tokens and 8 sequences that 8 tokens now hold go). The tokens are those of
    16-token steps."""
    cpu, gpu, unknown = (EngineConfig().resolve(2048, 6144, b) for b in ("cpu", "gpu", None))
    assert (cpu.token_buckets[0], gpu.token_buckets[0], unknown.token_buckets[0]) == (8, 16, 16)
    assert len(cpu.variants()) == 111
    prompts, greedy = [[5, 6, 7], [9, 10], [11]], SamplingParams(max_tokens=4, temperature=0)
    tokens = {}
    for buckets in (None, (16, 32, 64)):
        engine = Engine.from_preset("tiny", config=EngineConfig(
            token_budget=64, max_model_len=64, token_buckets=buckets))
        tokens[buckets] = [o.token_ids for o in engine.generate(prompts, greedy,
                                                                use_tqdm=False)]
        decode_steps = {key for key, _ in engine.runner.executable.held() if key[2] == 0}
        assert decode_steps and {t for t, *_ in decode_steps} == {(buckets or (8,))[0]}
    assert tokens[None] == tokens[(16, 32, 64)]


def test_warmup_is_lazy_on_a_cpu_by_default():
    """On a CPU `warmup()` builds nothing unless told (XLA:CPU spends seconds on each variant
    and a run meets a few); each step builds the variant it meets, one of `variants()`."""
    assert (EngineConfig().warmup_on("cpu"), EngineConfig().warmup_on("gpu")) == ("lazy", "all")
    assert EngineConfig(warmup="all").warmup_on("cpu") == "all"
    with pytest.raises(ValueError, match="warmup='eager' must be one of"):
        EngineConfig(warmup="eager")
    engine = Engine.from_preset("tiny", config=EngineConfig(
        token_budget=32, chunk_size=16, max_num_seqs=8, max_model_len=64, token_buckets=(8, 32),
        page_buckets=(4,), cascade_rows=0))
    assert engine.config.warmup == "lazy" and engine.warmup() == 0 == engine.stats.compiles
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
    held = {key for key, _ in engine.runner.executable.held()}
    assert 1 <= engine.stats.compiles == len(held) and held <= set(engine.config.variants())


def test_cpu_compile_options_are_part_of_the_warm_manifest(monkeypatch):
    """The CPU's XLA options (LLVM at level 1) key the record of what is on disk: a manifest
    written under other options cannot claim a variant compiled with these."""
    assert compile_options("cpu") == CPU_COMPILE_OPTIONS and compile_options("gpu") == {}
    before = WarmManifest.fingerprint("config")
    monkeypatch.setitem(CPU_COMPILE_OPTIONS, "xla_backend_optimization_level", 2)
    assert WarmManifest.fingerprint("config") != before


def test_cache_drops_least_recently_used_under_the_mapping_bound():
    built = []
    cache = ExecutableCache(lambda key: built.append(key) or f"exe{key}", max_maps=1)
    assert [cache(k) for k in (1, 2, 3)] == ["exe1", "exe2", "exe3"]
    assert len(cache) == 1 and 3 in cache and cache.dropped == 2  # at least one kept
    assert cache(1) == "exe1" and built == [1, 2, 3, 1] and cache.builds == 4
    unbounded = ExecutableCache(lambda key: key, max_maps=0)
    for k in range(5):
        unbounded(k)
    unbounded(0)
    assert len(unbounded) == 5 and unbounded.builds == 5 and unbounded.dropped == 0


def test_compile_cache_settings():
    current = enable_compile_cache("auto")  # the test session's directory (conftest.py)
    assert current and enable_compile_cache(None) == current == enable_compile_cache("none")
    with pytest.warns(UserWarning, match="not used: this process already caches compiles"):
        assert enable_compile_cache("/tmp/elsewhere") == current
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert enable_compile_cache(current) == current
    for bad in ("", 3):
        with pytest.raises(ValueError, match=f"compile_cache={bad!r} must be 'auto'"):
            EngineConfig(compile_cache=bad)


_START = """
import json, sys
from hetero_jax import Engine, EngineConfig, SamplingParams
engine = Engine.from_preset("tiny", config=EngineConfig(
    token_budget=32, chunk_size=16, max_num_seqs=8, max_model_len=64, token_buckets=(32,),
    page_buckets=(4,), cascade_rows=0, warmup="all"))
built = engine.warmup()
out = engine.generate([[5, 6, 7] * 7, [9]], SamplingParams(max_tokens=5, temperature=0),
                      use_tqdm=False)
s = engine.stats
print(json.dumps(dict(built=built, variants=len(engine.config.variants()), builds=s.compiles,
                      loads=s.compile_loads, dir=engine.runner.compile_cache,
                      tokens=[o.token_ids for o in out])))
"""


def test_second_process_of_a_configuration_compiles_nothing(tmp_path):
    """The default cache directory is under $XDG_CACHE_HOME; the second start builds nothing
    in warmup() and its steps load from disk, with the same tokens."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["XDG_CACHE_HOME"] = str(tmp_path)

    def start():
        run = subprocess.run([sys.executable, "-c", _START], env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1])

    cold, warm = start(), start()
    assert cold["dir"] == warm["dir"] == str(tmp_path / "hetero-jax" / "xla")
    assert cold["built"] == cold["variants"] == cold["builds"] and cold["loads"] == 0
    assert warm["built"] == 0 and warm["builds"] == warm["loads"] > 0, "a step compiled"
    assert warm["tokens"] == cold["tokens"]


@pytest.mark.slow  # ~4 min on 2 cores (111 variants of ~2 s each), in a fresh cache
def test_small_preset_default_warmup_finishes_in_bounded_mappings(tmp_path):
    """The warm-up that crashed near vm.max_map_count: every default variant of the small
    preset builds, and the process stays under the limit (the cache drops what it must)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    script = """
import json
from hetero_jax import Engine, EngineConfig
from hetero_jax.runner.executables import default_max_maps, process_maps
engine = Engine.from_preset("small", config=EngineConfig(warmup="all"))
built = engine.warmup()
print(json.dumps(dict(built=built, variants=len(engine.config.variants()), maps=process_maps(),
                      limit=2 * default_max_maps())))
"""
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["built"] == r["variants"] == 111 and r["maps"] < r["limit"]


def test_step_time_leaves_compiling_out(monkeypatch):
    """A step that builds a new variant reports its own time in `step_time`; the build's
    seconds go to `compile_s` only (the bandit's rewards and mean step times read step_time).
    On an injected clock that ticks 1 us per reading and jumps 100 s in each build, so the
    result does not depend on how loaded the machine is."""
    import time

    from hetero_jax import Engine, SamplingParams

    clock, reads = [0.0], [0]

    def fake_perf_counter():
        clock[0] += 1e-6
        reads[0] += 1
        return clock[0]

    engine = Engine.from_preset("tiny", seed=0, config=EngineConfig(max_model_len=128))
    build = engine.runner.executable._build

    def slow_build(key):  # a build that takes 100 s on the injected clock
        clock[0] += 100.0
        return build(key)

    engine.runner.executable._build = slow_build
    monkeypatch.setattr(time, "perf_counter", fake_perf_counter)
    engine.generate(["a prompt"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    stats = engine.stats
    assert stats.compiles >= 1 and stats.compile_s >= 100.0 * stats.compiles
    # the steps were charged clock ticks only (at most one per reading), no build's jump
    assert stats.step_time_s <= reads[0] * 1e-6 * (1 + 1e-6), (stats, reads)

def test_compile_options_bench_times_both_option_sets():
    """scripts/bench_compile_options.py compiles a variant under the engine's CPU options and
    XLA's defaults and times both, interleaved, on the variant's shapes."""
    from tests.script_loader import load_script

    rows = load_script("bench_compile_options").main(["--preset", "tiny", "--rounds", "2",
                                                      "--keys", "[[16, 8, 0, 8, 0]]"])
    assert [r["key"] for r in rows] == [[16, 8, 0, 8, 0]]
    for name in ("engine", "xla-default"):
        assert rows[0][name]["compile_cpu_s"] > 0 and rows[0][name]["step_ms"] > 0
