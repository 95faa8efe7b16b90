"""`generate` and `embed` over `run`, for every engine with a batch `run` (Engine, DedicatedEngine).
"""
from __future__ import annotations

import numpy as np

from hetero_jax.requests import PoolingParams, SamplingParams
from hetero_jax.serving.input_processor import as_embed_requests, as_generate_requests


class BatchAPI:
    """Mixin: the subclass provides `run(requests, use_tqdm) -> outputs in input order` and
    `embedding_dim`."""

    embedding_dim: int

    def run(self, requests: list, use_tqdm: bool = True) -> list:
        raise NotImplementedError

    def generate(self, prompts, params: SamplingParams | list | None = None,
                 use_tqdm: bool = True) -> list:
        """Prompts (strings or token-id lists) -> `RequestOutput`s in input order; `params` is
        one `SamplingParams` for all or one per prompt."""
        return self.run(as_generate_requests(prompts, params), use_tqdm)

    def embed(self, inputs, params: PoolingParams | list | None = None,
              use_tqdm: bool = True) -> np.ndarray:
        """Strings or token-id lists -> `[N, d]` float32 in input order (`[0, d]` for none).
        An input the engine failed raises here, naming it (`run` returns the others too)."""
        outs = self.run(as_embed_requests(inputs, params), use_tqdm)
        failed = [(i, o.error) for i, o in enumerate(outs) if o.embedding is None]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(outs)} inputs failed; input "
                               f"{failed[0][0]}: {failed[0][1]}")
        if not outs:
            return np.zeros((0, self.embedding_dim), np.float32)
        return np.stack([o.embedding for o in outs])
