"""hetero-jax: embedding and generation requests in one jitted transformer pass.

The top of the package holds what a user touches: the request types (`requests`), the output
types (`outputs`), `EngineConfig` (`config`) and the command line (`cli`). The wings below
hold the rest: `serving/` (the engine loop and its fronts), `sched/` (the host scheduler, no
jax), `runner/` (one jitted step), `models/`, `ops/`, `rag/`, `bench/` and `sim/`. Exports
are resolved lazily, so `import hetero_jax` and the user types import no jax.
"""
import importlib

_EXPORTS = {
    "Engine": "hetero_jax.serving.engine",
    "AsyncEngine": "hetero_jax.serving.async_engine",
    "DedicatedEngine": "hetero_jax.serving.dedicated",
    "make_engine": "hetero_jax.serving.factory",
    "EngineConfig": "hetero_jax.config",
    "SamplingParams": "hetero_jax.requests",
    "PoolingParams": "hetero_jax.requests",
    "GenerateRequest": "hetero_jax.requests",
    "EmbedRequest": "hetero_jax.requests",
    "RequestOutput": "hetero_jax.outputs",
    "EmbeddingOutput": "hetero_jax.outputs",
    "EngineStats": "hetero_jax.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hetero_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
