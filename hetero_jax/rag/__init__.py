"""Retrieval on the engine: a device vector index (`index`) and the Iter-RetGen pipeline
(`iter_retgen`) over any `Front`: the `serving.client.EngineClient` (an `AsyncEngine`, `AsyncReplicas`, or
`AsyncDedicated`)."""
from hetero_jax.rag.index import VectorIndex, build_index, load_corpus
from hetero_jax.rag.iter_retgen import (Front, IterationResult, IterRetGenResult, QueryPlan,
                                        build_prompt, fit_prompt, iter_retgen_many,
                                        run_iter_retgen)

__all__ = ["VectorIndex", "build_index", "load_corpus", "Front", "IterationResult",
           "IterRetGenResult", "QueryPlan", "build_prompt", "fit_prompt", "iter_retgen_many",
           "run_iter_retgen"]
