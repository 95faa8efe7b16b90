"""One jitted train step of the LoRA embedding adapter, over the engine's frozen params.

Static: `AdapterConfig` (frozen, hashable: the pooler, the rank and targets, the optimizer's
knobs), a jit static argument. Dynamic: `TrainState` (a `flax.struct` pytree: the step, the
LoRA weights `{w: (a [L, in, r], b [L, r, out])}` and the optax state), donated to the step,
which returns the next one. The base params (stacked layers, as `llama.init_params` or a
model directory loads them) are read, never differentiated. The LoRA weights join them as the
one stacked adapter of `lora.merge_lora_layers` (`lora_a_<w> [L, 1, in, r]`, scale 1: the
PEFT export writes `lora_alpha = r`), so the step runs the very model the engine serves.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetero_jax.models.config import PROJECTIONS, ModelConfig
from hetero_jax.models.lora import merge_lora_layers, projection_dims
from hetero_jax.train.forward import POOLERS, embed
from hetero_jax.train.loss import contrastive_loss

ALL_TARGETS = PROJECTIONS


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    pooling: str = "mean"
    rank: int = 8
    targets: tuple = ALL_TARGETS
    learning_rate: float = 2e-3
    weight_decay: float = 0.0
    temperature: float = 0.05
    steps: int = 200  # the learning-rate schedule's length
    warmup: int = 10

    def __post_init__(self):
        assert self.pooling in POOLERS, f"{self.pooling=} not in {POOLERS}"
        bad = [t for t in self.targets if t not in ALL_TARGETS]
        assert not bad, f"{bad=}: targets must be among {ALL_TARGETS}"
        assert self.rank >= 1 and self.steps >= 1, f"{self.rank=}, {self.steps=} must be >= 1"


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # [] int32
    lora: dict  # w -> (a [L, in, r], b [L, r, out]) fp32
    opt_state: optax.OptState


def optimizer(ac: AdapterConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, ac.learning_rate, min(ac.warmup, ac.steps),
                                                  ac.steps, ac.learning_rate * 0.1)
    return optax.adamw(schedule, weight_decay=ac.weight_decay)


def init_lora(cfg: ModelConfig, ac: AdapterConfig, seed: int) -> dict:
    """A ~ U(+-1/sqrt(in)) as PEFT's default, B = 0: the untrained adapter is the base model."""
    rng, dims = np.random.default_rng(seed), projection_dims(cfg)
    out = {}
    for w in ac.targets:
        din, dout = dims[w]
        a = rng.uniform(-1, 1, (cfg.num_layers, din, ac.rank)).astype(np.float32) / np.sqrt(din)
        out[w] = (jnp.asarray(a), jnp.zeros((cfg.num_layers, ac.rank, dout), jnp.float32))
    return out


def init_state(cfg: ModelConfig, ac: AdapterConfig, seed: int) -> TrainState:
    lora = init_lora(cfg, ac, seed)
    return TrainState(step=jnp.int32(0), lora=lora, opt_state=optimizer(ac).init(lora))


def with_lora(params: dict, lora: dict) -> dict:
    """The base params (stacked layers) with `lora` as their one adapter (id 1, scale 1)."""
    stacked = {}
    for w, (a, b) in lora.items():
        stacked[f"lora_a_{w}"], stacked[f"lora_b_{w}"] = a[:, None], b[:, None]
    return dict(params, layers=merge_lora_layers(params["layers"], stacked))


def batch_loss(lora, params, cfg: ModelConfig, ac: AdapterConfig, batch: dict):
    """The contrastive loss of one batch: {q, q_len, p, p_len, pid} (tokens [B, S], lengths
    [B], passage ids [B])."""
    full = with_lora(params, lora)
    q = embed(full, cfg, batch["q"], batch["q_len"], ac.pooling)
    p = embed(full, cfg, batch["p"], batch["p_len"], ac.pooling)
    return contrastive_loss(q, p, batch["pid"], ac.temperature)


def _train_step(state: TrainState, params, batch: dict, cfg: ModelConfig, ac: AdapterConfig):
    loss, grads = jax.value_and_grad(batch_loss)(state.lora, params, cfg, ac, batch)
    updates, opt_state = optimizer(ac).update(grads, state.opt_state, state.lora)
    lora = optax.apply_updates(state.lora, updates)
    return state.replace(step=state.step + 1, lora=lora, opt_state=opt_state), loss


def jit_train_step(compiler_options: dict | None = None):
    """`_train_step` jitted, `cfg` and `ac` static, the state donated; `compiler_options`: XLA
    options for this function's compiles alone (the tests', whose other compiles take XLA's
    cheapest passes)."""
    return jax.jit(_train_step, static_argnames=("cfg", "ac"), donate_argnums=(0,),
                   compiler_options=compiler_options)


train_step = jit_train_step()
train_step.__doc__ = "(state, base params, batch, cfg, ac) -> (next state, loss []): one step."


_embed = jax.jit(embed, static_argnames=("cfg", "kind", "with_adapter"))


def embed_texts(params, cfg: ModelConfig, tokens, lengths, kind: str, lora: dict | None,
                chunk: int = 64) -> np.ndarray:
    """tokens [N, S], lengths [N] -> embeddings [N, d] (numpy), `chunk` rows per call; with
    `lora` through the adapter, else on the base weights."""
    full = with_lora(params, lora) if lora else params
    n, chunk = len(tokens), min(chunk, len(tokens))
    pad = -n % chunk  # every call the same shape: one compile
    tokens = np.concatenate([tokens, np.zeros((pad, tokens.shape[1]), tokens.dtype)])
    lengths = np.concatenate([lengths, np.ones((pad,), lengths.dtype)])
    out = [_embed(full, cfg=cfg, tokens=tokens[i:i + chunk], lengths=lengths[i:i + chunk],
                  kind=kind, with_adapter=lora is not None) for i in range(0, n + pad, chunk)]
    return np.concatenate([np.asarray(x) for x in out])[:n]
