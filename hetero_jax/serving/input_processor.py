"""Input processor: a user's requests -> checked, tokenized scheduler `Request`s.

In: `GenerateRequest`s / `EmbedRequest`s (strings or token-id lists, with their params), the
request's index in the caller's list (errors name it) and the engine-wide request id. Out:
`sched.Request`s with resolved knobs (`GenKnobs`: the seed fixed; `EmbedKnobs`: the pooling
kind, normalisation and adapter id of the embedding model's defaults). Everything a request
could fail on is checked here, before anything is queued, so a bad input raises a ValueError
naming the value and the limit and the engine stays usable. Shared by `Engine` (and through
it `AsyncEngine`) and `DedicatedEngine`.
"""
from __future__ import annotations

import dataclasses
import numbers
import reprlib
import time

import numpy as np

from hetero_jax.config import EngineConfig
from hetero_jax.models.config import ModelConfig
from hetero_jax.outputs import RequestError
from hetero_jax.requests import (POOLING_KINDS, EmbedRequest, GenerateRequest, PoolingParams,
                                 SamplingParams, described, sample_seed)
from hetero_jax.sched import EMBED, EmbedKnobs, GenKnobs, Request
from hetero_jax.sched.hashing import chain_seed


def default_seed(engine_seed: int, request_id: int) -> int:
    """The sampling seed of a request that names none: fixed by the engine's seed and the
    request's id, so a rerun of the same requests samples the same tokens."""
    return (engine_seed * 1_000_003 + request_id) % 2**32


def check_request_type(index: int, request) -> None:
    """A GenerateRequest with SamplingParams or an EmbedRequest with PoolingParams."""
    kinds = {GenerateRequest: SamplingParams, EmbedRequest: PoolingParams}
    if type(request) not in kinds:
        raise TypeError(f"request {index} is a {type(request).__name__}; expected "
                        "GenerateRequest or EmbedRequest")
    want = kinds[type(request)]
    if not isinstance(request.params, want):
        raise TypeError(f"request {index}: {type(request).__name__}.params is a "
                        f"{type(request.params).__name__}; expected {want.__name__}")


def check_generation(index: int, sp: SamplingParams, max_model_len: int, tokenizer) -> None:
    """What a generation's knobs ask beyond the engine: a max_tokens no prompt leaves room
    for, stop strings without a tokenizer, n > 1 outside a batch call."""
    if sp.max_tokens >= max_model_len:
        raise RequestError.naming("prompt", index, f": max_tokens={sp.max_tokens} exceeds "
                                  f"max_model_len={max_model_len} (prompt and output together; "
                                  f"at most {max_model_len - 1})", "max_tokens")
    if sp.stop and tokenizer is None:
        raise RequestError.naming("prompt", index, ": stop strings need a tokenizer (this "
                                  "model has none; use stop_token_ids)", "stop")
    if sp.n > 1:
        raise RequestError.naming("prompt", index, f": n={sp.n} is served by generate() and "
                                  "run(), which return n outputs per prompt; a streaming front "
                                  "takes n=1 per stream", "n")


def expand_samples(requests: list) -> list:
    """Each GenerateRequest with `n` > 1 as n requests of n=1 in its place (prompt-major), the
    j-th seeded with `sample_seed(seed, j)`; they share the prompt's cached pages."""
    out = []
    for r in requests:
        if isinstance(r, GenerateRequest) and isinstance(r.params, SamplingParams) \
                and r.params.n > 1:
            out += [GenerateRequest(r.prompt, dataclasses.replace(
                r.params, n=1, seed=sample_seed(r.params.seed, j))) for j in range(r.params.n)]
        else:
            out.append(r)
    return out


def _ids_of(index: int, text, kind: str) -> list:
    """Token ids given as a list/tuple of Python or numpy integers, or a 1-D integer array."""
    if isinstance(text, np.ndarray):
        if text.ndim != 1 or not np.issubdtype(text.dtype, np.integer):
            raise RequestError.naming(kind, index,
                                      f" is an array of shape {text.shape} and dtype "
                                      f"{text.dtype}; expected a 1-D integer array")
        return text.tolist()
    if not isinstance(text, (list, tuple)):
        hint = " (decode bytes to a string first)" if isinstance(text, (bytes, bytearray)) else ""
        raise RequestError.naming(kind, index, f" is {described(text)}; expected a string or "
                                  f"a list of token ids{hint}")
    for i, t in enumerate(text):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise RequestError.naming(kind, index,
                                      f": token {i} is {reprlib.repr(t)} ({type(t).__name__}); "
                                      "expected an integer token id")
    return [int(t) for t in text]


def tokenize(index: int, text, tokenizer, vocab: int, kind: str) -> list:
    """A string or token ids -> checked token ids; `kind` ("prompt", "input") names it."""
    if isinstance(text, str):
        if tokenizer is None:
            raise RequestError.naming(kind, index, " is a string but the model has no "
                                      "tokenizer; pass token ids")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError.naming(kind, index, f" is not valid Unicode ({e.reason} at "
                                      f"character {e.start})") from None
        ids = tokenizer.encode(text) if text else []
    else:
        ids = _ids_of(index, text, kind)
    if not ids:
        raise RequestError.naming(kind, index, " is empty")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise RequestError.naming(kind, index, f": token id {bad[0]} outside [0, {vocab})")
    return ids


def truncate(ids: list, limit: int, tokenizer) -> list:
    """The first `limit` ids; a closing special token (BERT's [SEP]) stays last, as the
    tokenizer's own truncation keeps it."""
    if len(ids) <= limit:
        return ids
    special = getattr(tokenizer, "special_token_ids", frozenset())
    return ids[:limit - 1] + ids[-1:] if ids[-1] in special else ids[:limit]


@dataclasses.dataclass(frozen=True)
class EmbeddingModel:
    """What embedding inputs are checked against: the model that embeds them."""

    tokenizer: object
    vocab_size: int
    max_len: int  # "the embedding limit"
    pooling: str  # defaults, when PoolingParams leaves them None
    normalize: bool
    on_decoder: bool  # the decoder embeds (chunked, buffered head possible)


class InputProcessor:
    def __init__(self, model_cfg: ModelConfig, config: EngineConfig, tokenizer,
                 embedding: EmbeddingModel, adapter_ids: dict, cache_identity: bytes | None = None,
                 adapter_digests: dict | None = None):
        """`config` is resolved; `adapter_ids` maps LoRA adapter names to ids (0 = base).
        `cache_identity` seeds every prefix-cache chain (None: no prefix caching);
        `adapter_digests` maps adapter ids to digests of their weights."""
        self.model_cfg, self.config, self.tokenizer = model_cfg, config, tokenizer
        self.embedding, self.adapter_ids = embedding, adapter_ids
        self.cache_identity, self.adapter_digests = cache_identity, adapter_digests or {}

    def _cache_seed(self, salt: str | None, adapter_id: int = 0) -> bytes | None:
        """The chain seed of a request's pages: the engine's identity, the adapter its
        tokens run on (name and weight digest, never the slot) and its salt."""
        if self.cache_identity is None:
            return None
        name = next((n for n, i in self.adapter_ids.items() if i == adapter_id), None)
        return chain_seed(self.cache_identity, name, self.adapter_digests.get(adapter_id), salt)

    def process(self, index: int, request, request_id: int) -> Request:
        check_request_type(index, request)
        if isinstance(request, EmbedRequest):
            return self._embed(index, request_id, request)
        sp = request.params
        if sp.logprobs is not None and sp.logprobs > self.config.max_logprobs:
            raise RequestError.naming("prompt", index,
                                      f": logprobs={sp.logprobs} exceeds "
                                      f"max_logprobs={self.config.max_logprobs}")
        vocab = self.model_cfg.vocab_size
        ids = tokenize(index, request.prompt, self.tokenizer, vocab, "prompt")
        bad = [t for t in sp.stop_token_ids if t >= vocab]
        if bad:
            raise RequestError.naming("prompt", index, f": stop token id {bad[0]} outside "
                                      f"[0, {vocab})")
        if len(ids) >= self.config.max_model_len:
            raise RequestError.naming("prompt", index,
                                      f" has {len(ids)} tokens; "
                                      f"max_model_len={self.config.max_model_len} leaves no room "
                                      "to generate")
        check_generation(index, sp, self.config.max_model_len, self.tokenizer)
        eos = () if sp.ignore_eos else self.model_cfg.eos_token_ids
        seed = sp.seed if sp.seed is not None else default_seed(self.config.seed, request_id)
        return Request(request_id=request_id, prompt_token_ids=ids, max_tokens=sp.max_tokens,
                       stop_token_ids=frozenset(sp.stop_token_ids) | frozenset(eos),
                       arrival_time=time.perf_counter(), cache_seed=self._cache_seed(sp.cache_salt),
                       knobs=GenKnobs(sp.temperature, sp.top_k, sp.top_p, seed, sp.logprobs,
                                      sp.presence_penalty, sp.frequency_penalty,
                                      sp.repetition_penalty),
                       stop_strings=sp.stop)

    def _embed(self, index: int, request_id: int, r: EmbedRequest) -> Request:
        pp, model = r.params, self.embedding
        ids = tokenize(index, r.input, model.tokenizer, model.vocab_size, "input")
        if len(ids) > model.max_len:
            if not pp.truncate:
                raise RequestError.naming("input", index,
                                          f" has {len(ids)} tokens > the embedding limit "
                                          f"{model.max_len} (PoolingParams(truncate=True) keeps "
                                          "the first ones)")
            ids = truncate(ids, model.max_len, model.tokenizer)
        pooling = pp.pooling or model.pooling
        normalize = model.normalize if pp.normalize is None else pp.normalize
        if pooling == "buffered" and not (model.on_decoder and self.config.buffered_head):
            raise RequestError.naming("input", index,
                                      ": pooling='buffered' needs "
                                      "EngineConfig(buffered_head=...) and the decoder as "
                                      "embedding model")
        adapter_id = self._adapter_id(index, pp.adapter)
        cacheable = model.on_decoder and pooling != "buffered"  # a buffered head needs all rows
        return Request(request_id=request_id, prompt_token_ids=ids, kind=EMBED,
                       arrival_time=time.perf_counter(),
                       cache_seed=self._cache_seed(pp.cache_salt, adapter_id) if cacheable
                       else None,
                       knobs=EmbedKnobs(POOLING_KINDS.index(pooling), normalize, adapter_id))

    def _adapter_id(self, index: int, name: str | None) -> int:
        """The adapter id of an embedding request: its named adapter, else the first one."""
        if name is None:
            return 1 if self.adapter_ids else 0
        if name not in self.adapter_ids:
            raise RequestError.naming("input", index,
                                      f": unknown adapter {name!r}; loaded: "
                                      f"{sorted(self.adapter_ids) or 'none'}")
        return self.adapter_ids[name]
