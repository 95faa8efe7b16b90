"""hetero-jax: embedding and generation requests in one jitted transformer pass.

Exports are resolved lazily so that `hetero_jax.sched` (host-only) imports no jax.
"""
import importlib

_EXPORTS = {
    "Engine": "hetero_jax.engine",
    "AsyncEngine": "hetero_jax.async_engine",
    "GenerateRequest": "hetero_jax.engine",
    "EmbedRequest": "hetero_jax.engine",
    "RequestOutput": "hetero_jax.engine",
    "EmbeddingOutput": "hetero_jax.engine",
    "PoolingParams": "hetero_jax.params",
    "EngineConfig": "hetero_jax.config",
    "SamplingParams": "hetero_jax.params",
    "make_engine": "hetero_jax.dedicated",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hetero_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
