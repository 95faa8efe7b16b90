"""What a user gets back (plain Python, imports no jax): outputs and the engine's counters.

`RequestOutput` answers a `GenerateRequest`, `EmbeddingOutput` an `EmbedRequest`, in the order
the requests were given. Times are `time.perf_counter()` seconds; latencies are from arrival.
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
    cascade_steps: int = 0  # decode steps that read shared pages once per tile (cascade)
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
