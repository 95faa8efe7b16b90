"""The OpenAI request bodies the server accepts, as pydantic models (imports no jax).

In: the JSON body of a request. Out: a checked model, or a pydantic `ValidationError` that
`errors.py` answers with 400 and the first field at fault. Types are strict (a string is not a
number, a float is not an integer); an unknown field is refused, so a misspelt knob is an error
rather than silently ignored. Fields of the OpenAI API this engine does not implement
(`logit_bias`, `echo`, `suffix`, `best_of` other than `n`, tools) are accepted only at their
neutral value. Extra, documented fields: `top_k`, `repetition_penalty`, `ignore_eos`,
`cache_salt` and `return_token_ids` for generation; `pooling`, `normalize`, `truncate`,
`adapter` and `cache_salt` for embeddings.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = StrictInt | StrictFloat
TokenIds = list[StrictInt]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictModel):
    include_usage: StrictBool = False


class SamplingFields(StrictModel):
    """What completions and chat share."""

    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number = Field(1.0, ge=0, le=2)
    top_p: Number = Field(1.0, gt=0, le=1)
    n: StrictInt = Field(1, ge=1, le=16)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(None, ge=0, le=2**32 - 1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Number = Field(0, ge=-2, le=2)
    frequency_penalty: Number = Field(0, ge=-2, le=2)
    repetition_penalty: Number = Field(1, gt=0)  # extra, as in vLLM
    logit_bias: dict[str, Number] | None = Field(None, max_length=0)
    user: StrictStr | None = None
    top_k: StrictInt = Field(0, ge=0)  # extra: 0 means all tokens
    ignore_eos: StrictBool = False  # extra
    cache_salt: StrictStr | None = None  # extra: keeps this tenant's prefix cache apart
    return_token_ids: StrictBool = False  # extra: each choice (and chunk) gets "token_ids"


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False
    suffix: None = None
    best_of: StrictInt | None = Field(None, ge=1)


class TextPart(StrictModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    add_generation_prompt: StrictBool = True  # extra, as in vLLM


class EmbeddingRequest(StrictModel):
    model: StrictStr
    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, ge=1)
    user: StrictStr | None = None
    pooling: Literal["mean", "weighted_mean", "cls", "last"] | None = None  # extra
    normalize: StrictBool | None = None  # extra
    truncate: StrictBool = False  # extra: keep the first tokens of a longer input
    adapter: StrictStr | None = None  # extra: a LoRA embedding adapter loaded with the model
    cache_salt: StrictStr | None = None  # extra
