"""`make_engine`: the public factory that picks the engine a config asks for.

`make_engine(preset_or_path, config, replicas=N)` returns a `ReplicaSet` (N engine processes
behind a router) when N >= 2, a `DedicatedEngine` (two worker processes) when
`config.scheduler == "dedicated"`, else an `Engine` with that scheduling policy.
"""
from __future__ import annotations

import os

from hetero_jax.config import EngineConfig, config_or_default
from hetero_jax.models.presets import PRESETS
from hetero_jax.sched.router import RouterConfig
from hetero_jax.serving.dedicated import DedicatedEngine
from hetero_jax.serving.engine import Engine
from hetero_jax.serving.replicas import ReplicaSet


def make_engine(preset_or_path: str, config: EngineConfig | None = None, seed: int = 0,
                replicas: int = 1, router: RouterConfig | str | None = None):
    """An engine for a preset name or a Hugging Face directory: a `ReplicaSet` of `replicas`
    engines routed by `router` when `replicas >= 2`, a `DedicatedEngine` when
    `config.scheduler == "dedicated"`, else an `Engine` with that scheduling policy."""
    config = config_or_default(config)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas={replicas!r} must be an integer >= 1")
    if router is not None and replicas == 1:
        raise ValueError(f"router={router!r} routes between replicas: it needs replicas >= 2")
    preset = preset_or_path in PRESETS
    if not preset and not os.path.isdir(preset_or_path):
        raise ValueError(f"{preset_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                         "model directory")
    if replicas > 1:
        if preset:
            return ReplicaSet.from_preset(preset_or_path, replicas, seed, config, router=router)
        return ReplicaSet.from_pretrained(preset_or_path, replicas, config, router=router)
    if config.scheduler == "dedicated":
        if preset:
            return DedicatedEngine.from_preset(preset_or_path, seed, config)
        return DedicatedEngine.from_pretrained(preset_or_path, config)
    if preset:
        return Engine.from_preset(preset_or_path, seed, config)
    return Engine.from_pretrained(preset_or_path, config)
