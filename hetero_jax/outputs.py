"""What a user gets back (plain Python, imports no jax): outputs, errors, the engine's counters.

`RequestOutput` answers a `GenerateRequest`, `EmbeddingOutput` an `EmbedRequest`, in the order
the requests were given; a streamed generation yields `GenerateDelta`s, one per step that gave
it tokens, the last one finished. Times are `time.perf_counter()` seconds; latencies are from
arrival. A request refused before it runs raises `RequestError(index, field, reason)`; one the
engine fails while running raises `RequestFailed(request_id, reason)` from a front (or comes
back with `finish_reason="error"` from `Engine.run`). Both carry their parts as data, so a
server maps them to a status without reading the message. A front that hands back many
requests' fates at once (the replicas' `collect`, the batch job's fronts) gives each as one
`RequestResult`: an output, or the `RequestError` that refused it.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list
    token_ids: list  # generated ids only
    text: str | None
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    logprobs: list | None  # per token: {"logprob", "top": [(token_id, logprob), ...]}
    # arrival_time, first_token_time, finish_time, ttft_s, latency_s, preemptions, and
    # cached_tokens: prompt tokens found in the prefix cache (not computed)
    metrics: dict
    error: str | None = None  # with finish_reason "error": what failed this request alone


@dataclasses.dataclass
class EmbeddingOutput:
    request_id: int
    prompt_token_ids: list
    embedding: object  # np.ndarray [d] float32 (None with finish_reason "error")
    finish_reason: str  # "embedded" | "abort" | "error"
    metrics: dict  # arrival_time, finish_time, latency_s, cached_tokens
    error: str | None = None  # with finish_reason "error": what failed this request alone


@dataclasses.dataclass
class GenerateDelta:
    """What one step added to a streamed generation (`EngineClient.generate`)."""

    request_id: object  # the caller's id for the request (the engine's, if it named none)
    token_ids: list  # the ids generated in this step
    text: str  # the text they add ("" while a multi-byte character is incomplete)
    logprobs: list | None  # per new token, as `RequestOutput.logprobs`
    finished: bool = False
    output: RequestOutput | None = None  # on the finished one: the whole output
    prompt_tokens: int = 0  # the prompt's length in tokens


class RequestError(ValueError):
    """A request refused before anything ran: `index` in the caller's list (0 alone), the
    `field` at fault ("prompt", "input", "params", or an API field such as "max_tokens") and
    the `reason`, naming the value and the limit.

    An error of the engine's checks names its request by index (`RequestError.naming`:
    "prompt 3 is empty" is the `noun` "prompt", index 3 and the `detail` " is empty"), so a
    front that checked the request in a list of its own renames it from these parts
    (`at(index)`, or `alone()` for a request with no list: "the prompt is empty"), never by
    reading the message."""

    def __init__(self, index: int, field: str, reason: str, noun: str | None = None,
                 detail: str | None = None):
        super().__init__(reason)
        self.index, self.field, self.reason = index, field, reason
        self.noun, self.detail = noun, detail

    @classmethod
    def naming(cls, noun: str, index: int, detail: str, field: str | None = None):
        """The error "{noun} {index}{detail}" (`field` defaults to the noun)."""
        return cls(index, field or noun, f"{noun} {index}{detail}", noun, detail)

    def at(self, index: int) -> "RequestError":
        """The same error for the request at `index` of the caller's list."""
        if self.noun is None:
            return RequestError(index, self.field, self.reason)
        return RequestError.naming(self.noun, index, self.detail, self.field)

    def alone(self) -> str:
        """The reason for a request that is not in a list ("the prompt is empty")."""
        return self.reason if self.noun is None else f"the {self.noun}{self.detail}"

    def __reduce__(self):  # crosses pipes and Ray calls with its parts
        return RequestError, (self.index, self.field, self.reason, self.noun, self.detail)


@dataclasses.dataclass
class RequestResult:
    """What became of one request a front took in: its `output` (with `finish_reason="error"`
    when it failed running), or, when the checks refused it before it ran, the `error`; or,
    for a streamed generation that goes on, the `delta` one step added (neither of those)."""

    output: RequestOutput | EmbeddingOutput | None = None
    error: RequestError | None = None
    delta: GenerateDelta | None = None


class RequestFailed(RuntimeError):
    """A request the engine failed while running it (the others went on)."""

    def __init__(self, request_id, reason: str):
        super().__init__(reason)
        self.request_id, self.reason = request_id, reason


@dataclasses.dataclass
class EngineStats:
    steps: int = 0
    scheduled_tokens: int = 0
    generated_tokens: int = 0
    step_time_s: float = 0.0  # the steps' own time, compiling left out (see compile_s)
    preemptions: int = 0
    compiles: int = 0  # step variants built in this process: compiled, or loaded from disk
    compile_loads: int = 0  # of those, loaded from the persistent compilation cache
    compile_s: float = 0.0  # spent compiling and loading variants, in steps and warm-up
    # prefix cache: admissions that looked up, the prompt tokens they asked for and found,
    # and cached pages evicted to make room
    cache_queries: int = 0
    cache_query_tokens: int = 0
    cache_hit_tokens: int = 0
    cache_evictions: int = 0
    cascade_steps: int = 0  # steps whose decodes read shared pages once per tile (cascade)
    # the batching policy's `stats()` after the last step, plain data: {"batching": its name}
    # for fcfs and lpm; feather adds "arm" (its (loss_limit, cap), "loss<=2,cap=max") and
    # "floor"; feather-bandit adds "rounds" played, the arm's "plays" and "mean_reward" (its
    # rounds' tokens/s over what they would have made holding back no decode and no
    # admission, 1.0 when they held none; None before it has played), "best_arm", "best_mean_reward"
    batching: dict = dataclasses.field(default_factory=dict)

    @property
    def cache_hit_rate(self) -> float:
        """Cached tokens over looked-up tokens (0 before any lookup)."""
        return self.cache_hit_tokens / self.cache_query_tokens if self.cache_query_tokens else 0.0


def sum_stats(stats: list) -> EngineStats:
    """Several engines' `EngineStats` as one: every numeric count summed (a field that is not
    a number, such as `batching`, stays at its default)."""
    total = EngineStats()
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in stats]
        if values and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                          for v in values):
            setattr(total, f.name, sum(values))
    return total
