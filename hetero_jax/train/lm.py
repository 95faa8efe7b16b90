"""Language-model training of every weight (`scripts/build_default_model.py`), with optax.

In: the params pytree (stacked layers, `llama.init_params`), documents as token arrays
`[B, S]` with loss weights `[B, S]` (the weight of predicting token j + 1 at position j; 0
on padding). `lm_step` is one jitted AdamW step over every weight, on the same
`llama.LlamaModel` forward the engine serves (`forward.lm_logits`); `LMState` (a
`flax.struct` pytree: step, params, optax state) is donated and returned. `lm_batches` cuts
the documents into a fixed, seeded order of batches per epoch.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetero_jax.models.config import ModelConfig
from hetero_jax.train.forward import lm_logits


@dataclasses.dataclass(frozen=True)
class LMConfig:
    learning_rate: float = 3e-3
    steps: int = 600  # the schedule's length
    warmup: int = 30
    weight_decay: float = 0.01


@flax.struct.dataclass
class LMState:
    step: jax.Array  # [] int32
    params: dict
    opt_state: optax.OptState


def lm_optimizer(lc: LMConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, lc.learning_rate, lc.warmup, lc.steps,
                                                  lc.learning_rate * 0.05)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, weight_decay=lc.weight_decay))


def init_lm_state(params: dict, lc: LMConfig) -> LMState:
    return LMState(step=jnp.int32(0), params=params, opt_state=lm_optimizer(lc).init(params))


def lm_loss(params, cfg: ModelConfig, tokens, mask):
    """tokens [B, S], mask [B, S] f32 (the weight of predicting tokens[:, j + 1] at position
    j) -> the weighted mean next-token cross-entropy."""
    logits = lm_logits(params, cfg, tokens)[:, :-1]  # [B, S-1, V]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    m = mask[:, :-1].astype(jnp.float32)
    return (nll * m).sum() / jnp.maximum(m.sum(), 1.0)


def _lm_step(state: LMState, tokens, mask, cfg: ModelConfig, lc: LMConfig):
    loss, grads = jax.value_and_grad(lm_loss)(state.params, cfg, tokens, mask)
    updates, opt_state = lm_optimizer(lc).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), loss


lm_step = jax.jit(_lm_step, static_argnames=("cfg", "lc"), donate_argnums=(0,))
lm_step.__doc__ = "(state, tokens [B, S], mask [B, S], cfg, lc) -> (next state, loss [])."


def lm_batches(docs: list, batch_size: int, seq_len: int, seed: int, epoch: int):
    """docs ((token ids, per-token weights) pairs) -> [(tokens [B, S] int32, weights [B, S]
    f32)] of one epoch: the docs in a seeded order, each padded (or cut) to `seq_len`; the
    last batch is filled up with docs from the start of the order, so every batch has one
    shape. A doc's weight j is that of predicting its token j + 1."""
    order = np.random.default_rng([seed, epoch]).permutation(len(docs))
    order = np.concatenate([order, order[:-len(order) % batch_size]])
    out = []
    for i in range(0, len(order) - batch_size + 1, batch_size):
        tokens = np.zeros((batch_size, seq_len), np.int32)
        mask = np.zeros((batch_size, seq_len), np.float32)
        for row, d in enumerate(order[i:i + batch_size]):
            ids, weights = docs[d][0][:seq_len], docs[d][1][:seq_len]
            tokens[row, :len(ids)], mask[row, :len(ids) - 1] = ids, weights[:len(ids) - 1]
        out.append((tokens, mask))
    return out
