"""Sampling on the device: greedy, temperature, top-k, top-p, a PRNG stream per request.

In: fp32 logits `[S, V]` and per-row knob arrays (never static, so a new request never
recompiles). Out: per row the sampled token, its log-prob and the K top ids and log-probs,
packed by `packed.PackedLayout.sample_rows` into the step's one device->host array.
Log-probs are those of the model's distribution (before temperature and truncation).
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from hetero_jax.runner.packed import PackedLayout


@flax.struct.dataclass
class SamplingKnobs:
    temperature: jax.Array  # [S] f32; 0 = greedy
    top_k: jax.Array  # [S] int32; 0 = no limit
    top_p: jax.Array  # [S] f32 in (0, 1]
    seed: jax.Array  # [S] uint32
    step: jax.Array  # [S] int32: index of the token being sampled within its request


def _row_keys(seed, step):
    return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(seed, step)


def _sample_filtered(logits, knobs: SamplingKnobs):
    """Temperature, then top-k and top-p over the sorted row, then one categorical draw."""
    v = logits.shape[-1]
    scaled = logits / jnp.maximum(knobs.temperature, 1e-6)[:, None]
    sorted_logits, order = jax.lax.top_k(scaled, v)  # [S, V] descending
    rank = jnp.arange(v)[None, :]
    keep = (knobs.top_k[:, None] == 0) | (rank < knobs.top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each rank
    keep &= (before < knobs.top_p[:, None]) | (rank == 0)
    masked = jnp.where(keep, sorted_logits, -jnp.inf)
    pick = jax.vmap(jax.random.categorical)(_row_keys(knobs.seed, knobs.step), masked)
    return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0]


def sample(logits, knobs: SamplingKnobs, num_logprobs: int):
    """logits [S, V] f32 -> rows [S, 2 + 2 * num_logprobs] f32 (`PackedLayout.sample_rows`)."""
    greedy = jnp.argmax(logits, axis=-1)
    tokens = jax.lax.cond(jnp.any(knobs.temperature > 0),
                          lambda: jnp.where(knobs.temperature > 0,
                                            _sample_filtered(logits, knobs), greedy),
                          lambda: greedy)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)
    top_lp, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    return PackedLayout.sample_rows(tokens, chosen[:, 0], top_ids, top_lp)
