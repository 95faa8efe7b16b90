"""Incremental detokenizing, and stop strings (vLLM's `SamplingParams(stop=...)`) on it.

`text_delta` decodes the text a few new ids add (streaming). For stop strings, in: a
`sched.Request` with `stop_strings`, after a step appended its token, and the tokenizer. Out:
the request's `text` grown by the new ids' text (`text_delta`) and, when a stop string appears,
`stop_at`, the index where the text is cut (the stop string is not part of the output; the ids
keep the token that completed it, as transformers' `generate(stop_strings=...)` does).
`Engine.step` calls `scan` on the step's requests on the engine's thread and ends a stopped one
with `finish_reason="stop"`; `safe_text` is what a front may stream before the request ends
(nothing that could still begin a stop string), so the streamed text is always a prefix of the
final one.
"""
from __future__ import annotations

from hetero_jax.sched import Request

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


def find_stop(text: str, stops: tuple, start: int) -> int | None:
    """The first index at or after `start` where one of `stops` begins in `text`, or None."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None


def hold(stops: tuple) -> int:
    """Characters at the end of the text that could still begin a stop string."""
    return max(len(s) for s in stops) - 1


def scan(req: Request, tokenizer) -> bool:
    """Decode `req`'s new output ids into `req.text` and look for a stop string in what they
    could complete; -> whether one was found (then `req.stop_at` is set)."""
    if not req.stop_strings or req.stop_at is not None:
        return False
    seen = len(req.text)
    piece, req.text_read = text_delta(tokenizer, req.output_token_ids, req.text_read)
    req.text += piece
    req.stop_at = find_stop(req.text, req.stop_strings, max(seen - hold(req.stop_strings), 0))
    return req.stop_at is not None


def safe_text(req: Request) -> str:
    """The text of a request with stop strings that can be sent before it ends."""
    if req.stop_at is not None:
        return req.text[:req.stop_at]
    return req.text[:max(len(req.text) - hold(req.stop_strings), 0)]
