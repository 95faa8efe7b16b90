"""Sampling on the device: penalties, greedy, temperature, top-k, top-p, a PRNG stream per request.

In: fp32 logits `[S, V]`, per-row knob arrays (never static, so a new request never
recompiles) and, for the penalties, the step's token table (`[num_pages * page_size]`: the id
of every token whose K/V is in the cache, at its KV slot) with the rows' page tables: a row's
history is read in place, as attention reads its K/V. vLLM's penalties (presence, frequency
over the generated tokens; repetition over prompt and output) change the logits before
greedy or temperature, only in a step where a row uses one (see below). Out: per
row the sampled token, its log-prob and the K top ids and log-probs, packed by
`packed.PackedLayout.sample_rows` into the step's one device->host array.
Log-probs are those of the model's distribution (before temperature and truncation).

Which parts run is decided on the host (`needs`, from the sampled rows' knobs), not by a
`lax.cond` on the device: on a GPU XLA runs a conditional from the host, which copies the
predicate back and waits for every kernel before it (0.9-1.7 ms a step on an H200: "The
second H200 run" in docs/results.md). So the step samples greedily and leaves the top K
log-probs out, and the runner re-samples a step where a row has a penalty, a temperature or
asks for log-probs with `sample(penalized=..., filtered=..., ranked=...)`, a second, small
executable on the step's logits.
"""
from __future__ import annotations

from typing import NamedTuple

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


class Needs(NamedTuple):
    """What a step's sampled rows ask past greedy sampling (all False: the step's own)."""

    penalized: bool  # a presence, frequency or repetition penalty
    filtered: bool  # a temperature above 0 (with top-k and top-p)
    ranked: bool  # top log-probs (SamplingParams.logprobs)


def needs(knobs: list) -> Needs:
    """The `GenKnobs` of a step's sampled rows -> what its re-sampler must do (one pass: the
    host asks it every step, of every sampled row)."""
    penalized = filtered = ranked = False
    for k in knobs:
        penalized = penalized or k.penalized
        filtered = filtered or k.temperature > 0
        ranked = ranked or bool(k.logprobs)
    return Needs(penalized, filtered, ranked)


def top_k(x, k: int, group: int = 2048, max_rows: int = 1024):
    """x [S, V] -> (values [S, k], ids [S, k]) as `lax.top_k` gives them (ties: the lower id
    first), in two rounds when V > 4 * group and the groups make at most `max_rows` rows: the
    top k of each group of `group` columns, then of those. On an H200 one round over rows of
    128,256 took 123 us at 1, 16 or 64 rows (a row is one thread block's work); two rounds
    took 14 us at 1 row (63 groups) and 71 us at 16 (1,008), but 257 us at 64 (4,032)."""
    s, v = x.shape
    groups = -(-v // group)
    if v <= 4 * group or k > group or s * groups > max_rows:
        return jax.lax.top_k(x, k)
    padded = jnp.pad(x, ((0, 0), (0, groups * group - v)), constant_values=-jnp.inf)
    values, ids = jax.lax.top_k(padded.reshape(s, groups, group), k)  # [S, G, k]
    ids = ids + (jnp.arange(groups) * group)[None, :, None]
    best, at = jax.lax.top_k(values.reshape(s, groups * k), k)  # a group's ids stay in order
    return best, jnp.take_along_axis(ids.reshape(s, groups * k), at, axis=-1)


def sample(logits, knobs: SamplingKnobs, num_logprobs: int, table, page_indices,
           page_size: int, *, penalized: bool = True, filtered: bool = True,
           ranked: bool = True):
    """logits [S, V] f32 -> rows [S, 2 + 2 * num_logprobs] f32 (`PackedLayout.sample_rows`).
    `penalized`: apply the rows' penalties (reading `table` and `page_indices`, see
    `token_counts`); `filtered`: draw the rows with a temperature; `ranked`: the top
    `num_logprobs` ids and log-probs (else zeros). All False: greedy, with the chosen token's
    log-prob. A row whose knobs ask for none gets the same token and log-prob either way
    (`needs` says which to ask)."""
    chosen_from = logits
    if penalized:
        chosen_from = penalize(logits, *token_counts(table, page_indices, knobs,
                                                     logits.shape[-1], page_size), knobs)
    tokens = jnp.argmax(chosen_from, axis=-1)
    if filtered:
        tokens = jnp.where(knobs.temperature > 0, _sample_filtered(chosen_from, knobs), tokens)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)
    if ranked:
        top_lp, top_ids = top_k(logprobs, num_logprobs)
    else:
        top_lp = top_ids = jnp.zeros((logits.shape[0], num_logprobs), jnp.float32)
    return PackedLayout.sample_rows(tokens, chosen[:, 0], top_ids, top_lp)
