"""Tensor parallelism: the Megatron partition table (hand-checked specs), bad degrees named,
and TP=2 on two host devices (a subprocess with XLA_FLAGS) gives TP=1's greedy tokens,
log-probs (fp32, 1e-5) and embeddings (cosine > 0.99999) on a tiny Hugging Face Llama with
GQA 4:1 (so its one KV head is repeated per shard), with no compile after warm-up."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from hetero_jax.models.presets import preset_config
from hetero_jax.runner.sharding import AXIS, check_tensor_parallel, leaf_spec

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


@pytest.mark.slow  # a subprocess that imports torch and compiles twice: about 25 s
def test_tp2_on_two_host_devices_equals_tp1(hf_model):
    path, _ = hf_model("llama3")  # 4 query heads, 1 KV head
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "tp_script.py"), path],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["kv_heads"] == 2 and r["kv_shard"][3] == 1, "one (repeated) KV head per shard"
    assert r["wq_shard"] == [64, 2 * 24], "two of the four query heads per shard"
    assert r["after"] == r["warm"] > 0, "no compile after warm-up"
    for base, sharded in zip(r["base"], r["sharded"]):
        if "tokens" in base:
            assert sharded["tokens"] == base["tokens"]
            np.testing.assert_allclose(sharded["logprobs"], base["logprobs"], atol=1e-5)
        else:
            a, b = np.asarray(base["embedding"]), np.asarray(sharded["embedding"])
            assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.99999
