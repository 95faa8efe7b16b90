"""One device group per local replica: the GPUs each replica gets (hand-computed groups, the
GPUs counted from CUDA_VISIBLE_DEVICES / JAX_PLATFORMS / nvidia-smi lines), the refusal of
more replicas than the GPUs serve, and the CUDA_VISIBLE_DEVICES each spawned replica process
starts with (a stand-in worker reports its environment; no GPU and no engine needed)."""
import os
import pathlib

import pytest

from hetero_jax.serving import device_groups as groups_module
from hetero_jax.serving import replicas as replicas_module
from hetero_jax.serving.processes import ModelSource
from hetero_jax.serving.device_groups import device_groups, visible_gpus
from hetero_jax.serving.replicas import ReplicaSet

FOUR = ["0", "1", "2", "3"]


@pytest.mark.parametrize("replicas, tp, gpus, groups", [
    (2, 1, FOUR, ["0", "1"]),
    (2, 2, FOUR, ["0,1", "2,3"]),
    (1, 4, FOUR, ["0,1,2,3"]),
    (1, 2, FOUR, ["0,1"]),  # GPUs left over stay unused
    (2, 2, ["4", "5", "6", "7"], ["4,5", "6,7"]),  # the parent's own CUDA_VISIBLE_DEVICES
    (3, 1, ["GPU-a", "GPU-b", "GPU-c"], ["GPU-a", "GPU-b", "GPU-c"]),  # UUIDs pass through
    (4, 2, [], None),  # a CPU host: one core each, as before
])
def test_replica_i_gets_gpus_i_tp_to_i_plus_1_tp(replicas, tp, gpus, groups):
    assert device_groups(replicas, tp, gpus) == groups


def test_more_replicas_than_the_gpus_serve_name_both_counts():
    with pytest.raises(ValueError, match=r"replicas=3 with tensor_parallel=2 need 6 GPUs "
                                         r"\(2 per replica\); this host has 4 \(0,1,2,3\)"):
        device_groups(3, 2, FOUR)


SMI = ["GPU 0: NVIDIA H100 (UUID: GPU-1)", "  MIG 1g.10gb Device 0: (UUID: MIG-1)",
       "GPU 1: NVIDIA H100 (UUID: GPU-2)"]


@pytest.mark.parametrize("env, gpus", [
    ({"CUDA_VISIBLE_DEVICES": "2,3"}, ["2", "3"]),
    ({"CUDA_VISIBLE_DEVICES": " 5 , 7 "}, ["5", "7"]),
    ({"CUDA_VISIBLE_DEVICES": ""}, []), ({"CUDA_VISIBLE_DEVICES": "-1"}, []),
    ({}, ["0", "1"]),  # nvidia-smi -L: its GPU lines, not its MIG lines
    ({"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "0,1"}, []),  # jax told to use the CPU
    ({"JAX_PLATFORMS": "cuda,cpu"}, ["0", "1"]),
])
def test_the_gpus_are_counted_from_the_environment(env, gpus):
    assert visible_gpus(env, lambda: SMI) == gpus


def test_no_nvidia_smi_means_no_gpus(monkeypatch):
    monkeypatch.setattr(groups_module.shutil, "which", lambda name: None)
    assert visible_gpus({}) == []


def report_env(index, core, spec, config, conn):
    """Stand-in replica worker: writes the GPUs it was started with, waits to be closed."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    (pathlib.Path(spec.path) / f"replica{index}").write_text(env)
    conn.send(("error", ("ValueError", f"replica {index} reported", "")))
    conn.recv()


@pytest.mark.parametrize("tp", [1, 2])
def test_each_replica_process_starts_with_its_own_gpus(tp, tmp_path, monkeypatch):
    monkeypatch.setattr(replicas_module, "worker", report_env)
    monkeypatch.setattr(replicas_module, "visible_gpus", lambda: FOUR)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    config = replicas_module.EngineConfig(tensor_parallel=tp)
    with pytest.raises(ValueError, match="reported"):  # the first report ends the set
        ReplicaSet(ModelSource(path=str(tmp_path)), 2, config)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3", "the parent's is restored"
    want = device_groups(2, tp, FOUR)
    assert [(tmp_path / f"replica{i}").read_text() for i in range(2)] == want


def test_too_few_gpus_refuse_before_any_process(tmp_path, monkeypatch):
    monkeypatch.setattr(replicas_module, "worker", report_env)
    monkeypatch.setattr(replicas_module, "visible_gpus", lambda: ["0", "1", "2"])
    with pytest.raises(ValueError, match="replicas=2 with tensor_parallel=2 need 4 GPUs"):
        ReplicaSet(ModelSource(path=str(tmp_path)), 2, replicas_module.EngineConfig(
            tensor_parallel=2))
    assert list(tmp_path.iterdir()) == [], "no replica process started"


def test_ray_actor_resources_follow_tensor_parallel(monkeypatch):
    """A Ray engine actor: on GPUs at least its TP degree of them and no XLA flags; on CPUs
    one XLA thread and TP host devices (a flag already set is replaced, not repeated)."""
    from hetero_jax import EngineConfig
    from hetero_jax.serving.ray_replicas import actor_resources

    assert actor_resources(EngineConfig(tensor_parallel=2), 1) == (2, None)
    assert actor_resources(EngineConfig(tensor_parallel=2), 4) == (4, None)
    assert actor_resources(EngineConfig(), 1) == (1, None)
    gpus, env = actor_resources(EngineConfig(), 0)
    assert gpus == 0 and "device_count" not in env["env_vars"]["XLA_FLAGS"]
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    gpus, env = actor_resources(EngineConfig(tensor_parallel=2), 0)
    flags = env["env_vars"]["XLA_FLAGS"].split()
    assert gpus == 0 and flags.count("--xla_force_host_platform_device_count=2") == 1
    assert not any(f.endswith("=8") for f in flags)
