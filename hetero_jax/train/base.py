"""The frozen base model a training run starts from: a preset or a model directory.

`load_base(name_or_dir, seed)` -> `Base` (the name, `ModelConfig`, the params pytree with
stacked layers in fp32, as the engine builds it before `split_layers`, and the tokenizer):
a random preset from `seed` (`llama.init_params`, the weights `Engine.from_preset` serves),
a preset shipped with weights (`presets.preset_dir`), or a local Hugging Face directory.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from hetero_jax.models import llama
from hetero_jax.models.config import ModelConfig
from hetero_jax.models.formats.hf_llama import load_params, read_model_config
from hetero_jax.models.presets import PRESETS, preset_dir
from hetero_jax.models.tokenizer import ByteTokenizer, load_tokenizer


@dataclasses.dataclass(frozen=True)
class Base:
    name: str
    cfg: ModelConfig
    params: dict
    tokenizer: object


def load_base(name_or_dir: str, seed: int = 0) -> Base:
    path = preset_dir(name_or_dir) if name_or_dir in PRESETS else name_or_dir
    if path is None:
        cfg = PRESETS[name_or_dir]
        return Base(name_or_dir, cfg, llama.init_params(cfg, seed), ByteTokenizer())
    cfg = read_model_config(path)
    tokenizer = load_tokenizer(path, cfg.eos_token_ids)
    if tokenizer is None:
        raise ValueError(f"{path} has no tokenizer: training needs one to read the pairs")
    return Base(name_or_dir, cfg, load_params(path, cfg, jnp.float32), tokenizer)
