"""Load a Llama-family checkpoint from a local Hugging Face directory into a params pytree.

In: a directory with `config.json` and `model.safetensors` (or a sharded
`model.safetensors.index.json`). Out: `(ModelConfig, params)` with layer weights stacked on a
leading axis and transposed to `[in, out]`. Safetensors files are parsed here (header + memory
map) so that a missing, truncated or mis-shaped tensor fails with the file and tensor named.
"""
from __future__ import annotations

import json
import os
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from hetero_jax.models.config import (ARCH_OF_MODEL_TYPE, ModelConfig, model_config_from_hf,
                                      read_hf_config)
from hetero_jax.models.llama import param_shapes

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}

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


class SafetensorsFile:
    """Lazy reader of one .safetensors file: `names`, `get(name) -> np.ndarray`."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"weight file {path} not found")
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{path}: truncated safetensors file ({size} bytes)")
            (header_len,) = struct.unpack("<Q", raw)
            if 8 + header_len > size:
                raise ValueError(f"{path}: truncated safetensors header "
                                 f"({header_len} header bytes, file has {size})")
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        self.header, self.data_start, self.size = header, 8 + header_len, size

    @property
    def names(self):
        return self.header.keys()

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        if self.data_start + end > self.size:
            raise ValueError(f"{self.path}: tensor {name} is truncated (needs bytes up to "
                             f"{self.data_start + end}, file has {self.size})")
        arr = np.memmap(self.path, dtype=_DTYPES[info["dtype"]], mode="r",
                        offset=self.data_start + begin, shape=tuple(info["shape"]))
        return np.asarray(arr)


def open_checkpoint(model_dir: str) -> dict:
    """tensor name -> SafetensorsFile holding it (single file or sharded index)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = {fn: SafetensorsFile(os.path.join(model_dir, fn)) for fn in set(weight_map.values())}
        return {name: files[fn] for name, fn in weight_map.items()}
    single = os.path.join(model_dir, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    f = SafetensorsFile(single)
    return {name: f for name in f.names}


def read_tensor(tensors: dict, name: str, shape: tuple, transpose: bool) -> np.ndarray:
    """One tensor, checked against the Hugging Face shape, returned as `shape`."""
    if name not in tensors:
        raise ValueError(f"tensor {name} missing from the checkpoint")
    arr = tensors[name].get(name)
    hf_shape = tuple(shape)[::-1] if transpose else tuple(shape)
    if arr.shape != hf_shape:
        raise ValueError(f"{tensors[name].path}: tensor {name} has shape {arr.shape}, "
                         f"the config expects {hf_shape}")
    return arr.T if transpose else arr


def load_params(model_dir: str, cfg: ModelConfig, dtype) -> dict:
    tensors = open_checkpoint(model_dir)
    shapes = param_shapes(cfg)
    params = {k: jnp.asarray(read_tensor(tensors, _TOP_NAMES[k], shapes[k], k == "lm_head"), dtype)
              for k in shapes if k != "layers"}
    params["layers"] = {}
    for key, shape in shapes["layers"].items():
        transpose = key.startswith("w")
        per_layer = [read_tensor(tensors, f"model.layers.{i}.{_LAYER_NAMES[key]}", shape[1:], transpose)
                     for i in range(cfg.num_layers)]
        params["layers"][key] = jnp.asarray(np.stack(per_layer), dtype)
    return params


def load_hf_model(model_dir: str, dtype=jnp.float32) -> tuple[ModelConfig, dict]:
    cfg = model_config_from_hf(read_hf_config(model_dir), os.path.join(model_dir, "config.json"))
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

    `params` are stacked (`llama.stack_layers`); the inverse of `load_hf_model`, so
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
