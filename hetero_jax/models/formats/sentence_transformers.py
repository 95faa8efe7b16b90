"""What a sentence-transformers directory asks for: its pooling (`modules.json`,
`1_Pooling/config.json`) and its input limit (`sentence_bert_config.json`).

In: a model directory. Out: (pooling kind, normalize); `max_seq_length` or None. A file that is not valid JSON or a
module entry without its `type` or `path` fails naming the file and the key.
"""
from __future__ import annotations

import os

from hetero_jax.models.config import check_positive, read_json, require

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
    kinds = {}  # module class name -> (index, entry)
    for i, module in enumerate(read_json(modules_path, list)):
        if not isinstance(module, dict):
            raise ValueError(f"{modules_path}: module {i} is {module!r}, not a JSON object")
        kind = str(require(module, "type", f"{modules_path}: module {i}"))
        kinds[kind.rsplit(".", 1)[-1]] = i, module
    normalize = "Normalize" in kinds
    if "Pooling" not in kinds:
        return "mean", normalize
    i, module = kinds["Pooling"]
    path = os.path.join(model_dir, str(require(module, "path", f"{modules_path}: module {i}")),
                        "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: {modules_path} lists a Pooling module there")
    raw = read_json(path)
    modes = raw.get("pooling_mode") or [m for k, m in _ST_LEGACY_KEYS.items() if raw.get(k)]
    modes = modes if isinstance(modes, list) else [modes]
    if len(modes) != 1 or not isinstance(modes[0], str) or modes[0] not in _ST_MODES:
        raise ValueError(f"{path}: pooling modes {modes} are not supported; supported: exactly "
                         f"one of {', '.join(_ST_MODES)}")
    return _ST_MODES[modes[0]], normalize


def read_max_seq_length(model_dir: str) -> int | None:
    """`max_seq_length` of `sentence_bert_config.json` (the tokens sentence-transformers keeps
    of an input), or None when the directory has no such file or key."""
    path = os.path.join(model_dir, "sentence_bert_config.json")
    if not os.path.isfile(path):
        return None
    value = read_json(path).get("max_seq_length")
    if value is not None:
        check_positive("max_seq_length", value, int, f"{path}: ")
    return value
