"""Tensor parallelism: the Megatron partition table (hand-checked specs), bad degrees named
(by the check, by EngineConfig, and by the Engine before it makes or reads any weights),
repeated KV heads undone for saving, a checkpoint read onto the host for the sharded runner, and
TP=2 on two host devices (a subprocess with XLA_FLAGS) gives TP=1's greedy tokens,
log-probs (fp32, 1e-5) and embeddings (cosine > 0.99999) on a tiny Hugging Face Llama with
GQA 4:1 (so its one KV head is repeated per shard), with no compile after warm-up, its
checkpoint handed over on the host and placed shard by shard equal to TP=1's params; the
Pallas kernel per shard (shard_map, interpret mode) gives the same on a few tokens; TP=1's
`Engine.save` restored at TP=2 (`Engine.load`) straight into the table's shards (the K/V whose
head is repeated on the host) and a preset made at TP=2 (on the host) give TP=1's results."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from hetero_jax import Engine, EngineConfig
from hetero_jax.models import llama
from hetero_jax.models.formats.hf_llama import export_hf_model, hf_config_dict, load_params
from hetero_jax.models.presets import preset_config
from hetero_jax.runner.sharding import AXIS, check_tensor_parallel, expand_kv_heads, leaf_spec, \
    unexpand_kv_heads
from hetero_jax.serving import engine as engine_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("path, shape, spec", [
    ("embed", (300, 64), P(AXIS, None)), ("embed", (301, 64), P()),  # 301: replicated
    ("lm_head", (64, 300), P(None, AXIS)), ("final_norm", (64,), P()),
    ("layers/0/wq", (64, 96), P(None, AXIS)), ("layers/wq", (2, 64, 96), P(None, None, AXIS)),
    ("layers/1/wk", (64, 48), P(None, AXIS)), ("layers/0/bv", (48,), P(AXIS)),
    ("layers/0/wo", (96, 64), P(AXIS, None)), ("layers/w_down", (2, 96, 64), P(None, AXIS, None)),
    ("layers/0/w_gate", (64, 96), P(None, AXIS)), ("layers/0/attn_norm", (64,), P()),
    ("layers/0/lora_a_wq", (2, 64, 8), P()),
    ("layers/0/lora_b_wq", (2, 8, 96), P(None, None, AXIS)),
    ("layers/0/lora_a_wo", (2, 96, 8), P(None, AXIS, None)),
    ("layers/0/lora_b_wo", (2, 8, 64), P()),
])
def test_the_partition_table_gives_the_megatron_layout(path, shape, spec):
    assert leaf_spec(path, shape, 2) == spec


def test_bad_degrees_name_the_value():
    tiny = preset_config("tiny")  # 8 heads, 4 KV heads, 512 hidden units
    check_tensor_parallel(tiny, 8, 8)  # 8 > 4 KV heads: repeated twice
    for n, devices, message in [
            (3, 8, "tensor_parallel=3 does not divide num_heads=8"),
            (4, 2, "tensor_parallel=4 exceeds the 2"), (0, 2, "tensor_parallel=0 must be"),
            (2.0, 2, "tensor_parallel=2.0 must be an integer")]:
        with pytest.raises(ValueError, match=message):
            check_tensor_parallel(tiny, n, devices)
    with pytest.raises(ValueError, match="does not divide layers/0/w_up"):
        leaf_spec("layers/0/w_up", (64, 97), 2)


@pytest.mark.parametrize("value, message", [
    (0, r"tensor_parallel=0 must be in \[1, "),
    ("2", "tensor_parallel='2' must be an integer, not str"),
    (True, "tensor_parallel=True must be an integer, not bool")])
def test_engine_config_refuses_a_degree_that_is_no_positive_integer(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(tensor_parallel=value)


def _no_weights(*args, **kwargs):
    raise AssertionError("weights were made or read before the tensor_parallel check")


@pytest.mark.parametrize("n, message", [
    (3, "tensor_parallel=3 does not divide num_heads=8"),  # the tiny preset: 8 heads
    (2, "tensor_parallel=2 exceeds the 1 cpu device"),  # this process sees one host device
    (16, "tensor_parallel=16 does not divide num_heads=8")])
def test_the_engine_refuses_a_bad_degree_before_any_weights(n, message, tmp_path, monkeypatch):
    assert len(jax.devices()) == 1, jax.devices()
    monkeypatch.setattr(engine_module.llama, "init_params", _no_weights)
    monkeypatch.setattr(engine_module, "load_params", _no_weights)
    with pytest.raises(ValueError, match=message):
        Engine.from_preset("tiny", config=EngineConfig(tensor_parallel=n))
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(preset_config("tiny"))))
    with pytest.raises(ValueError, match=message):  # config.json only: no weights to read
        Engine.from_pretrained(str(tmp_path), config=EngineConfig(tensor_parallel=n))


def test_unexpand_kv_heads_undoes_the_repeat():
    cfg = preset_config("tiny")  # 4 KV heads: 8 shards repeat each twice
    params = llama.init_params(cfg, 0)
    wide_cfg, wide = expand_kv_heads(cfg, params, 8)
    assert wide_cfg.num_kv_heads == 8
    assert wide["layers"]["wk"].shape[-1] == 2 * params["layers"]["wk"].shape[-1]
    back = unexpand_kv_heads(cfg, wide)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        np.testing.assert_array_equal(a, b)


def test_a_checkpoint_read_on_the_host_equals_the_device_one(tmp_path):
    cfg = preset_config("tiny")
    export_hf_model(str(tmp_path), cfg, llama.init_params(cfg, 0))
    host = load_params(str(tmp_path), cfg, np.float32, on_host=True)
    device = load_params(str(tmp_path), cfg, np.float32)
    assert {type(x) for x in jax.tree.leaves(host)} == {np.ndarray}
    assert {type(x) for x in jax.tree.leaves(device)} == {type(jax.numpy.zeros(1))}
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(device)):
        np.testing.assert_array_equal(a, b)


def _assert_same(base: list, sharded: list) -> None:
    """Greedy tokens equal, log-probs within 1e-5 (fp32), embeddings cosine > 0.99999."""
    assert len(base) == len(sharded), (len(base), len(sharded))
    for one, two in zip(base, sharded):
        if "tokens" in one:
            assert two["tokens"] == one["tokens"]
            np.testing.assert_allclose(two["logprobs"], one["logprobs"], atol=1e-5)
        else:
            a, b = np.asarray(one["embedding"]), np.asarray(two["embedding"])
            assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.99999


@pytest.mark.slow  # a subprocess that imports torch, compiles twice, runs Pallas interpreted
def test_tp2_on_two_host_devices_equals_tp1(hf_model, tmp_path):
    path, _ = hf_model("llama3")  # 4 query heads, 1 KV head
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "tp_script.py"), path,
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["kv_heads"] == 2 and r["kv_shard"][3] == 1, "one (repeated) KV head per shard"
    assert r["wq_shard"] == [64, 2 * 24], "two of the four query heads per shard"
    assert r["after"] == r["warm"] > 0, "no compile after warm-up"
    assert r["given"] == ["ndarray"], "the checkpoint reaches the sharded runner on the host"
    assert r["params_equal"] and r["laid_out"], "placed shard by shard, equal to TP=1's"
    _assert_same(r["base"], r["sharded"])
    _assert_same(r["few_base"], r["few_pallas"])  # the Pallas kernel once per shard
    assert max(r["kernel_diff"]) < 1e-5, r["kernel_diff"]  # without and with a cascade plan
    # Engine.save at TP=1, Engine.load at TP=2: restored into the shards (K/V on the host, as
    # the runner repeats their one head), laid out by the table, TP=1's greedy results.
    restored = r["restored"]
    assert restored["host_leaves"] == ["layers/wk", "layers/wv"], restored["host_leaves"]
    assert restored["given_laid_out"] and restored["laid_out"], restored
    _assert_same(r["base_greedy"], restored["results"])
    assert r["tiny_targets_sharded"], "with no head repeated, every leaf restored in shards"
    # A preset at TP=2: its random weights made on the host, then placed shard by shard.
    assert r["preset"]["given"] == ["ndarray"] and r["preset"]["laid_out"], r["preset"]
    _assert_same(r["preset_base"], r["preset"]["results"])


@pytest.mark.slow  # two batch jobs in subprocesses on the tiny preset: about 20 s
def test_batch_tensor_parallel_2_writes_tp1s_rows(tmp_path):
    rows = [{"id": 1, "embed": "hello world"},
            {"id": 2, "prompt": "Once upon", "max_tokens": 6, "temperature": 0},
            {"id": 3, "prompt": "a b c", "max_tokens": 4, "temperature": 0}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    out = {}
    for n in (1, 2):
        argv = ["batch", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / f"tp{n}.jsonl"),
                "--preset", "tiny", "--tensor-parallel", str(n), "--token-budget", "32",
                "--chunk-size", "16", "--max-num-seqs", "4", "--no-progress",
                "--compile-cache", "none"]
        proc = subprocess.run([sys.executable, "-c", "import sys\nfrom hetero_jax.cli import "
                               f"main\nsys.exit(main({argv!r}))"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert ("split over 2 devices" in proc.stdout) == (n == 2), proc.stdout
        lines = (tmp_path / f"tp{n}.jsonl").read_text().splitlines()
        out[n] = {r["id"]: r for r in map(json.loads, lines)}
    assert sorted(out[1]) == sorted(out[2]) == [1, 2, 3]
    for row_id, one in out[1].items():
        two = out[2][row_id]
        if "embedding" in one:
            a, b = np.asarray(one["embedding"]), np.asarray(two["embedding"])
            assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.99999
        else:
            assert two["token_ids"] == one["token_ids"], row_id
