"""A separate embedding model beside the decoder: its runner, tokenizer and default pooling.

In: a local sentence-transformers / Hugging Face BERT directory. Out: a `SeparateEncoder`
whose `runner` embeds the scheduler's encoder items, with what the engine's input processor
checks embedding inputs against (its `input_processor.EmbeddingModel`): its tokenizer and
vocabulary, its input limit (sentence-transformers' `max_seq_length`, within the position
limit) and the directory's pooling and normalisation.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from hetero_jax.models.formats.hf_bert import load_bert
from hetero_jax.models.formats.sentence_transformers import (read_max_seq_length,
                                                             read_sentence_transformers_pooling)
from hetero_jax.models.presets import require_local_dir
from hetero_jax.models.tokenizer import load_tokenizer
from hetero_jax.runner.encoder import EncoderRunner


@dataclasses.dataclass
class SeparateEncoder:
    runner: EncoderRunner
    tokenizer: object
    pooling: str
    normalize: bool
    max_len: int  # sentence-transformers' max_seq_length, at most the position limit

    @classmethod
    def from_pretrained(cls, model_dir: str, dtype=jnp.float32) -> "SeparateEncoder":
        cfg, params = load_bert(require_local_dir(model_dir, "embedding model"), dtype)
        pooling, normalize = read_sentence_transformers_pooling(model_dir)
        limit = min(read_max_seq_length(model_dir) or cfg.max_position_embeddings,
                    cfg.max_position_embeddings)
        return cls(EncoderRunner(cfg, params), load_tokenizer(model_dir, ()), pooling, normalize,
                   limit)

