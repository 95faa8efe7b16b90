"""`generate`, `embed`, `encode` and `chat` over `run`, for every engine with a batch `run`
(Engine, DedicatedEngine, the replica sets), with vLLM's names and errors that name the caller's
mistake, and the forms their arguments take (a string, one list of token ids, or a list of them;
one params for all or one each) -> `GenerateRequest`s / `EmbedRequest`s. Imports nothing else
of `serving` (`chat` imports the server's sandboxed template renderer when called).
"""
from __future__ import annotations

import difflib
import numbers
from collections.abc import Iterable

import numpy as np

from hetero_jax.requests import (EmbedRequest, GenerateRequest, PoolingParams, SamplingParams,
                                 described, did_you_mean)


class BatchAPI:
    """Mixin: the subclass provides `run(requests, use_tqdm) -> outputs in input order` and
    `embedding_dim`; `tokenizer` (None: the engine has none here) gives `chat` its template."""

    embedding_dim: int
    tokenizer = None

    def run(self, requests: list, use_tqdm: bool = True) -> list:
        raise NotImplementedError

    def generate(self, prompts, params: SamplingParams | list | None = None,
                 use_tqdm: bool = True, **kwargs) -> list:
        """Prompts (strings or token-id lists) -> `RequestOutput`s in input order (`n` in a row
        for `SamplingParams(n=...)`); `params` (vLLM's `sampling_params=`) is one
        `SamplingParams` for all or one per prompt."""
        params = _vllm_keyword("generate", params, kwargs, "sampling_params", SamplingParams)
        return self.run(as_generate_requests(prompts, params), use_tqdm)

    def embed(self, inputs, params: PoolingParams | list | None = None,
              use_tqdm: bool = True, **kwargs) -> np.ndarray:
        """Strings or token-id lists -> `[N, d]` float32 in input order (`[0, d]` for none);
        `params` (vLLM's `pooling_params=`) is one `PoolingParams` for all or one per input.
        An input the engine failed raises here, naming it (`run` returns the others too)."""
        params = _vllm_keyword("embed", params, kwargs, "pooling_params", PoolingParams)
        outs = self.run(as_embed_requests(inputs, params), use_tqdm)
        failed = [(i, o.error) for i, o in enumerate(outs) if o.embedding is None]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(outs)} inputs failed; input "
                               f"{failed[0][0]}: {failed[0][1]}")
        if not outs:
            return np.zeros((0, self.embedding_dim), np.float32)
        return np.stack([o.embedding for o in outs])

    def encode(self, inputs, params: PoolingParams | list | None = None,
               use_tqdm: bool = True, **kwargs) -> np.ndarray:
        """vLLM's name for `embed` (the same call)."""
        return self.embed(inputs, params, use_tqdm, **kwargs)

    def chat(self, messages: list, params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             **kwargs) -> list:
        """One conversation (`[{"role", "content"}]`) or a list of them -> `RequestOutput`s,
        each prompt rendered by the tokenizer's chat template (`chat_template` overrides it;
        a tokenizer with none, or a preset's, gets `server.chat.DEFAULT_TEMPLATE`) in the
        server's jinja2 sandbox."""
        params = _vllm_keyword("chat", params, kwargs, "sampling_params", SamplingParams,
                               ("add_generation_prompt", "chat_template"))
        from hetero_jax.server.chat import ChatTemplate, special_tokens, template_of  # jinja2

        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        template = (ChatTemplate(chat_template, **special_tokens(self.tokenizer))
                    if chat_template else template_of(self.tokenizer))
        prompts = [template.render(list(c), add_generation_prompt) for c in conversations]
        return self.generate(prompts, params, use_tqdm)


def _vllm_keyword(call: str, params, kwargs: dict, vllm_name: str, params_cls,
                  more: tuple = ()):
    """`params`, or the same given as vLLM's keyword (`sampling_params=`, `pooling_params=`);
    any other keyword is a TypeError that says where it belongs: a field of `params_cls` goes
    inside one, anything else gets the closest name."""
    if vllm_name in kwargs:
        if params is not None:
            raise TypeError(f"{call}() got both params and {vllm_name}; pass one")
        params = kwargs.pop(vllm_name)
    name = params_cls.__name__
    for key, value in kwargs.items():
        fields = list(params_cls.__dataclass_fields__)
        if key in fields:
            raise TypeError(f"{call}() has no keyword {key!r}: it is a field of {name}; pass "
                            f"{name}({key}={value!r})")
        own = ["params", vllm_name, "use_tqdm", *more]
        close = difflib.get_close_matches(key, own + fields, n=1)
        if close and close[0] in fields:
            raise TypeError(f"{call}() has no keyword {key!r}; did you mean "
                            f"{name}({close[0]}=...)?")
        raise TypeError(f"{call}() has no keyword {key!r}{did_you_mean(key, own)}")
    return params


def _is_token_ids(xs) -> bool:
    """Whether `xs` is one prompt of token ids (OpenAI's `prompt: [1, 2, 3]`), not a list."""
    if isinstance(xs, np.ndarray):
        return xs.ndim == 1 and np.issubdtype(xs.dtype, np.integer)
    return isinstance(xs, (list, tuple)) and bool(xs) and all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in xs)


def _as_requests(xs, params, params_cls, request_cls, noun: str) -> list:
    """A string, one list of token ids, or a list of inputs, with one params for all (None:
    defaults) or one each; TypeError saying what was passed and what is expected."""
    if isinstance(xs, str) or _is_token_ids(xs):
        xs = [xs]
    elif isinstance(xs, (bytes, bytearray, dict)) or not isinstance(xs, Iterable):
        hint = " (decode bytes to a string first)" if isinstance(xs, (bytes, bytearray)) else ""
        raise TypeError(f"{noun} is {described(xs)}; expected a string, a list of token ids or "
                        f"a list of {noun}{hint}")
    xs = list(xs)
    want = f"{params_cls.__name__}, a list of them or None"
    if params is None or isinstance(params, params_cls):
        params = [params or params_cls()] * len(xs)
    elif not isinstance(params, (list, tuple)):
        raise _params_error("params", params, params_cls, want)
    bad = next((i for i, p in enumerate(params) if not isinstance(p, params_cls)), None)
    if bad is not None:
        raise _params_error(f"params {bad}", params[bad], params_cls, params_cls.__name__)
    if len(params) != len(xs):
        raise ValueError(f"got {len(params)} {params_cls.__name__} for {len(xs)} {noun}")
    return [request_cls(x, p) for x, p in zip(xs, params)]


def _params_error(label: str, value, params_cls, want: str) -> TypeError:
    """What was passed where `params_cls` goes, and the fix: the other params class belongs
    to the other call; a dict is not taken (as in vLLM) but builds one."""
    calls = {SamplingParams: "generate()", PoolingParams: "embed()"}
    other = PoolingParams if params_cls is SamplingParams else SamplingParams
    if isinstance(value, other):
        return TypeError(f"{label} is a {other.__name__}, which is for {calls[other]}; "
                         f"{calls[params_cls]} takes {params_cls.__name__}")
    hint = (f" (as in vLLM, a dict is not taken: {params_cls.__name__}(**params) builds one)"
            if isinstance(value, dict) else "")
    return TypeError(f"{label} is {described(value)}; expected {want}{hint}")


def as_generate_requests(prompts, params: SamplingParams | list | None) -> list:
    """`generate`'s arguments -> GenerateRequests."""
    return _as_requests(prompts, params, SamplingParams, GenerateRequest, "prompts")


def as_embed_requests(inputs, params: PoolingParams | list | None) -> list:
    """`embed`'s arguments -> EmbedRequests."""
    return _as_requests(inputs, params, PoolingParams, EmbedRequest, "inputs")
