"""Output processor: a finished (or aborted) scheduler `Request` -> the user's output.

In: a `sched.Request` and the tokenizer that decodes generated ids (None: no text). Out: a
`RequestOutput` (token ids, text, log-probs as asked, finish reason, timing metrics) or an
`EmbeddingOutput` (the vector `[d]`, metrics); `error_output` for a request the engine failed
alone (its `error` says why). `delta` is what a step added to a running generation, for a
front that streams: new ids, their text and log-probs, read from the host-side request;
`merge_deltas` joins the deltas a consumer that fell behind finds queued into one.
"""
from __future__ import annotations

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


_WINDOW = 6  # ids decoded again before the new ones: a character spans at most 4 bytes


def text_delta(tokenizer, token_ids: list, read: int) -> tuple[str, int]:
    """The text `token_ids` add past their first `read` ids (whose text went out already), and
    the new `read`: ("", read) while the text ends in an incomplete character (U+FFFD). Only a
    window of a few ids before `read` is decoded again, not every id, so a step costs each
    stream O(1) rather than O(its length) (incremental detokenizing, as vLLM's)."""
    if tokenizer is None:
        return "", read
    start = max(read - _WINDOW, 0)
    old, new = tokenizer.decode(token_ids[start:read]), tokenizer.decode(token_ids[start:])
    if new.endswith("\ufffd") or not new.startswith(old):
        return "", read
    return new[len(old):], len(token_ids)


def delta(req: Request, num_sent: int, read: int, tokenizer, request_id) -> tuple:
    """What a running generation added since its first `num_sent` ids (the text of its first
    `read` ids already sent) -> (the delta, the new `read`)."""
    ids = req.output_token_ids
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


def merge_deltas(first: GenerateDelta, later: GenerateDelta) -> GenerateDelta:
    """Two deltas of one stream, in order -> one holding both (the later one's end and
    output), so a consumer behind the steps handles, encodes and sends one chunk, not many."""
    logprobs = None if first.logprobs is None else first.logprobs + (later.logprobs or [])
    return GenerateDelta(later.request_id, first.token_ids + later.token_ids,
                         first.text + later.text, logprobs, later.finished, later.output,
                         later.prompt_tokens)
