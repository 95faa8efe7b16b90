"""Output processor: a finished (or aborted) scheduler `Request` -> the user's output.

In: a `sched.Request` and the tokenizer that decodes generated ids (None: no text). Out: a
`RequestOutput` (token ids, text, log-probs as asked, finish reason, timing metrics) or an
`EmbeddingOutput` (the vector `[d]`, metrics); `error_output` for a request the engine failed
alone (its `error` says why); `renumbered` for an output another process made, numbered and
timed as this process's engine would. `delta` is what a step added to a running generation, for a
front that streams: new ids, their text and log-probs, read from the host-side request;
`merge_deltas` joins the deltas a consumer that fell behind finds queued into one.
"""
from __future__ import annotations

import dataclasses

from hetero_jax.models.detokenize import safe_text, text_delta
from hetero_jax.outputs import EmbeddingOutput, GenerateDelta, RequestOutput
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
    logprobs = _logprobs(req, 0)
    text = tokenizer.decode(req.output_token_ids) if tokenizer else None
    if req.stop_at is not None:
        text = req.text[:req.stop_at]
    metrics = dict(arrival_time=req.arrival_time, first_token_time=req.first_token_time,
                   finish_time=req.finish_time,
                   ttft_s=_since_arrival(req, req.first_token_time),
                   latency_s=_since_arrival(req, req.finish_time),
                   preemptions=req.num_preemptions, cached_tokens=req.num_cached_tokens)
    return RequestOutput(req.request_id, req.prompt_token_ids, list(req.output_token_ids),
                         text, req.finish_reason, logprobs, metrics)


def _logprobs(req: Request, start: int) -> list | None:
    """The log-probs of generated tokens `start:`, with the top-k the request asked for."""
    k = req.knobs.logprobs
    return None if k is None else [
        {"logprob": t.logprob, "top": list(zip(t.top_token_ids[:k], t.top_logprobs[:k]))}
        for t in req.output_logprobs[start:]]


def delta(req: Request, num_sent: int, read: int, tokenizer, request_id) -> tuple:
    """What a running generation added since its first `num_sent` ids -> (the delta, the new
    `read`). `read` is the front's cursor into the text already sent: the ids whose text went
    out, or, for a request with stop strings, the characters of its `safe_text`."""
    ids = req.output_token_ids
    if req.stop_strings:
        safe = safe_text(req)
        text, read = safe[read:], len(safe)
    else:
        text, read = text_delta(tokenizer, ids, read)
    return GenerateDelta(request_id, list(ids[num_sent:]), text, _logprobs(req, num_sent),
                         prompt_tokens=len(req.prompt_token_ids)), read


def final_delta(out: RequestOutput, num_sent: int, sent: str, request_id) -> GenerateDelta:
    """The last delta of a generation: what `out` holds beyond the `num_sent` ids (text
    `sent`) already streamed, and `out` itself."""
    text = out.text or ""
    return GenerateDelta(request_id, out.token_ids[num_sent:],
                         text[len(sent):] if text.startswith(sent) else "",
                         None if out.logprobs is None else out.logprobs[num_sent:], True, out,
                         len(out.prompt_token_ids))


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


def renumbered(out, request_id: int, start: float):
    """An output made in another process, with the engine-wide `request_id` and its times
    counted from `start` (perf_counter is system-wide, so the child's clock is ours)."""
    m = dict(out.metrics, arrival_time=start)
    for key, since in (("latency_s", "finish_time"), ("ttft_s", "first_token_time")):
        if key in m:
            m[key] = None if m.get(since) is None else m[since] - start
    return dataclasses.replace(out, request_id=request_id, metrics=m)


def merge_deltas(first: GenerateDelta, later: GenerateDelta) -> GenerateDelta:
    """Two deltas of one stream, in order -> one holding both (the later one's end and
    output), so a consumer behind the steps handles, encodes and sends one chunk, not many."""
    logprobs = None if first.logprobs is None else first.logprobs + (later.logprobs or [])
    return GenerateDelta(later.request_id, first.token_ids + later.token_ids,
                         first.text + later.text, logprobs, later.finished, later.output,
                         later.prompt_tokens)
