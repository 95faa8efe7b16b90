"""The pooling a sentence-transformers directory asks for (`modules.json`, `1_Pooling/config.json`).
"""
from __future__ import annotations

import json
import os

_ST_MODES = {"mean": "mean", "weightedmean": "weighted_mean", "cls": "cls", "lasttoken": "last"}
_ST_LEGACY_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                   "pooling_mode_mean_tokens": "mean",
                   "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens": "weightedmean",
                   "pooling_mode_lasttoken": "lasttoken"}


def read_sentence_transformers_pooling(model_dir: str) -> tuple[str, bool]:
    """(pooling kind, normalize) from `modules.json` and its Pooling module's `config.json`.

    ("mean", False) when the directory has no `modules.json` or it lists no Pooling module.
    Reads both the legacy `pooling_mode_*_tokens` booleans and the newer `pooling_mode` key.
    """
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return "mean", False
    with open(modules_path) as f:
        modules = json.load(f)
    kinds = {m["type"].rsplit(".", 1)[-1]: m for m in modules}
    normalize = "Normalize" in kinds
    if "Pooling" not in kinds:
        return "mean", normalize
    path = os.path.join(model_dir, kinds["Pooling"]["path"], "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: {modules_path} lists a Pooling module there")
    with open(path) as f:
        raw = json.load(f)
    modes = raw.get("pooling_mode") or [m for k, m in _ST_LEGACY_KEYS.items() if raw.get(k)]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(f"{path}: pooling modes {modes} are not supported; supported: exactly "
                         f"one of {', '.join(_ST_MODES)}")
    return _ST_MODES[modes[0]], normalize
