"""Llama-family checkpoints in Hugging Face layout: load them into a params pytree, write them.

In: a directory with `config.json` and `model.safetensors` (or a sharded
`model.safetensors.index.json`). Out: `(ModelConfig, params)` with layer weights stacked on a
leading axis and transposed to `[in, out]` (`llama.param_shapes`). A tensor the config does
not account for (a layer past `num_hidden_layers`, an unknown name) is an error; a tied model
may ship an `lm_head.weight` of the embedding's shape. `export_hf_model` is the inverse, for
the transformers baseline and the tests.
"""
from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.models.config import (ARCH_OF_MODEL_TYPE, ModelConfig, model_config_from_hf,
                                      read_hf_config)
from hetero_jax.models.formats.safetensors import load_stacked, open_checkpoint
from hetero_jax.models.llama import param_shapes

# params name -> Hugging Face name; "{i}" is the layer index. Linear weights are transposed.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
_TOP_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
              "lm_head": "lm_head.weight"}


# Buffers some checkpoints carry that the model recomputes.
_UNUSED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def _tied_head_unused(tensors: dict, cfg: ModelConfig) -> bool:
    """Whether the checkpoint ships an `lm_head.weight` that tied embeddings leave unused (it
    must then have the embedding's shape)."""
    name = _TOP_NAMES["lm_head"]
    if not cfg.tie_word_embeddings or name not in tensors:
        return False
    shape, want = tensors[name].shape(name), (cfg.vocab_size, cfg.hidden_size)
    if shape != want:
        raise ValueError(f"{tensors[name].path}: tensor {name} has shape {shape}, the tied "
                         f"embeddings of the config are {want}")
    return True


def load_params(model_dir: str, cfg: ModelConfig, dtype, on_host: bool = False) -> dict:
    """The params pytree in `dtype`: on the default device, or `on_host` as numpy arrays (for
    the tensor-parallel runner, which puts each shard straight on its device)."""
    tensors = open_checkpoint(model_dir)
    tied_head = _TOP_NAMES["lm_head"] if _tied_head_unused(tensors, cfg) else None
    params = load_stacked(tensors, param_shapes(cfg), _TOP_NAMES,
                          lambda i, key: f"model.layers.{i}.{_LAYER_NAMES[key]}",
                          lambda key: key == "lm_head" or key.startswith("w"),
                          lambda name: name == tied_head or _UNUSED.fullmatch(name))
    return jax.tree.map(lambda x: (np.asarray if on_host else jnp.asarray)(x, dtype), params)


def read_model_config(model_dir: str) -> ModelConfig:
    """The ModelConfig of a directory's `config.json` (no weights read)."""
    return model_config_from_hf(read_hf_config(model_dir), os.path.join(model_dir, "config.json"))


def load_hf_model(model_dir: str, dtype=jnp.float32) -> tuple[ModelConfig, dict]:
    cfg = read_model_config(model_dir)
    return cfg, load_params(model_dir, cfg, dtype)


_MODEL_TYPES = {arch: model_type for model_type, arch in ARCH_OF_MODEL_TYPE.items()}


def hf_config_dict(cfg: ModelConfig) -> dict:
    """The Hugging Face `config.json` of a ModelConfig (inverse of `model_config_from_hf`)."""
    out = dict(architectures=[cfg.architecture], model_type=_MODEL_TYPES[cfg.architecture],
               vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
               intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
               num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
               head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
               max_position_embeddings=cfg.max_position_embeddings, hidden_act="silu",
               tie_word_embeddings=cfg.tie_word_embeddings, torch_dtype="float32",
               bos_token_id=cfg.bos_token_id,
               eos_token_id=list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else
               (cfg.eos_token_ids[0] if cfg.eos_token_ids else None))
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.architecture == "LlamaForCausalLM":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(sliding_window=cfg.sliding_window, use_sliding_window=cfg.sliding_window
                   is not None)
    return out


def export_hf_model(model_dir: str, cfg: ModelConfig, params) -> None:
    """Write `config.json` + `model.safetensors` (float32, Hugging Face names) to `model_dir`.

    `params` are stacked (`layers.stack_layers`); the inverse of `load_hf_model`, so
    `load_hf_model(model_dir)` gives `cfg` and `params` back.
    """
    from safetensors.numpy import save_file

    os.makedirs(model_dir, exist_ok=True)
    tensors = {}
    for key, hf_name in _TOP_NAMES.items():
        if key in params:
            arr = np.asarray(params[key], np.float32)
            tensors[hf_name] = np.ascontiguousarray(arr.T if key == "lm_head" else arr)
    for key, stacked in params["layers"].items():
        stacked = np.asarray(stacked, np.float32)
        for i in range(cfg.num_layers):
            arr = stacked[i].T if key.startswith("w") else stacked[i]
            tensors[f"model.layers.{i}.{_LAYER_NAMES[key]}"] = np.ascontiguousarray(arr)
    save_file(tensors, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg), f, indent=1)
