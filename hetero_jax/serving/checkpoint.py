"""Engine-native checkpoints with orbax: `params/` (the pytree), `model.json`, `tokenizer/`."""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import orbax.checkpoint as ocp

from hetero_jax.models.config import ModelConfig
from hetero_jax.models.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def save(path: str, model_cfg: ModelConfig, params, tokenizer) -> None:
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(path, "params"), params, force=True)
    kind = "byte" if isinstance(tokenizer, ByteTokenizer) else "hf" if tokenizer else "none"
    if isinstance(tokenizer, HFTokenizer):
        tokenizer._tok.save_pretrained(os.path.join(path, "tokenizer"))
    with open(os.path.join(path, "model.json"), "w") as f:
        json.dump({"model_config": dataclasses.asdict(model_cfg), "tokenizer": kind}, f, indent=1)


def _model_config(raw: dict) -> ModelConfig:
    raw = dict(raw, rope_scaling=tuple(tuple(kv) for kv in raw["rope_scaling"]),
               eos_token_ids=tuple(raw["eos_token_ids"]))
    return ModelConfig(**raw)


def load(path: str):
    """-> (ModelConfig, params, tokenizer or None)."""
    path = os.path.abspath(path)
    meta_path = os.path.join(path, "model.json")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{meta_path} not found: not a hetero-jax checkpoint")
    with open(meta_path) as f:
        meta = json.load(f)
    cfg = _model_config(meta["model_config"])
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(os.path.join(path, "params"))
    params = jax.tree.map(lambda x: x, params)
    tokenizer = {"byte": lambda: ByteTokenizer(), "none": lambda: None,
                 "hf": lambda: load_tokenizer(os.path.join(path, "tokenizer"), cfg.eos_token_ids)
                 }[meta["tokenizer"]]()
    return cfg, params, tokenizer
