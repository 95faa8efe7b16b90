"""Sampling on the device: penalties, greedy, temperature, top-k, top-p, a PRNG stream per request.

In: fp32 logits `[S, V]`, per-row knob arrays (never static, so a new request never
recompiles) and, for the penalties, the step's token table (`[num_pages * page_size]`: the id
of every token whose K/V is in the cache, at its KV slot) with the rows' page tables: a row's
history is read in place, as attention reads its K/V. vLLM's penalties (presence, frequency
over the generated tokens; repetition over prompt and output) change the logits before
greedy or temperature, inside a `lax.cond` that a step whose rows use none skips. Out: per
row the sampled token, its log-prob and the K top ids and log-probs, packed by
`packed.PackedLayout.sample_rows` into the step's one device->host array.
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
    presence: jax.Array  # [S] f32; 0 = off
    frequency: jax.Array  # [S] f32; 0 = off
    repetition: jax.Array  # [S] f32; 1 = off
    kv_len: jax.Array  # [S] int32: tokens of the row's request in the cache (its history)
    prompt_len: jax.Array  # [S] int32: of those, the prompt's (the rest are generated)

    @property
    def penalized(self) -> jax.Array:
        """[] bool: whether any row uses a penalty."""
        return jnp.any((self.presence != 0) | (self.frequency != 0) | (self.repetition != 1))


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


def token_counts(table, page_indices, knobs: SamplingKnobs, vocab: int, page_size: int):
    """table [num_pages * page_size] int32, page_indices [S, P] -> (output counts [S, V] f32,
    seen in prompt or output [S, V] bool) of each row's tokens below its `kv_len`."""
    s, p = page_indices.shape
    slots = page_indices[:, :, None] * page_size + jnp.arange(page_size)  # [S, P, page_size]
    ids = table[slots.reshape(s, p * page_size)]  # [S, P * page_size]: tokens by position
    pos = jnp.arange(p * page_size)[None, :]
    in_seq = pos < knobs.kv_len[:, None]
    generated = in_seq & (pos >= knobs.prompt_len[:, None])
    rows = jnp.broadcast_to(jnp.arange(s)[:, None], ids.shape)
    counts = jnp.zeros((s, vocab), jnp.float32).at[rows, ids].add(generated)
    seen = jnp.zeros((s, vocab), jnp.int32).at[rows, ids].add(in_seq) > 0
    return counts, seen


def penalize(logits, counts, seen, knobs: SamplingKnobs):
    """vLLM's order: repetition (a seen token's logit / r if positive, * r if not), then
    frequency * count and presence * (count > 0) subtracted. logits [S, V] -> [S, V]."""
    r = knobs.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    return (logits - knobs.frequency[:, None] * counts
            - knobs.presence[:, None] * (counts > 0).astype(jnp.float32))


def sample(logits, knobs: SamplingKnobs, num_logprobs: int, table, page_indices,
           page_size: int):
    """logits [S, V] f32 -> rows [S, 2 + 2 * num_logprobs] f32 (`PackedLayout.sample_rows`).
    `table` and `page_indices` (see `token_counts`) are read only when a row has a penalty."""
    def penalized():
        return penalize(logits, *token_counts(table, page_indices, knobs, logits.shape[-1],
                                              page_size), knobs)
    chosen_from = jax.lax.cond(knobs.penalized, penalized, lambda: logits)
    greedy = jnp.argmax(chosen_from, axis=-1)
    tokens = jax.lax.cond(jnp.any(knobs.temperature > 0),
                          lambda: jnp.where(knobs.temperature > 0,
                                            _sample_filtered(chosen_from, knobs), greedy),
                          lambda: greedy)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)
    top_lp, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    return PackedLayout.sample_rows(tokens, chosen[:, 0], top_ids, top_lp)
