"""OpenAI request fields -> engine knobs, and engine results -> OpenAI response bodies.

In: checked `protocol` models, `generation.Piece`s, `EmbeddingOutput`s, the tokenizer (to
name tokens in log-probs). Out: `SamplingParams` / `PoolingParams` and plain dicts in the
shapes of OpenAI's completion, chat completion, their stream chunks, and embedding responses.
Plain Python: imports no jax.
"""
from __future__ import annotations

import base64

import numpy as np

from hetero_jax.outputs import RequestError
from hetero_jax.requests import PoolingParams, SamplingParams

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def inputs_of(value, field: str) -> list:
    """A `prompt`/`input` -> a list of prompts (each a string or a list of token ids)."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    if not value:
        raise RequestError(0, field, f"{field} is empty: give a string, a list of strings, a "
                                     "list of token ids, or a list of such lists")
    return list(value)


def sampling_params(req, max_tokens: int, logprobs: int | None, seed: int | None):
    """The engine's knobs for one choice of a completion or chat request."""
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature,
                              top_k=req.top_k, top_p=req.top_p, seed=seed,
                              ignore_eos=req.ignore_eos, logprobs=logprobs,
                              cache_salt=req.cache_salt, stop=req.stop,
                              presence_penalty=req.presence_penalty,
                              frequency_penalty=req.frequency_penalty,
                              repetition_penalty=req.repetition_penalty)
    except ValueError as e:
        raise RequestError(0, "params", str(e)) from e


def pooling_params(req) -> PoolingParams:
    try:
        return PoolingParams(pooling=req.pooling, normalize=req.normalize,
                             truncate=req.truncate, adapter=req.adapter,
                             cache_salt=req.cache_salt)
    except ValueError as e:
        raise RequestError(0, "params", str(e)) from e


def usage(prompt_tokens: int, completion_tokens: int = 0, embedding: bool = False) -> dict:
    if embedding:
        return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _token(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def completion_logprobs(tokenizer, logprobs: list | None, offset: int) -> dict | None:
    """`RequestOutput.logprobs` -> the completions API's four lists (offsets from `offset`)."""
    if logprobs is None:
        return None
    tokens, top, offsets = [], [], []
    for lp in logprobs:
        tokens.append(_token(tokenizer, lp["id"]))
        top.append({_token(tokenizer, t): p for t, p in lp["top"]})
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [lp["logprob"] for lp in logprobs],
            "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tokenizer, logprobs: list | None) -> dict | None:
    """`RequestOutput.logprobs` -> the chat API's `{"content": [...]}`."""
    if logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = _token(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [dict(entry(lp["id"], lp["logprob"]),
                             top_logprobs=[entry(t, p) for t, p in lp["top"]])
                        for lp in logprobs]}


def with_ids(logprobs: list | None, token_ids: list) -> list | None:
    """Log-prob entries with the id of the token each belongs to."""
    return None if logprobs is None else [dict(lp, id=t) for lp, t in zip(logprobs, token_ids)]


def body(kind: str, request_id: str, model: str, choices: list, usage_: dict | None,
         created: int) -> dict:
    """A whole response or one stream chunk: `kind` is its OpenAI `object`, `created` its
    request's Unix time in seconds."""
    out = {"id": request_id, "object": kind, "created": created, "model": model,
           "choices": choices}
    if usage_ is not None or kind.endswith("chunk") or kind == "text_completion":
        out["usage"] = usage_
    return out


def embedding_body(outputs: list, model: str, encoding: str) -> dict:
    data = [{"object": "embedding", "index": i, "embedding": _encode(o.embedding, encoding)}
            for i, o in enumerate(outputs)]
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"object": "list", "data": data, "model": model,
            "usage": usage(tokens, embedding=True)}


def _encode(vector, encoding: str):
    v = np.asarray(vector, np.float32)  # [d]
    if encoding == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
    return v.tolist()
