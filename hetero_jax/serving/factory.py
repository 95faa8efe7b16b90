"""`make_engine`: the public factory that picks the engine a config asks for.

`make_engine(preset_or_path, config)` returns a `DedicatedEngine` (two worker processes) when
`config.scheduler == "dedicated"`, else an `Engine` with that scheduling policy.
"""
from __future__ import annotations

import os

from hetero_jax.config import EngineConfig
from hetero_jax.models.presets import PRESETS
from hetero_jax.serving.dedicated import DedicatedEngine
from hetero_jax.serving.engine import Engine


def make_engine(preset_or_path: str, config: EngineConfig | None = None, seed: int = 0):
    """An engine for a preset name or a Hugging Face directory: a `DedicatedEngine` when
    `config.scheduler == "dedicated"`, else an `Engine` with that scheduling policy."""
    config = config or EngineConfig()
    dedicated = config.scheduler == "dedicated"
    if preset_or_path in PRESETS:
        if dedicated:
            return DedicatedEngine.from_preset(preset_or_path, seed, config)
        return Engine.from_preset(preset_or_path, seed, config)
    if not os.path.isdir(preset_or_path):
        raise ValueError(f"{preset_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                         "model directory")
    if dedicated:
        return DedicatedEngine.from_pretrained(preset_or_path, config)
    return Engine.from_pretrained(preset_or_path, config)
