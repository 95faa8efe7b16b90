"""Per-request parameters (plain Python, no jax): validated when a request is made."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one generation request samples. `temperature=0` is greedy; `top_k=0` means all."""

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
class GenKnobs:
    """Host copy of one generation request's sampling knobs; the runner packs them into arrays."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: int | None


@dataclasses.dataclass(frozen=True)
class EmbedKnobs:
    """Host copy of one embedding request's pooling knobs."""

    kind: int  # index into POOLING_KINDS
    normalize: bool
    adapter_id: int = 0  # 0 = base model


def default_seed(engine_seed: int, request_id: int) -> int:
    """The sampling seed of a request that names none: fixed by the engine's seed and the
    request's id, so a rerun of the same requests samples the same tokens."""
    return (engine_seed * 1_000_003 + request_id) % 2**32
