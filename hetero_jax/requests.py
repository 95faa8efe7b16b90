"""What a user asks for (plain Python, imports no jax): requests and their knobs.

`GenerateRequest(prompt, SamplingParams)` and `EmbedRequest(input, PoolingParams)` go into
`Engine.run`, `AsyncEngine` or `DedicatedEngine`; a prompt or input is a string (tokenized with
the model's tokenizer) or a list of token ids. The knobs are checked when they are made, so a
bad value raises here, naming the value and the limit.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one generation request samples. `temperature=0` is greedy; `top_k=0` means all.

    `logprobs=k` returns, for each generated token, its log-probability and the top-k
    alternatives (of the model's distribution, before temperature); `seed` fixes the request's
    random stream (None: fixed by the engine's seed and the request's id).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0 = no limit)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise ValueError(f"seed={self.seed!r} must be in [0, 2**32)")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs={self.logprobs!r} must be >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


STREAMING_KINDS = ("mean", "weighted_mean", "cls", "last")  # incremental over chunks
POOLING_KINDS = STREAMING_KINDS + ("buffered",)


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """How one embedding request pools its final hidden states (after the final norm).

    `mean` and `weighted_mean` (token j weighted by j, 1-based, as in SGPT) average over the
    input; `cls` takes the first token, `last` the last one; `buffered` applies the engine's
    `EngineConfig(buffered_head=...)` to all hidden states. `None` takes the model's default:
    a separate encoder's sentence-transformers configuration, else mean pooling, normalised.
    `truncate=True` keeps the first tokens of a longer input instead of rejecting it.
    `adapter` names a LoRA embedding adapter loaded with the engine (None: the engine's
    default adapter, if any).
    """

    pooling: str | None = None
    normalize: bool | None = None
    truncate: bool = False
    adapter: str | None = None

    def __post_init__(self):
        if self.pooling is not None and self.pooling not in POOLING_KINDS:
            raise ValueError(f"unknown pooling {self.pooling!r}; expected one of {POOLING_KINDS}")


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    prompt: str | list
    params: SamplingParams = SamplingParams()


@dataclasses.dataclass(frozen=True)
class EmbedRequest:
    input: str | list
    params: PoolingParams = PoolingParams()
