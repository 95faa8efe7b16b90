"""Output processor: a finished (or aborted) scheduler `Request` -> the user's output.

In: a `sched.Request` and the tokenizer that decodes generated ids (None: no text). Out: a
`RequestOutput` (token ids, text, log-probs as asked, finish reason, timing metrics) or an
`EmbeddingOutput` (the vector `[d]`, metrics); `error_output` for a request the engine failed
alone (its `error` says why).
"""
from __future__ import annotations

from hetero_jax.outputs import EmbeddingOutput, RequestOutput
from hetero_jax.sched import Request


def _since_arrival(req: Request, t: float | None) -> float | None:
    return None if t is None else t - req.arrival_time


def make_output(req: Request, tokenizer) -> RequestOutput | EmbeddingOutput:
    if req.is_embed:
        return EmbeddingOutput(req.request_id, req.prompt_token_ids, req.embedding,
                               req.finish_reason, dict(
                                   arrival_time=req.arrival_time, finish_time=req.finish_time,
                                   latency_s=_since_arrival(req, req.finish_time),
                                   cached_tokens=req.num_cached_tokens))
    k = req.knobs.logprobs
    logprobs = None if k is None else [
        {"logprob": t.logprob, "top": list(zip(t.top_token_ids[:k], t.top_logprobs[:k]))}
        for t in req.output_logprobs]
    text = tokenizer.decode(req.output_token_ids) if tokenizer else None
    metrics = dict(arrival_time=req.arrival_time, first_token_time=req.first_token_time,
                   finish_time=req.finish_time,
                   ttft_s=_since_arrival(req, req.first_token_time),
                   latency_s=_since_arrival(req, req.finish_time),
                   preemptions=req.num_preemptions, cached_tokens=req.num_cached_tokens)
    return RequestOutput(req.request_id, req.prompt_token_ids, list(req.output_token_ids),
                         text, req.finish_reason, logprobs, metrics)


def error_output(req: Request) -> RequestOutput | EmbeddingOutput:
    """The output of a request the engine failed alone: `finish_reason="error"`, no result."""
    message = f"request {req.request_id}: {type(req.error).__name__}: {req.error}"
    metrics = dict(arrival_time=req.arrival_time, finish_time=req.finish_time,
                   latency_s=_since_arrival(req, req.finish_time))
    if req.is_embed:
        return EmbeddingOutput(req.request_id, req.prompt_token_ids, None, "error", metrics,
                               error=message)
    return RequestOutput(req.request_id, req.prompt_token_ids, list(req.output_token_ids), None,
                         "error", None, metrics, error=message)
