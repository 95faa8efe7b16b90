"""`generate`, `embed`, `encode` and `chat` over `run`, for every engine with a batch `run`
(Engine, DedicatedEngine), with vLLM's names and errors that name the caller's mistake.
"""
from __future__ import annotations

import difflib

import numpy as np

from hetero_jax.requests import PoolingParams, SamplingParams, did_you_mean
from hetero_jax.server.chat import ChatTemplate, special_tokens, template_of
from hetero_jax.serving.input_processor import as_embed_requests, as_generate_requests


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

