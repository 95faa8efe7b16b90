"""PEFT LoRA directories (`adapter_config.json` + `adapter_model.safetensors`) -> `LoraAdapter`.

`load_adapter` checks the adapter against the base `ModelConfig`: anything that would change
the maths and that we do not implement (DoRA, biases, rank or alpha patterns, ...) and any
tensor we would silently ignore is an error naming the file, the tensor and the limit.
"""
from __future__ import annotations

import json
import math
import os
import re

import numpy as np

from hetero_jax.models.config import ModelConfig, check_positive, read_json
from hetero_jax.models.formats.safetensors import SafetensorsFile
from hetero_jax.models.lora import LoraAdapter, projection_dims

# PEFT module name -> params key of its weight.
MODULES = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
           "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
# base_model.model[.model].layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}[.{adapter name}].weight
_KEY = re.compile(r"base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight")
# adapter_config.json options whose non-default values change the maths; we refuse them.
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "rank_pattern": {},
                "alpha_pattern": {}, "modules_to_save": None}


def _read_config(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: a PEFT LoRA adapter needs adapter_config.json")
    raw = read_json(path)
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {raw['peft_type']!r} is not supported; only 'LORA'")
    for key, default in _UNSUPPORTED.items():
        if raw.get(key, default) not in (default, None, {}, []):
            raise ValueError(f"{path}: {key}={raw[key]!r} is not supported (only {default!r})")
    check_positive("r", raw.get("r"), int, f"{path}: ")
    if "lora_alpha" in raw:
        check_positive("lora_alpha", raw["lora_alpha"], (int, float), f"{path}: ")
    return raw


def _targets(raw: dict, path: str) -> tuple:
    """The PEFT module names the adapter targets, checked against the supported seven."""
    targets = raw.get("target_modules")
    if targets == "all-linear":
        return tuple(MODULES)
    if not isinstance(targets, (str, list)):
        raise ValueError(f"{path}: target_modules {targets!r} must be a module name or a list")
    targets = [targets] if isinstance(targets, str) else targets
    unknown = [t for t in targets if t not in MODULES]
    if unknown or not targets:
        raise ValueError(f"{path}: target_modules {unknown or targets} not supported; "
                         f"supported: {', '.join(MODULES)} or 'all-linear'")
    return tuple(targets)


def _layers(raw: dict, path: str, num_layers: int) -> tuple:
    layers = raw.get("layers_to_transform")
    if layers is None:
        return tuple(range(num_layers))
    layers = [layers] if isinstance(layers, int) else layers
    if not isinstance(layers, list) or not all(type(i) is int for i in layers):
        raise ValueError(f"{path}: layers_to_transform {layers!r} must be layer indices")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"{path}: layers_to_transform {bad} outside the base model's "
                         f"{num_layers} layers")
    return tuple(layers)


def _index_tensors(st, num_layers: int, layers: tuple, targets: tuple) -> dict:
    """(layer, module, "A"|"B") -> tensor name; anything we would silently ignore is an error."""
    found = {}
    for name in st.names:
        m = _KEY.fullmatch(name)
        if m is None or m.group(2) not in MODULES:
            raise ValueError(f"{st.path}: tensor {name} is not a LoRA weight of "
                             f"{', '.join(MODULES)}")
        layer, module = int(m.group(1)), m.group(2)
        if layer >= num_layers:
            raise ValueError(f"{st.path}: tensor {name} is for layer {layer}, the base model "
                             f"has {num_layers} layers")
        if layer not in layers or module not in targets:
            raise ValueError(f"{st.path}: tensor {name} is outside target_modules "
                             f"{list(targets)} or layers_to_transform")
        found[layer, module, m.group(3)] = name
    return found


def _check(st, name: str, shape: tuple) -> np.ndarray:
    arr = st.get(name)
    if arr.shape != shape:
        raise ValueError(f"{st.path}: tensor {name} has shape {arr.shape}, the base model and "
                         f"adapter rank expect {shape}")
    return arr.astype(np.float32)


def load_adapter(adapter_dir: str, cfg: ModelConfig, dtype) -> LoraAdapter:
    """Read and check a PEFT LoRA directory against the base model `cfg`; weights in `dtype`."""
    if not os.path.isdir(adapter_dir):
        raise FileNotFoundError(f"adapter directory {adapter_dir} not found")
    config_path = os.path.join(adapter_dir, "adapter_config.json")
    raw = _read_config(config_path)
    rank, targets = raw["r"], _targets(raw, config_path)
    layers = _layers(raw, config_path, cfg.num_layers)
    alpha = raw.get("lora_alpha", rank)
    scale = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    dims = projection_dims(cfg)
    for module in targets:
        if rank > min(dims[MODULES[module]]):
            raise ValueError(f"{config_path}: r={rank} exceeds the (in, out) dimensions "
                             f"{dims[MODULES[module]]} of {module} in the base model")
    st = SafetensorsFile(os.path.join(adapter_dir, "adapter_model.safetensors"))
    found = _index_tensors(st, cfg.num_layers, layers, targets)
    weights = {}
    for module in targets:
        (din, dout), key = dims[MODULES[module]], MODULES[module]
        a = np.zeros((cfg.num_layers, din, rank), np.float32)
        b = np.zeros((cfg.num_layers, rank, dout), np.float32)
        for i in layers:
            for half, shape in (("A", (rank, din)), ("B", (dout, rank))):
                if (i, module, half) not in found:
                    part = "mlp" if key.startswith("w_") else "self_attn"
                    raise ValueError(f"{st.path}: tensor base_model.model.model.layers.{i}.{part}."
                                     f"{module}.lora_{half}.weight missing (layer {i} of "
                                     f"{cfg.num_layers}, target {module})")
                (a if half == "A" else b)[i] = _check(st, found[i, module, half], shape).T
        weights[key] = (a.astype(dtype), b.astype(dtype))
    return LoraAdapter(path=adapter_dir, rank=rank, scale=scale, weights=weights)


def save_adapter(adapter_dir: str, weights: dict, rank: int, num_layers: int,
                 base_model: str = "") -> None:
    """Write a PEFT LoRA directory that `load_adapter` (and PEFT) reads back: `weights` maps
    params keys ("wq", ...) to (a [L, in, r], b [L, r, out]) with the scale folded in, so the
    config says `lora_alpha = r` (scale 1)."""
    from safetensors.numpy import save_file

    os.makedirs(adapter_dir, exist_ok=True)
    module_of = {key: module for module, key in MODULES.items()}
    tensors = {}
    for key, (a, b) in weights.items():
        part = "mlp" if key.startswith("w_") else "self_attn"
        for i in range(num_layers):
            name = f"base_model.model.model.layers.{i}.{part}.{module_of[key]}"
            tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(np.asarray(a[i], np.float32).T)
            tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(np.asarray(b[i], np.float32).T)
    save_file(tensors, os.path.join(adapter_dir, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    config = dict(peft_type="LORA", task_type="FEATURE_EXTRACTION", r=rank, lora_alpha=rank,
                  lora_dropout=0.0, bias="none", use_dora=False, use_rslora=False,
                  fan_in_fan_out=False, base_model_name_or_path=base_model,
                  target_modules=sorted(module_of[k] for k in weights))
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)
