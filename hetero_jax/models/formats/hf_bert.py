"""BERT checkpoints in Hugging Face layout (`BertModel`, `BertForMaskedLM`, ...) -> params.

In: a directory with `config.json` and safetensors weights (with or without the `bert.`
prefix). Out: `(BertConfig, params)` in the layout of `models.bert`, linear weights
transposed to `[in, out]` and layers stacked. What the encoder cannot run fails here, and so
does a tensor it would ignore, except the pooler, `cls.*` heads and the position_ids buffer.
"""
from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp

from hetero_jax.models.bert import BertConfig, param_shapes
from hetero_jax.models.config import positive_int, read_hf_config
from hetero_jax.models.formats.safetensors import load_stacked, open_checkpoint

SUPPORTED_ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForPreTraining")

# params name -> Hugging Face name (after an optional "bert." prefix). Linear weights transposed.
_TOP_NAMES = {
    "word_embed": "embeddings.word_embeddings.weight",
    "pos_embed": "embeddings.position_embeddings.weight",
    "type_embed": "embeddings.token_type_embeddings.weight",
    "embed_norm_w": "embeddings.LayerNorm.weight", "embed_norm_b": "embeddings.LayerNorm.bias",
}
_LAYER_NAMES = {
    "wq": "attention.self.query.weight", "bq": "attention.self.query.bias",
    "wk": "attention.self.key.weight", "bk": "attention.self.key.bias",
    "wv": "attention.self.value.weight", "bv": "attention.self.value.bias",
    "wo": "attention.output.dense.weight", "bo": "attention.output.dense.bias",
    "attn_norm_w": "attention.output.LayerNorm.weight",
    "attn_norm_b": "attention.output.LayerNorm.bias",
    "w_in": "intermediate.dense.weight", "b_in": "intermediate.dense.bias",
    "w_out": "output.dense.weight", "b_out": "output.dense.bias",
    "mlp_norm_w": "output.LayerNorm.weight", "mlp_norm_b": "output.LayerNorm.bias",
}


def bert_config_from_hf(hf: dict, source: str = "config.json") -> BertConfig:
    """Map a Hugging Face BERT config dict to a BertConfig; what we cannot run fails here."""
    archs = hf.get("architectures") or ["BertModel" if hf.get("model_type") == "bert" else ""]
    if hf.get("model_type", "bert") != "bert" or not any(a in SUPPORTED_ARCHITECTURES
                                                         for a in archs):
        raise ValueError(f"{source}: model_type {hf.get('model_type')!r} with architectures "
                         f"{archs} is not a BERT encoder; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    act = hf.get("hidden_act", "gelu")
    if act != "gelu":
        raise ValueError(f"{source}: hidden_act {act!r} is not supported; supported: 'gelu'")
    pos_type = hf.get("position_embedding_type", "absolute")
    if pos_type != "absolute":
        raise ValueError(f"{source}: position_embedding_type {pos_type!r} is not supported; "
                         f"supported: 'absolute'")
    where = f"{source}:"
    hidden, heads = positive_int(hf, "hidden_size", where), positive_int(hf, "num_attention_heads",
                                                                         where)
    if hidden % heads:
        raise ValueError(f"{source}: hidden_size={hidden} must be a multiple of "
                         f"num_attention_heads={heads}")
    return BertConfig(
        vocab_size=positive_int(hf, "vocab_size", where), hidden_size=hidden,
        num_layers=positive_int(hf, "num_hidden_layers", where), num_heads=heads,
        intermediate_size=positive_int(hf, "intermediate_size", where),
        max_position_embeddings=positive_int(hf, "max_position_embeddings", where, 512),
        type_vocab_size=positive_int(hf, "type_vocab_size", where, 2),
        layer_norm_eps=hf.get("layer_norm_eps", 1e-12), hidden_act=act)


def load_bert_params(model_dir: str, cfg: BertConfig, dtype) -> dict:
    tensors = open_checkpoint(model_dir)
    prefix = "bert." if "bert." + _TOP_NAMES["word_embed"] in tensors else ""
    # The heads the encoder does not run (pooler, MLM and NSP heads) and the position_ids buffer.
    unused = re.compile(rf"{re.escape(prefix)}(?:pooler\..+|embeddings\.position_ids)|cls\..+")
    params = load_stacked(tensors, param_shapes(cfg),
                          {k: prefix + name for k, name in _TOP_NAMES.items()},
                          lambda i, key: f"{prefix}encoder.layer.{i}.{_LAYER_NAMES[key]}",
                          lambda key: key.startswith("w") and key in _LAYER_NAMES,
                          unused.fullmatch)
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)


def load_bert(model_dir: str, dtype=jnp.float32) -> tuple[BertConfig, dict]:
    """(BertConfig, stacked params) from a local Hugging Face BERT directory."""
    cfg = bert_config_from_hf(read_hf_config(model_dir), os.path.join(model_dir, "config.json"))
    return cfg, load_bert_params(model_dir, cfg, dtype)


