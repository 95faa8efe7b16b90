"""Engine-native checkpoints with orbax: `params/` (the pytree), `model.json`, `tokenizer/`.

`save` writes them from `Engine.save`. `load` (for `Engine.load`) reads `model.json` (the
model config and the tokenizer kind), compares the shapes the orbax metadata records with the
shapes the config implies (`llama.param_shapes`) before restoring anything, restores, and checks
the restored arrays again, so an edited config never reaches the engine. A bad file fails with
a short ValueError/FileNotFoundError naming the file and the key; the library's error is chained.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import orbax.checkpoint as ocp

from hetero_jax.models import llama
from hetero_jax.models.config import ModelConfig, read_json, require
from hetero_jax.models.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TOKENIZER_KINDS = ("byte", "hf", "none")


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


def _model_config(meta: dict, meta_path: str) -> ModelConfig:
    where = f"{meta_path}: model_config"
    raw = require(meta, "model_config", f"{meta_path}:")
    if not isinstance(raw, dict):
        raise ValueError(f"{where} is not a JSON object")
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}")
    for name in (n for n, f in fields.items() if f.default is dataclasses.MISSING):
        require(raw, name, where)
    try:
        return ModelConfig(**dict(
            raw, rope_scaling=tuple(tuple(kv) for kv in raw.get("rope_scaling", ())),
            eos_token_ids=tuple(raw.get("eos_token_ids", ()))))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e


def _flat(tree: dict, prefix: str = "") -> dict:
    """{"embed": leaf, "layers.wq": leaf, ...} of a nested dict."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def check_params(found: dict, cfg: ModelConfig, where: str, cfg_source: str) -> None:
    """`found` maps flat param names to (shape, dtype); each must be the float array of the
    shape `llama.param_shapes(cfg)` gives, and no param may be missing or extra."""
    want = _flat(llama.param_shapes(cfg))
    for name in sorted(set(want) | set(found)):
        if name not in found:
            raise ValueError(f"{where}: param {name} missing; {cfg_source} expects {want[name]}")
        if name not in want:
            raise ValueError(f"{where}: param {name} is not in the model {cfg_source} describes")
        shape, dtype = found[name]
        if tuple(shape) != want[name]:
            raise ValueError(f"{where}: param {name} has shape {tuple(shape)}; {cfg_source} "
                             f"expects {want[name]}")
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"{where}: param {name} has dtype {dtype}, not a float type")


def _short(e: Exception) -> str:
    """The first line of an error, cut short (TensorStore errors run to kilobytes)."""
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0][:120] if lines else ''}"


def _saved_shapes(ckpt, params_dir: str) -> dict:
    """Flat param name -> (shape, dtype) from the orbax metadata, without reading arrays."""
    if not os.path.isdir(params_dir):
        raise FileNotFoundError(f"{params_dir} not found: the checkpoint has no params")
    try:
        meta = ckpt.metadata(params_dir).item_metadata
    except Exception as e:  # orbax and TensorStore raise many types
        raise ValueError(f"{params_dir}: cannot read the orbax metadata ({_short(e)})") from e
    tree = getattr(meta, "tree", None)
    if not isinstance(tree, dict):
        raise ValueError(f"{params_dir}: cannot read the orbax metadata (_METADATA or the "
                         f"manifest is missing or corrupt)")
    return {name: (m.shape, m.dtype) for name, m in _flat(tree).items()}


def _tokenizer(kind: str, path: str, cfg: ModelConfig):
    if kind == "byte":
        return ByteTokenizer()
    if kind == "none":
        return None
    tokenizer = load_tokenizer(os.path.join(path, "tokenizer"), cfg.eos_token_ids)
    if tokenizer is None:
        raise FileNotFoundError(f"{os.path.join(path, 'tokenizer')} has no tokenizer files; "
                                f"model.json says tokenizer 'hf'")
    return tokenizer


def load(path: str, targets=None):
    """-> (ModelConfig, params, tokenizer or None), every param checked against the config.
    `targets(cfg)`, when given, makes the orbax restore target of the config's params (as
    `runner.sharding.restore_targets` does: each leaf restored straight into its sharding, or
    to the host); without it they are restored whole, as saved."""
    path = os.path.abspath(path)
    meta_path, params_dir = os.path.join(path, "model.json"), os.path.join(path, "params")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{meta_path} not found: not a hetero-jax checkpoint")
    meta = read_json(meta_path)
    kind = require(meta, "tokenizer", f"{meta_path}:")
    if kind not in TOKENIZER_KINDS:
        raise ValueError(f"{meta_path}: tokenizer {kind!r} is not one of "
                         f"{', '.join(TOKENIZER_KINDS)}")
    cfg = _model_config(meta, meta_path)
    with ocp.StandardCheckpointer() as ckpt:
        check_params(_saved_shapes(ckpt, params_dir), cfg, params_dir, meta_path)
        target = targets(cfg) if targets else None  # before a byte is read: may refuse
        try:
            params = ckpt.restore(params_dir, target)
        except Exception as e:  # orbax and TensorStore raise many types
            raise ValueError(f"{params_dir}: cannot restore the orbax checkpoint "
                             f"({_short(e)})") from e
    check_params({k: (v.shape, v.dtype) for k, v in _flat(params).items()}, cfg, params_dir,
                 meta_path)
    bad = {k: int(jnp.size(v) - jnp.sum(jnp.isfinite(v))) for k, v in _flat(params).items()}
    name = next((k for k, n in bad.items() if n), None)
    if name is not None:
        raise ValueError(f"{params_dir}: param {name} holds {bad[name]} non-finite values (NaN "
                         "or Inf): the checkpoint is corrupt, or overflowed when it was saved")
    return cfg, params, _tokenizer(kind, path, cfg)
