"""`generate` and `embed` over `run`, for every engine with a batch `run` (Engine, DedicatedEngine,
the replica sets), and the forms their arguments take (a string, one list of token ids, or a
list of them; one params for all or one each) -> `GenerateRequest`s / `EmbedRequest`s.
Imports nothing else of `serving`.
"""
from __future__ import annotations

import numbers
from collections.abc import Iterable

import numpy as np

from hetero_jax.requests import (EmbedRequest, GenerateRequest, PoolingParams, SamplingParams,
                                 described)


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


def _is_token_ids(xs) -> bool:
    """Whether `xs` is one prompt of token ids (OpenAI's `prompt: [1, 2, 3]`), not a list."""
    if isinstance(xs, np.ndarray):
        return xs.ndim == 1 and np.issubdtype(xs.dtype, np.integer)
    return isinstance(xs, (list, tuple)) and bool(xs) and all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in xs)


def _as_requests(xs, params, params_cls, request_cls, noun: str) -> list:
    """A string, one list of token ids, or a list of inputs, with one params for all (None:
    defaults) or one each; TypeError saying what was passed and what is expected."""
    if isinstance(xs, str) or _is_token_ids(xs):
        xs = [xs]
    elif isinstance(xs, (bytes, bytearray, dict)) or not isinstance(xs, Iterable):
        hint = " (decode bytes to a string first)" if isinstance(xs, (bytes, bytearray)) else ""
        raise TypeError(f"{noun} is {described(xs)}; expected a string, a list of token ids or "
                        f"a list of {noun}{hint}")
    xs = list(xs)
    want = f"{params_cls.__name__}, a list of them or None"
    if params is None or isinstance(params, params_cls):
        params = [params or params_cls()] * len(xs)
    elif not isinstance(params, (list, tuple)):
        hint = (f" ({params_cls.__name__}(**params) builds one from a dict)"
                if isinstance(params, dict) else "")
        raise TypeError(f"params is {described(params)}; expected {want}{hint}")
    bad = next((i for i, p in enumerate(params) if not isinstance(p, params_cls)), None)
    if bad is not None:
        raise TypeError(f"params {bad} is {described(params[bad])}; expected "
                        f"{params_cls.__name__}")
    if len(params) != len(xs):
        raise ValueError(f"got {len(params)} {params_cls.__name__} for {len(xs)} {noun}")
    return [request_cls(x, p) for x, p in zip(xs, params)]


def as_generate_requests(prompts, params: SamplingParams | list | None) -> list:
    """`generate`'s arguments -> GenerateRequests."""
    return _as_requests(prompts, params, SamplingParams, GenerateRequest, "prompts")


def as_embed_requests(inputs, params: PoolingParams | list | None) -> list:
    """`embed`'s arguments -> EmbedRequests."""
    return _as_requests(inputs, params, PoolingParams, EmbedRequest, "inputs")
