"""Language-model training of every weight (`scripts/build_default_model.py`), with optax.

In: the params pytree (stacked layers, `llama.init_params`), documents as token arrays
`[B, S]` with loss weights `[B, S]` (the weight of predicting token j + 1 at position j; 0
on padding). `lm_step` is one jitted AdamW step over every weight, on the engine's weights and layer math (`llama.rms_norm`, `apply_rope`), with a plain dense causal
attention over whole sequences (`dense_logits`, equal to the paged `forward.lm_logits`, with no
cache writes or page gathers to differentiate); `LMState` (a `flax.struct`
pytree: step, params, optax state) is donated and returned. `lm_batches` cuts the documents
into a fixed, seeded order of length-sorted batches per epoch.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetero_jax.models import llama
from hetero_jax.models.config import ModelConfig


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


def _dense_layer(cfg: ModelConfig, h, lp: dict, cos, sin):
    """One decoder layer on whole sequences: h [B, S, d] -> [B, S, d] (`llama.Block`'s math
    with a plain causal softmax attention in place of the paged cache)."""
    b, s, _ = h.shape
    y = llama.rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
    q, k, v = y @ lp["wq"], y @ lp["wk"], y @ lp["wv"]
    if cfg.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = llama.apply_rope(q.reshape(b, s, cfg.num_heads, cfg.head_dim), cos, sin)
    k = llama.apply_rope(k.reshape(b, s, cfg.num_kv_heads, cfg.head_dim), cos, sin)
    o = jax.nn.dot_product_attention(q, k, v.reshape(b, s, cfg.num_kv_heads, cfg.head_dim),
                                     is_causal=True, implementation="xla")  # [B, S, Hq, D]
    h = h + o.reshape(b, s, -1) @ lp["wo"]
    y = llama.rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
    return h + (jax.nn.silu(y @ lp["w_gate"]) * (y @ lp["w_up"])) @ lp["w_down"]


def dense_logits(params, cfg: ModelConfig, tokens):
    """tokens [B, S] -> next-token logits [B, S, V] fp32: the engine's model on whole
    sequences (stacked layers, no adapter) with dense causal attention, for training;
    `forward.lm_logits` (the paged path) gives the same logits."""
    s = tokens.shape[1]
    cos, sin = llama.rope_tables(cfg, jnp.arange(s))  # [S, 1, D]
    h = params["embed"][tokens]  # [B, S, d]
    for i in range(cfg.num_layers):
        h = _dense_layer(cfg, h, {n: w[i] for n, w in params["layers"].items()}, cos, sin)
    h = llama.rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    return llama.lm_logits(params, cfg, h.reshape(-1, h.shape[-1])).reshape(*tokens.shape, -1)


def lm_loss(params, cfg: ModelConfig, tokens, mask):
    """tokens [B, S], mask [B, S] f32 (the weight of predicting tokens[:, j + 1] at position
    j) -> the weighted mean next-token cross-entropy."""
    logits = dense_logits(params, cfg, tokens)[:, :-1]  # [B, S-1, V]
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


def lm_batches(docs: list, batch_size: int, seed: int, epoch: int, pad_to: int = 64) -> list:
    """docs ((token ids, per-token weights) pairs) -> [(tokens [B, S] int32, weights [B, S]
    f32)] of one epoch: the docs in a seeded order, then sorted by length (stable), cut into
    batches of similar length, each padded to its longest doc rounded up to `pad_to` (few
    shapes, little padding: attention costs S^2), the batches in a seeded order. The last
    batch is filled up with the shortest docs, so every batch has `batch_size` rows. A doc's
    weight j is that of predicting its token j + 1."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(docs))
    order = order[np.argsort([len(docs[i][0]) for i in order], kind="stable")]
    order = np.concatenate([order, order[:-len(order) % batch_size]])
    out = []
    for i in range(0, len(order), batch_size):
        rows = [docs[d] for d in order[i:i + batch_size]]
        seq_len = -(-max(len(ids) for ids, _ in rows) // pad_to) * pad_to
        tokens = np.zeros((batch_size, seq_len), np.int32)
        mask = np.zeros((batch_size, seq_len), np.float32)
        for row, (ids, weights) in enumerate(rows):
            tokens[row, :len(ids)], mask[row, :len(ids) - 1] = ids, weights[:len(ids) - 1]
        out.append((tokens, mask))
    return [out[j] for j in rng.permutation(len(out))]
