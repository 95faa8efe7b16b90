"""A BERT-family encoder (Hugging Face `BertModel`) as a Flax linen module over a params pytree.

In: `token_ids [B, N]` right-padded and `lengths [B]`. Out: `last_hidden_state [B, N, d]`, with
bidirectional attention over each row's first `lengths[b]` tokens, token type 0 everywhere and
exact (erf) GELU, as transformers computes it:

    BertEncoder(cfg, unrolled=layers.is_unrolled(params)).apply({"params": params}, ids, lengths)

or `encode(params, cfg, token_ids, lengths)`. The layers are one `BertBlock`, stacked on a
leading axis and run by `nn.scan`, or the sibling blocks "0".."L-1" of an unrolled loop after
`layers.split_layers` (faster on a CPU). Checkpoints are read by `formats.hf_bert`.

Params pytree (weights stored as `[in, out]`):
  word_embed [V, d]; pos_embed [P, d]; type_embed [Tv, d]; embed_norm_w/embed_norm_b [d];
  layers: wq/wk/wv/wo [L, d, d], bq/bk/bv/bo [L, d], attn_norm_w/attn_norm_b [L, d],
          w_in [L, d, F], b_in [L, F], w_out [L, F, d], b_out [L, d], mlp_norm_w/mlp_norm_b [L, d];
  or, unrolled, layers: {"0": {wq [d, d], ...}, "1": {...}, ...}.
"""
from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from hetero_jax.models.layers import is_unrolled


@dataclasses.dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    def __post_init__(self):
        assert self.hidden_size % self.num_heads == 0, (
            f"hidden_size={self.hidden_size} must be a multiple of num_heads={self.num_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def param_shapes(cfg: BertConfig) -> dict:
    d, f, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    layers = {k: (n, d, d) for k in ("wq", "wk", "wv", "wo")}
    layers.update({k: (n, d) for k in ("bq", "bk", "bv", "bo", "attn_norm_w", "attn_norm_b",
                                      "b_out", "mlp_norm_w", "mlp_norm_b")})
    layers.update(w_in=(n, d, f), b_in=(n, f), w_out=(n, f, d))
    return dict(word_embed=(cfg.vocab_size, d), pos_embed=(cfg.max_position_embeddings, d),
                type_embed=(cfg.type_vocab_size, d), embed_norm_w=(d,), embed_norm_b=(d,),
                layers=layers)


def layer_norm(x, weight, bias, eps):
    """x [..., d] -> [..., d]: normalised in fp32, scaled and shifted, in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _init(name: str):
    """A param's initializer by name: norm scales at one, biases (bq.., b_in, b_out, *_b) at
    zero, other weights normal(0.02). `BertEncoder.init` draws with it; `apply` only checks
    the params' shapes against it."""
    if name.endswith("norm_w"):
        return nn.initializers.ones
    if name.startswith("b") or name.endswith("_b"):
        return nn.initializers.zeros
    return nn.initializers.normal(0.02)


def _attention(cfg: BertConfig, lp, x, key_bias):
    """x [B, N, d], key_bias [B, 1, 1, N] (0 or a large negative) -> [B, N, d]."""
    b, n, _ = x.shape
    split = lambda y: y.reshape(b, n, cfg.num_heads, cfg.head_dim)  # noqa: E731
    q, k, v = (split(x @ lp[w] + lp[bias]) for w, bias in (("wq", "bq"), ("wk", "bk"),
                                                          ("wv", "bv")))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(scores / math.sqrt(cfg.head_dim) + key_bias, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)  # [B, N, H, D]
    return o.reshape(b, n, cfg.hidden_size) @ lp["wo"] + lp["bo"]


class BertBlock(nn.Module):
    """One encoder layer: h [B, N, d], key_bias [B, 1, 1, N] -> (h [B, N, d], None).

    Params are the `layers` shapes of `param_shapes` without the layer axis.
    """

    cfg: BertConfig

    @nn.compact
    def __call__(self, h, key_bias):
        cfg, eps = self.cfg, self.cfg.layer_norm_eps
        lp = {name: self.param(name, _init(name), shape[1:])
              for name, shape in param_shapes(cfg)["layers"].items()}
        h = layer_norm(h + _attention(cfg, lp, h, key_bias), lp["attn_norm_w"],
                       lp["attn_norm_b"], eps)
        mlp = jax.nn.gelu(h @ lp["w_in"] + lp["b_in"], approximate=False) @ lp["w_out"]
        return layer_norm(h + mlp + lp["b_out"], lp["mlp_norm_w"], lp["mlp_norm_b"], eps), None


class UnrolledBertBlocks(nn.Module):
    """Blocks "0".."L-1" run by a Python loop: h [B, N, d], key_bias -> h [B, N, d]."""

    cfg: BertConfig

    @nn.compact
    def __call__(self, h, key_bias):
        for layer in range(self.cfg.num_layers):
            h, _ = BertBlock(self.cfg, name=str(layer))(h, key_bias)
        return h


class BertEncoder(nn.Module):
    """Embeddings, then the layers: token_ids [B, N], lengths [B] -> last_hidden_state [B, N, d].

    `unrolled` must match the params layout (`layers.is_unrolled`).
    """

    cfg: BertConfig
    unrolled: bool = False

    @nn.compact
    def __call__(self, token_ids, lengths):
        cfg, n = self.cfg, token_ids.shape[1]
        assert n <= cfg.max_position_embeddings, f"{n=} exceeds {cfg.max_position_embeddings=}"
        top = {name: self.param(name, _init(name), shape)
               for name, shape in param_shapes(cfg).items() if name != "layers"}
        h = (top["word_embed"][token_ids] + top["pos_embed"][:n][None]
             + top["type_embed"][0][None, None])
        h = layer_norm(h, top["embed_norm_w"], top["embed_norm_b"], cfg.layer_norm_eps)
        valid = jnp.arange(n)[None, :] < lengths[:, None]  # [B, N]
        key_bias = jnp.where(valid, 0.0, jnp.finfo(jnp.float32).min)[:, None, None, :]
        if self.unrolled:
            return UnrolledBertBlocks(cfg, name="layers")(h, key_bias)
        scanned = nn.scan(BertBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                          in_axes=nn.broadcast, length=cfg.num_layers)
        h, _ = scanned(cfg, name="layers")(h, key_bias)
        return h


def encode(params, cfg: BertConfig, token_ids, lengths):
    """token_ids [B, N] int32, lengths [B] int32 -> last_hidden_state [B, N, d].

    Keys past a row's length are masked out; rows of length 0 (batch padding) stay finite.
    `params["layers"]` is stacked or from `layers.split_layers`.
    """
    model = BertEncoder(cfg, unrolled=is_unrolled(params))
    return model.apply({"params": params}, token_ids, lengths)
