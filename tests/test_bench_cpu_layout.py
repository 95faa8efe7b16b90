"""scripts/bench_cpu_layout.py: the CPU runner's layout against a runner without its choices."""
import pytest

from tests.script_loader import load_script


@pytest.mark.slow  # ~40 s: compiles the tiny preset's steps twice
def test_the_layout_bench_times_both_engines_on_the_same_steps():
    script = load_script("bench_cpu_layout")
    r = script.bench("tiny", [2, 4], (20, 60), repeats=1)
    assert [row["step"] for row in r["rows"]] == [
        "decode x2", "decode x4", "embed 1x64", "embed 4x64", "embed 1x64 + decode x12"]
    for row in r["rows"]:
        assert row["cpu_layout_s"] > 0 and row["ratio"] == row["cpu_layout_s"] / row["without_s"]


@pytest.mark.parametrize("drop", [("mlp", "blocks"), ("mlp",), ("blocks",), ("tokens",)])
def test_the_other_engine_drops_exactly_the_named_choices(drop):
    from hetero_jax import Engine, EngineConfig
    from hetero_jax.models.layers import is_feature_major
    from hetero_jax.runner.decoder import decode_block_pages

    script = load_script("bench_cpu_layout")
    engine = Engine.from_preset("tiny", config=EngineConfig(max_model_len=512))
    tokens = script.without_config(engine.config, drop).token_buckets
    assert engine.config.token_buckets[0] == 8
    assert tokens == ((16, 32, 64, 128, 256) if "tokens" in drop else None)
    script.without_cpu_layout(engine, drop)
    runner = engine.runner
    assert is_feature_major(runner.params) == ("mlp" not in drop)
    blocks = decode_block_pages(runner.impl, runner.backend, 16, (16, 16, 0, 32, 0))
    assert (blocks is None) == ("blocks" in drop)
