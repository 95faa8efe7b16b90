"""Which GPUs each local replica process may see: one disjoint device group per replica.

In: the parent's environment (`CUDA_VISIBLE_DEVICES`, `JAX_PLATFORMS`) and, when it names no
GPUs, the lines of `nvidia-smi -L`; the number of replicas and the tensor-parallel degree
`tp`. Out: per replica the `CUDA_VISIBLE_DEVICES` its child process is started with (replica
i gets the parent's GPUs [i * tp, (i + 1) * tp), so its jax sees exactly its own group as
devices 0..tp-1), or None on a host without GPUs, where replicas keep their one CPU core each.
The parent never imports jax for this (`replicas` imports no jax): the GPUs are counted from
the environment, which is what a child's jax would see. A host with GPUs whose jax is the
CPU build is told apart by `JAX_PLATFORMS=cpu`, which turns the GPU groups off.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping


def nvidia_smi_lines() -> list:
    """The lines of `nvidia-smi -L` ([] when there is no nvidia-smi or it fails)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        proc = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return proc.stdout.splitlines() if proc.returncode == 0 else []


def visible_gpus(env: Mapping | None = None,
                 list_gpus: Callable[[], list] = nvidia_smi_lines) -> list:
    """The GPU ids this process may hand out, as strings: `CUDA_VISIBLE_DEVICES`' entries
    when it is set ('' or '-1': none), else one index per `GPU i:` line of `list_gpus()`
    (MIG lines are not counted); [] when `JAX_PLATFORMS` is set without cuda or gpu."""
    env = os.environ if env is None else env
    platforms = env.get("JAX_PLATFORMS", "")
    if platforms and not {"cuda", "gpu"} & set(platforms.replace(" ", "").split(",")):
        return []
    if "CUDA_VISIBLE_DEVICES" in env:
        ids = [x.strip() for x in env["CUDA_VISIBLE_DEVICES"].split(",") if x.strip()]
        return [] if ids[:1] == ["-1"] else ids
    return [str(i) for i, line in enumerate(
        line for line in list_gpus() if line.startswith("GPU "))]


def device_groups(num_replicas: int, tp: int, gpus: list) -> list | None:
    """`CUDA_VISIBLE_DEVICES` per replica: replica i gets gpus[i * tp:(i + 1) * tp]; None
    when `gpus` is empty (a CPU host). ValueError naming both counts when
    num_replicas * tp exceeds the GPUs."""
    if not gpus:
        return None
    need = num_replicas * tp
    if need > len(gpus):
        raise ValueError(f"replicas={num_replicas} with tensor_parallel={tp} need {need} GPUs "
                         f"({tp} per replica); this host has {len(gpus)} "
                         f"({','.join(gpus)}); on CPU cores instead, set JAX_PLATFORMS=cpu")
    return [",".join(gpus[i * tp:(i + 1) * tp]) for i in range(num_replicas)]
