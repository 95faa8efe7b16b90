"""Safetensors files read here (header + memory map), and the one loop that turns a checkpoint
into a params pytree with stacked layers.

In: a model directory with `model.safetensors` or a sharded `model.safetensors.index.json`
(whose entries must stay inside the directory). Out: numpy arrays, checked against the shapes
the config expects. A header whose byte spans do not match their shapes or overlap, a missing,
truncated, mis-shaped, unaccounted-for or non-finite (NaN, Inf or beyond +-MAX_WEIGHT, checked
block by block as it is read) tensor fails naming the file and the tensor. No jax, no torch.
"""
from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable

import ml_dtypes
import numpy as np

from hetero_jax.models.config import read_json, require

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
# Bytes per element of every safetensors dtype whose size is whole bytes (read or not).
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
             "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_MAX_HEADER = 100_000_000  # bytes; the safetensors library's own limit
# A weight beyond this (sqrt of float32's max) is corruption (a flipped exponent bit): its
# square overflows, and a norm over it returns zeros or NaN. Trained weights stay far below.
MAX_WEIGHT = 1.8e19
_INDEX = "model.safetensors.index.json"


def _ints(value, n: int | None = None) -> bool:
    return (isinstance(value, list) and (n is None or len(value) == n)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value))


def _span(path: str, name: str, info) -> tuple:
    """(begin, end) of one header entry, checked against its shape and dtype."""
    where = f"{path}: tensor {name}:"
    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
        raise ValueError(f"{where} entry {info!r} lacks a dtype")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not _ints(shape):
        raise ValueError(f"{where} shape {shape!r} is not a list of non-negative integers")
    if not _ints(offsets, 2):
        raise ValueError(f"{where} data_offsets {offsets!r} is not two non-negative integers")
    begin, end = offsets
    if end < begin:
        raise ValueError(f"{where} data_offsets {offsets} run backwards")
    itemsize = _ITEMSIZE.get(info["dtype"])
    if itemsize is not None and math.prod(shape) * itemsize != end - begin:
        raise ValueError(f"{where} shape {shape} x {info['dtype']} needs "
                         f"{math.prod(shape) * itemsize} bytes, data_offsets {offsets} "
                         f"hold {end - begin}")
    return begin, end


class SafetensorsFile:
    """Lazy reader of one .safetensors file: `names`, `shape(name)`, `get(name) -> np.ndarray`
    (refused when it holds a NaN or Inf).

    The header is checked when the file is opened: every tensor's byte span matches its shape
    and dtype, lies inside the file and overlaps no other tensor's."""

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
            if 8 + header_len > size or header_len > _MAX_HEADER:
                raise ValueError(f"{path}: bad safetensors header length ({header_len} header "
                                 f"bytes, file has {size}, limit {_MAX_HEADER})")
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: header is not valid JSON ({e})") from e
        if not isinstance(header, dict):
            raise ValueError(f"{path}: header is not a JSON object")
        header.pop("__metadata__", None)
        self.header, self.data_start, self.size = header, 8 + header_len, size
        self._check_spans()

    def _check_spans(self) -> None:
        spans = sorted(_span(self.path, name, info) + (name,) for name, info in self.header.items())
        last_end, last_name = 0, None
        for begin, end, name in spans:
            if self.data_start + end > self.size:
                raise ValueError(f"{self.path}: tensor {name} is truncated (needs bytes up to "
                                 f"{self.data_start + end}, file has {self.size})")
            if begin < last_end:
                raise ValueError(f"{self.path}: tensor {name} overlaps tensor {last_name} (its "
                                 f"data_offsets [{begin}, {end}] start before {last_end})")
            if end > last_end:
                last_end, last_name = end, name

    @property
    def names(self):
        return self.header.keys()

    def shape(self, name: str) -> tuple:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        arr = np.memmap(self.path, dtype=_DTYPES[info["dtype"]], mode="r",
                        offset=self.data_start + info["data_offsets"][0], shape=self.shape(name))
        bad = count_non_finite(arr)
        if bad:
            raise ValueError(f"{self.path}: tensor {name} holds {bad} non-finite "
                             f"value{'s' if bad > 1 else ''} (NaN, Inf or beyond "
                             f"+-{MAX_WEIGHT:g}) of {arr.size}: the checkpoint is corrupt, or "
                             "overflowed when it was saved")
        return np.asarray(arr)


def _allowed_roots(model_dir: str) -> list:
    """Where a shard may lie: the model directory and, for a snapshot of the Hugging Face hub
    cache (`<repo>/snapshots/<rev>`, files linked to `../../blobs/<hash>`), its blobs."""
    real = os.path.realpath(model_dir)
    roots = [real]
    if os.path.basename(os.path.dirname(real)) == "snapshots":
        roots.append(os.path.join(os.path.dirname(os.path.dirname(real)), "blobs"))
    return roots


def _shard_path(model_dir: str, fn, where: str) -> str:
    """The path of an index entry's file, refused when it leads outside the model directory."""
    if not isinstance(fn, str):
        raise ValueError(f"{where} is not a file name")
    if os.path.isabs(fn) or os.pardir in os.path.normpath(fn).split(os.sep):
        raise ValueError(f"{where} points outside {model_dir}")
    path = os.path.join(model_dir, fn)
    real = os.path.realpath(path)
    if not any(os.path.commonpath([real, root]) == root for root in _allowed_roots(model_dir)):
        raise ValueError(f"{where} resolves to {real}, outside {model_dir}")
    return path


def _open_sharded(model_dir: str, index: str) -> dict:
    weight_map = require(read_json(index), "weight_map", f"{index}:")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: weight_map is not a JSON object")
    files, tensors = {}, {}
    for name, fn in weight_map.items():
        where = f"{index}: entry {name} -> {fn!r}"
        if fn not in files:
            files[fn] = SafetensorsFile(_shard_path(model_dir, fn, where))
        if name not in files[fn].header:
            raise ValueError(f"{where}: tensor {name} is not in that file")
        tensors[name] = files[fn]
    return tensors


def open_checkpoint(model_dir: str) -> dict:
    """tensor name -> SafetensorsFile holding it (single file or sharded index)."""
    index = os.path.join(model_dir, _INDEX)
    if os.path.isfile(index):
        return _open_sharded(model_dir, index)
    single = os.path.join(model_dir, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"no model.safetensors or {_INDEX} in {model_dir}")
    f = SafetensorsFile(single)
    return {name: f for name in f.names}


def count_non_finite(arr: np.ndarray, block: int = 2**24) -> int:
    """How many values of `arr` are NaN, Inf or beyond +-MAX_WEIGHT (0 for integers), read in
    blocks of `block` elements so the check never holds more than a block's mask."""
    if not np.issubdtype(arr.dtype, np.inexact) and arr.dtype != ml_dtypes.bfloat16:
        return 0
    flat = arr.reshape(-1)
    return sum(int(flat[i:i + block].size - np.count_nonzero(
        np.abs(flat[i:i + block].astype(np.float32, copy=False)) <= MAX_WEIGHT))  # NaN: False
        for i in range(0, flat.size, block))


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


def load_stacked(tensors: dict, shapes: dict, top_names: dict, layer_name: Callable,
                 transpose: Callable, unused: Callable = lambda name: False) -> dict:
    """A params pytree of numpy arrays: each top-level key of `shapes` read from its name in
    `top_names` (keys without a name are skipped), and `shapes["layers"]` as per-layer tensors
    `layer_name(i, key)` stacked on a leading axis. `transpose(key)` says which are stored
    `[out, in]` (Hugging Face linear weights) and become `[in, out]`. A tensor of the
    checkpoint that is none of these and not `unused(name)` (heads the model does not run) is
    an error: the config describes a smaller or another model than the weights."""
    top = {k: top_names[k] for k in shapes if k != "layers" and k in top_names}
    per_layer = {key: [layer_name(i, key) for i in range(shape[0])]
                 for key, shape in shapes["layers"].items()}
    used = set(top.values()).union(*per_layer.values())
    extra = sorted(n for n in tensors if n not in used and not unused(n))
    if extra:
        raise ValueError(f"{tensors[extra[0]].path}: tensor {extra[0]} is not used by the model "
                         f"the config describes ({len(extra)} such tensors): the config has "
                         f"fewer layers or other modules than the weights")
    params = {k: read_tensor(tensors, name, shapes[k], transpose(k)) for k, name in top.items()}
    params["layers"] = {
        key: np.stack([read_tensor(tensors, name, shapes["layers"][key][1:], transpose(key))
                       for name in names])
        for key, names in per_layer.items()}
    return params
