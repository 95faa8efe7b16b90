"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2) as a Flax linen module over a params pytree.

In: a flat token axis `tokens [T]` with `positions [T]` and KV `slots [T]` (page * page_size +
offset, where the token's K/V is written), the paged KV cache, and the attention metadata of
the step. Out: final-norm hidden states `[T, d]` and the updated cache (an explicit argument and
result, never a flax variable: the runner donates it). `LlamaModel.logits` is the LM head.

    model = LlamaModel(cfg, attn_fn, unrolled=is_unrolled(params))
    hidden, kv = model.apply({"params": params}, tokens, positions, slots, kv, meta, adapter_ids)
    logits = model.apply({"params": params}, hidden, method=LlamaModel.logits)

The layers are one `Block`, either stacked on a leading axis and run by `nn.scan` (compile time
flat in depth) or, after `split_layers`, as the sibling blocks "0".."L-1" of an unrolled loop
(faster on a CPU, see `layers.split_layers`). `forward` and `lm_logits` are the same as plain functions.

Params pytree (weights stored as `[in, out]`):
  embed [V, d]; final_norm [d]; lm_head [d, V] unless tied;
  layers: attn_norm [L, d], wq [L, d, Hq*D], wk/wv [L, d, Hkv*D], wo [L, Hq*D, d],
          bq/bk/bv [L, H*D] (Qwen2 only), mlp_norm [L, d], w_gate/w_up [L, d, F], w_down [L, F, d],
          and with LoRA adapters (see lora.py) lora_a_<w> [L, A, in, r], lora_b_<w> [L, A, r, out]
          for each adapted projection <w>;
  or, unrolled, layers: {"0": {attn_norm [d], wq [d, Hq*D], ...}, "1": {...}, ...}.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.models.config import ModelConfig
from hetero_jax.models.layers import MLP_WEIGHTS, is_feature_major, is_unrolled
from hetero_jax.models.lora import lora_delta, projection_dims
from hetero_jax.ops.cascade import CascadeMeta
from hetero_jax.ops.pallas_attention import KernelPlan


@flax.struct.dataclass
class KVCache:
    k: jax.Array  # [L, P, page_size, Hkv, D]
    v: jax.Array  # [L, P, page_size, Hkv, D]

    @classmethod
    def zeros(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> "KVCache":
        shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


@flax.struct.dataclass
class AttnMeta:
    kv_lens: jax.Array  # [S]
    page_indices: jax.Array  # [S, pages_per_seq]
    cu_q_lens: jax.Array  # [S+1]
    num_seqs: jax.Array  # [] int32
    cascade: CascadeMeta | None = None  # decode sequences sharing pages: read them once per tile
    plan: KernelPlan | None = None  # the Pallas kernel's work lists, made once per step


def layer_shapes(cfg: ModelConfig) -> dict:
    d, f, l = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = dict(attn_norm=(l, d), wq=(l, d, q), wk=(l, d, kv), wv=(l, d, kv), wo=(l, q, d),
                  mlp_norm=(l, d), w_gate=(l, d, f), w_up=(l, d, f), w_down=(l, f, d))
    if cfg.qkv_bias:
        shapes.update(bq=(l, q), bk=(l, kv), bv=(l, kv))
    return shapes


def param_shapes(cfg: ModelConfig) -> dict:
    shapes = dict(embed=(cfg.vocab_size, cfg.hidden_size), final_norm=(cfg.hidden_size,),
                  layers=layer_shapes(cfg))
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    return shapes


def init_params(cfg: ModelConfig, seed: int, dtype=jnp.float32, on_host: bool = False) -> dict:
    """Random weights (normal, std 0.02; norms at one), deterministic in `seed`: on the default
    device, or `on_host` as numpy arrays of the same values (for the tensor-parallel runner,
    which puts each shard straight on its device)."""
    rng, xp = np.random.default_rng(seed), np if on_host else jnp

    def make(name, shape):
        if name.endswith("norm"):
            return xp.ones(shape, dtype)
        return xp.asarray(rng.standard_normal(shape, np.float32) * 0.02, dtype)

    shapes = param_shapes(cfg)
    params = {k: make(k, v) for k, v in shapes.items() if k != "layers"}
    params["layers"] = {k: make(k, v) for k, v in shapes["layers"].items()}
    return params


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """[D/2] inverse frequencies, with llama3 frequency scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    if not cfg.rope_scaling:
        return inv.astype(np.float32)
    rs = dict(cfg.rope_scaling)
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(cfg: ModelConfig, positions):
    """positions [T] -> cos, sin [T, 1, D] in the rotate-half layout of Hugging Face."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(cfg))[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb)[:, None, :], jnp.sin(emb)[:, None, :]


def apply_rope(x, cos, sin):
    """x [T, H, D] -> [T, H, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def rms_norm(x, weight, eps):
    """x [T, d] -> [T, d]: normalised in fp32, scaled, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def _init(name: str):
    """A param's initializer by name, as in `init_params`: norms at one, others normal(0.02).

    `LlamaModel.init` draws with it; `apply` only checks the params' shapes against it.
    """
    return nn.initializers.ones if name.endswith("norm") else nn.initializers.normal(0.02)


def _linear(lp, name, x, adapter_ids):
    """x [T, in] @ lp[name] [in, out], plus each token's LoRA delta where the layer has one."""
    y = x @ lp[name]
    if adapter_ids is not None and f"lora_a_{name}" in lp:
        y = y + lora_delta(x, lp[f"lora_a_{name}"], lp[f"lora_b_{name}"], adapter_ids)
    return y


def _mlp(lp, y, adapter_ids):
    """The gated MLP of y [T, d] -> [T, d] (row-major weights `w_gate`, `w_up`, `w_down`)."""
    gate, up = _linear(lp, "w_gate", y, adapter_ids), _linear(lp, "w_up", y, adapter_ids)
    return _linear(lp, "w_down", jax.nn.silu(gate) * up, adapter_ids)


def _mlp_feature_major(lp, y, adapter_ids):
    """`_mlp` over the transposed weights of `layers.feature_major_mlp` ([out, in]), on [d, T]
    activations; a token's LoRA delta is added transposed. The barriers keep XLA from folding
    the two transposes into the matmuls, which would put the weights' input dimension first
    again."""
    def lora(name, x_rows):
        if adapter_ids is None or f"lora_a_{name}" not in lp:
            return 0.0
        return lora_delta(x_rows, lp[f"lora_a_{name}"], lp[f"lora_b_{name}"], adapter_ids).T

    cols = jax.lax.optimization_barrier(y.T)  # [d, T]
    gate = lp["w_gate_t"] @ cols + lora("w_gate", y)
    up = lp["w_up_t"] @ cols + lora("w_up", y)
    act = jax.nn.silu(gate) * up  # [F, T]
    out = lp["w_down_t"] @ act + lora("w_down", act.T)
    return jax.lax.optimization_barrier(out).T


def _qkv(cfg, lp, x, adapter_ids=None):
    t = x.shape[0]
    q, k, v = (_linear(lp, w, x, adapter_ids) for w in ("wq", "wk", "wv"))
    if cfg.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    return (q.reshape(t, cfg.num_heads, cfg.head_dim),
            k.reshape(t, cfg.num_kv_heads, cfg.head_dim),
            v.reshape(t, cfg.num_kv_heads, cfg.head_dim))


@flax.struct.dataclass
class LayerInputs:
    """What every layer of a step reads besides its weights (the same for all layers)."""

    cos: jax.Array  # [T, 1, D]
    sin: jax.Array  # [T, 1, D]
    page: jax.Array  # [T] int32: the page of each token's K/V slot
    offset: jax.Array  # [T] int32: its offset within that page
    meta: AttnMeta
    adapter_ids: jax.Array | None  # [T] int32, or None: every token on the base weights


class Block(nn.Module):
    """One decoder layer: ((h [T, d], k_cache, v_cache), layer index, inputs) -> (same, None).

    k_cache/v_cache [L, P, page_size, Hkv, D]: the layer writes its tokens' K/V at
    `[layer, page, offset]` and attends over `[layer]`; the attention gets the whole cache and
    the layer index, so no layer's pages are sliced out (a copy) in front of a custom call.

    Params are `layer_shapes` without the layer axis (with `feature_mlp`, the MLP's as
    `<w>_t` [out, in]: `layers.feature_major_mlp`), plus the `lora_a_<w>` [A, in, r] /
    `lora_b_<w>` [A, r, out] leaves where the params carry them (never created here).
    """

    cfg: ModelConfig
    attn_fn: Callable
    feature_mlp: bool = False

    def _weights(self) -> dict:
        """This layer's params by name; LoRA leaves only where the params have them."""
        shapes = {name: shape[1:] for name, shape in layer_shapes(self.cfg).items()}
        if self.feature_mlp:
            shapes = {(f"{k}_t" if k in MLP_WEIGHTS else k): (v[::-1] if k in MLP_WEIGHTS else v)
                      for k, v in shapes.items()}
        lp = {name: self.param(name, _init(name), shape) for name, shape in shapes.items()}
        lora = (f"lora_{half}_{w}" for w in projection_dims(self.cfg) for half in "ab")
        lp.update({n: self.get_variable("params", n) for n in lora
                   if self.has_variable("params", n)})
        return lp

    @nn.compact
    def __call__(self, carry, layer, x: LayerInputs):
        cfg, (h, k_cache, v_cache), ids = self.cfg, carry, x.adapter_ids
        lp = self._weights()
        y = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
        q, k, v = _qkv(cfg, lp, y, ids)
        q, k = apply_rope(q, x.cos, x.sin), apply_rope(k, x.cos, x.sin)
        k_cache = k_cache.at[layer, x.page, x.offset].set(k.astype(k_cache.dtype))
        v_cache = v_cache.at[layer, x.page, x.offset].set(v.astype(v_cache.dtype))
        o = self.attn_fn(q, k_cache, v_cache, x.meta.kv_lens, x.meta.page_indices,
                         x.meta.cu_q_lens, x.meta.num_seqs, layer=layer, cascade=x.meta.cascade,
                         plan=x.meta.plan)
        h = h + _linear(lp, "wo", o.reshape(h.shape[0], -1).astype(h.dtype), ids)
        y = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
        h = h + (_mlp_feature_major if self.feature_mlp else _mlp)(lp, y, ids)
        return (h, k_cache, v_cache), None


# Stacked layers: one Block body, its params sliced along axis 0 by `lax.scan`.
ScannedBlocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=(0, nn.broadcast))


class UnrolledBlocks(nn.Module):
    """Blocks "0".."L-1" run by a Python loop: (h, k_cache, v_cache), inputs -> the same."""

    cfg: ModelConfig
    attn_fn: Callable
    feature_mlp: bool = False

    @nn.compact
    def __call__(self, carry, x: LayerInputs):
        for layer in range(self.cfg.num_layers):
            carry, _ = Block(self.cfg, self.attn_fn, self.feature_mlp, name=str(layer))(
                carry, layer, x)
        return carry


class LlamaModel(nn.Module):
    """The decoder (`__call__`) and its LM head (`logits`) over the params pytree above.

    `attn_fn(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, num_seqs, layer=, cascade=,
    plan=)` is a ragged paged attention over the stacked cache with its static hints bound
    (None when only `logits` runs); `unrolled` and `feature_mlp` must match the params layout
    (`is_unrolled`, `is_feature_major`).
    """

    cfg: ModelConfig
    attn_fn: Callable | None = None
    unrolled: bool = False
    feature_mlp: bool = False

    def setup(self):
        shapes = param_shapes(self.cfg)
        self.embed = self.param("embed", _init("embed"), shapes["embed"])
        self.final_norm = self.param("final_norm", _init("final_norm"), shapes["final_norm"])
        if not self.cfg.tie_word_embeddings:
            self.lm_head = self.param("lm_head", _init("lm_head"), shapes["lm_head"])
        blocks = UnrolledBlocks if self.unrolled else ScannedBlocks
        self.layers = blocks(self.cfg, self.attn_fn, self.feature_mlp)

    def __call__(self, tokens, positions, slots, kv: KVCache, meta: AttnMeta, adapter_ids=None):
        """tokens/positions/slots [T] -> hidden [T, d] after the final norm, updated KVCache.

        `adapter_ids [T]` int32 picks each token's LoRA adapter (0 = base; k = stacked index
        k-1); None runs every token on the base weights.
        """
        page_size = kv.k.shape[2]
        page, offset = slots // page_size, slots % page_size
        cos, sin = rope_tables(self.cfg, positions)
        x = LayerInputs(cos, sin, page, offset, meta, adapter_ids)
        carry = (self.embed[tokens], kv.k, kv.v)  # h [T, d]
        if self.unrolled:
            carry = self.layers(carry, x)
        else:
            carry, _ = self.layers(carry, jnp.arange(self.cfg.num_layers), x)
        h, k, v = carry
        return rms_norm(h, self.final_norm, self.cfg.rms_norm_eps), KVCache(k, v)

    def logits(self, hidden):
        """hidden [N, d] -> fp32 logits [N, V]."""
        head = self.embed.T if self.cfg.tie_word_embeddings else self.lm_head
        return jnp.dot(hidden, head, preferred_element_type=jnp.float32)


def forward(params, cfg: ModelConfig, tokens, positions, slots, kv: KVCache, meta: AttnMeta,
            attn_fn, adapter_ids=None):
    """`LlamaModel.__call__` as a function of the params (stacked or `split_layers`)."""
    model = LlamaModel(cfg, attn_fn, unrolled=is_unrolled(params),
                       feature_mlp=is_feature_major(params))
    return model.apply({"params": params}, tokens, positions, slots, kv, meta, adapter_ids)


def lm_logits(params, cfg: ModelConfig, hidden):
    """hidden [N, d] -> fp32 logits [N, V] (`LlamaModel.logits`)."""
    return LlamaModel(cfg).apply({"params": params}, hidden, method=LlamaModel.logits)
