"""What a user asks for (plain Python, imports no jax): requests and their knobs.

`GenerateRequest(prompt, SamplingParams)` and `EmbedRequest(input, PoolingParams)` go into
`Engine.run`, `AsyncEngine` or `DedicatedEngine`; a prompt or input is a string (tokenized with
the model's tokenizer) or a list of token ids. The knobs are checked when they are made, so a
bad value raises here, naming the value and the limit.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
import reprlib

INT32_MAX = 2**31 - 1  # the device arrays that carry per-request knobs are int32


def require_int(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
    """`value` as an int if it is a Python or numpy integer (not a bool) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={value!r} must be an integer, not {type(value).__name__}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name}={value!r} must be in [{lo}, {'inf' if hi is None else hi}]")
    return int(value)


def require_real(name: str, value) -> float:
    """`value` as a finite float if it is a real number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r} must be a number, not {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be finite")
    return float(value)


def require_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False, not {type(value).__name__}")
    return value


def _set(obj, name: str, value) -> None:
    object.__setattr__(obj, name, value)


def require_salt(value) -> None:
    """A `cache_salt`: None or a string."""
    if value is not None and not isinstance(value, str):
        raise ValueError(f"cache_salt={value!r} must be a string or None, not "
                         f"{type(value).__name__}")


def known_keywords(cls):
    """Class decorator: an unknown keyword to `cls(...)` raises a TypeError that names the
    closest field (`max_token` -> `max_tokens`) instead of the dataclass's bare one."""
    init, names = cls.__init__, [f.name for f in dataclasses.fields(cls)]

    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        for key in kwargs:
            if key not in names:
                raise TypeError(f"{cls.__name__} has no keyword {key!r}"
                                f"{did_you_mean(key, names)}")
        init(self, *args, **kwargs)
    cls.__init__ = checked
    return cls


def did_you_mean(key: str, names: list) -> str:
    """"; did you mean 'x'?" for the closest of `names`, else the list of them."""
    close = difflib.get_close_matches(key, names, n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; expected one of {', '.join(names)}"


def _stop_strings(stop) -> tuple:
    """`stop` as vLLM takes it (None, a string or a list of strings) -> a tuple of them."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop={stop!r} must be a string or a list of non-empty strings")
    return tuple(stop)


def _check_penalties(p) -> None:
    """vLLM's ranges: presence/frequency in [-2, 2], repetition > 0 (1 = off)."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = require_real(name, getattr(p, name))
        if not -2 <= value <= 2:
            raise ValueError(f"{name}={value!r} must be in [-2, 2]")
        _set(p, name, value)
    _set(p, "repetition_penalty", require_real("repetition_penalty", p.repetition_penalty))
    if p.repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty={p.repetition_penalty!r} must be > 0 (1 is off)")


MAX_N = 1024  # samples of one prompt in one request


def sample_seed(seed: int | None, j: int) -> int | None:
    """Sample (choice) j of a seeded request samples with seed + j (None: the engine picks)."""
    return None if seed is None else (seed + j) % 2**32


@known_keywords
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one generation request samples. `temperature=0` is greedy; `top_k=0` means all.

    `logprobs=k` returns, for each generated token, its log-probability and the top-k
    alternatives (of the model's distribution, before temperature); `seed` fixes the request's
    random stream (None: fixed by the engine's seed and the request's id). `cache_salt` keeps
    the request's prefix-cache entries apart from requests with another salt (tenants).
    Integers may be numpy integers; booleans must be `bool`.

    vLLM's knobs: `stop` strings end the text where one appears (checked on the detokenized
    text; the stop string is not in the output); `n` samples of the prompt (one output each,
    sharing the prompt's cached pages; with a `seed`, sample j uses seed + j);
    `presence_penalty` / `frequency_penalty` subtract from the logit of each token generated
    so far (once / per occurrence), `repetition_penalty` divides a positive logit (multiplies
    a negative one) of each token in the prompt or output; all before temperature.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    cache_salt: str | None = None
    stop: tuple = ()
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        _set(self, "max_tokens", require_int("max_tokens", self.max_tokens, 1, INT32_MAX))
        _set(self, "temperature", require_real("temperature", self.temperature))
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0")
        _set(self, "top_k", require_int("top_k", self.top_k, 0, INT32_MAX))
        _set(self, "top_p", require_real("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.seed is not None:
            _set(self, "seed", require_int("seed", self.seed, 0, 2**32 - 1))
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not isinstance(stops, (list, tuple, set,
                                                                      frozenset)):
            raise ValueError(f"stop_token_ids={stops!r} must be a list, tuple or set of token "
                             "ids")
        _set(self, "stop_token_ids", tuple(require_int(f"stop_token_ids[{i}]", t, 0, INT32_MAX)
                                           for i, t in enumerate(stops)))
        require_bool("ignore_eos", self.ignore_eos)
        if self.logprobs is not None:
            _set(self, "logprobs", require_int("logprobs", self.logprobs, 0, INT32_MAX))
        require_salt(self.cache_salt)
        _set(self, "stop", _stop_strings(self.stop))
        _set(self, "n", require_int("n", self.n, 1, MAX_N))
        _check_penalties(self)


STREAMING_KINDS = ("mean", "weighted_mean", "cls", "last")  # incremental over chunks
POOLING_KINDS = STREAMING_KINDS + ("buffered",)


@known_keywords
@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """How one embedding request pools its final hidden states (after the final norm).

    `mean` and `weighted_mean` (token j weighted by j, 1-based, as in SGPT) average over the
    input; `cls` takes the first token, `last` the last one; `buffered` applies the engine's
    `EngineConfig(buffered_head=...)` to all hidden states. `None` takes the model's default:
    a separate encoder's sentence-transformers configuration, else mean pooling, normalised.
    `truncate=True` keeps the first tokens of a longer input instead of rejecting it.
    `adapter` names a LoRA embedding adapter loaded with the engine (None: the engine's
    default adapter, if any). `cache_salt` as in `SamplingParams`.
    """

    pooling: str | None = None
    normalize: bool | None = None
    truncate: bool = False
    adapter: str | None = None
    cache_salt: str | None = None

    def __post_init__(self):
        if self.pooling is not None and self.pooling not in POOLING_KINDS:
            raise ValueError(f"unknown pooling {self.pooling!r}; expected one of {POOLING_KINDS}")
        if self.normalize is not None:
            require_bool("normalize", self.normalize)
        require_bool("truncate", self.truncate)
        if self.adapter is not None and not isinstance(self.adapter, str):
            raise ValueError(f"adapter={self.adapter!r} must be an adapter name (a string)")
        require_salt(self.cache_salt)


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    prompt: str | list
    params: SamplingParams = SamplingParams()


@dataclasses.dataclass(frozen=True)
class EmbedRequest:
    input: str | list
    params: PoolingParams = PoolingParams()


def described(value) -> str:
    """How an error names a value a caller passed: its kind and a short repr."""
    if value is None:
        return "None"
    if isinstance(value, type):
        return f"the class {value.__name__}"
    name = type(value).__name__
    article = "" if isinstance(value, (bytes, bytearray)) else (
        "an " if name[0] in "aeiou" else "a ")
    return f"{article}{name} ({reprlib.repr(value)})"
