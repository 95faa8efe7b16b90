"""The training forward pass: padded sequences through the engine's own Flax model.

In: the params pytree the engine serves (stacked layers, `llama.param_shapes`, optionally
with LoRA leaves `lora_a_<w> [L, 1, in, r]` / `lora_b_<w> [L, 1, r, out]`), tokens `[B, S]`
(each row a sequence, padded at its end) and `lengths [B]`. Each row is one sequence of the
engine's ragged paged attention with its own page of `S` slots, so the hidden states come from
the same `llama.LlamaModel` and attention function the engine steps; trailing padding never
reaches a real token (attention is causal). Out: final hidden states `[B, S, d]`
(`hidden_states`), pooled vectors `[B, d]` (`embed`: the engine's mean, weighted_mean, cls
and last poolers, `runner.pooler`'s definitions on one whole sequence), or LM logits.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hetero_jax.models import llama
from hetero_jax.models.config import ModelConfig
from hetero_jax.ops.attention import ragged_paged_attention
from hetero_jax.requests import STREAMING_KINDS
from hetero_jax.runner.pooler import l2_normalize

POOLERS = STREAMING_KINDS  # the poolers that sum over chunks: all but "buffered"


def hidden_states(params, cfg: ModelConfig, tokens, with_adapter: bool = False):
    """tokens [B, S] int32 -> final-norm hidden states [B, S, d] (fp32 in, fp32 out).

    `with_adapter`: every token takes adapter id 1 (the params' only stacked LoRA adapter)."""
    b, s = tokens.shape
    positions = jnp.tile(jnp.arange(s, dtype=jnp.int32), b)  # [B*S]
    pages = jnp.arange(1, b + 1, dtype=jnp.int32)  # page 0 stays unused, as in the engine
    slots = jnp.repeat(pages, s) * s + positions  # [B*S]
    kv = llama.KVCache.zeros(cfg, b + 1, s, jnp.float32)
    meta = llama.AttnMeta(kv_lens=jnp.full((b,), s, jnp.int32), page_indices=pages[:, None],
                          cu_q_lens=jnp.arange(b + 1, dtype=jnp.int32) * s,
                          num_seqs=jnp.int32(b))
    attn_fn = functools.partial(ragged_paged_attention, impl="xla", max_q_len=s,
                                num_multi_query_seqs=b)
    ids = jnp.ones((b * s,), jnp.int32) if with_adapter else None
    hidden, _ = llama.forward(params, cfg, tokens.reshape(-1), positions, slots, kv, meta,
                              attn_fn, ids)
    return hidden.reshape(b, s, -1)


def pool(hidden, lengths, kind: str):
    """hidden [B, S, d], lengths [B] -> [B, d] fp32 by the engine's pooler `kind`."""
    h = hidden.astype(jnp.float32)
    pos = jnp.arange(h.shape[1])[None, :]  # [1, S]
    inside = (pos < lengths[:, None]).astype(jnp.float32)  # [B, S]
    if kind == "mean":
        return (h * inside[..., None]).sum(1) / jnp.maximum(lengths, 1)[:, None]
    if kind == "weighted_mean":  # token j weighted by j (1-based), as in SGPT
        w = inside * (pos + 1)
        return (h * w[..., None]).sum(1) / jnp.maximum(w.sum(1), 1.0)[:, None]
    if kind == "cls":
        return h[:, 0]
    if kind == "last":
        return jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
    raise ValueError(f"unknown pooling {kind!r}; the trainer supports {POOLERS}")


def embed(params, cfg: ModelConfig, tokens, lengths, kind: str, with_adapter: bool = True):
    """tokens [B, S], lengths [B] -> L2-normalised embeddings [B, d] (as the engine's default
    `normalize=True`)."""
    return l2_normalize(pool(hidden_states(params, cfg, tokens, with_adapter), lengths, kind))


def lm_logits(params, cfg: ModelConfig, tokens):
    """tokens [B, S] -> next-token logits [B, S, V] fp32, on the base weights."""
    hidden = hidden_states(params, cfg, tokens)
    return llama.lm_logits(params, cfg, hidden.reshape(-1, hidden.shape[-1])).reshape(
        *tokens.shape, -1)
