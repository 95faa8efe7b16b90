"""Safetensors files read here (header + memory map), and the one loop that turns a checkpoint
into a params pytree with stacked layers.

In: a model directory with `model.safetensors` or a sharded `model.safetensors.index.json`.
Out: numpy arrays, checked against the shapes the config expects, so a missing, truncated or
mis-shaped tensor fails naming the file and the tensor. No jax, no torch.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable

import ml_dtypes
import numpy as np

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


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


def load_stacked(tensors: dict, shapes: dict, top_names: dict, layer_name: Callable,
                 transpose: Callable) -> dict:
    """A params pytree of numpy arrays: each top-level key of `shapes` read from its name in
    `top_names` (keys without a name are skipped), and `shapes["layers"]` as per-layer tensors
    `layer_name(i, key)` stacked on a leading axis. `transpose(key)` says which are stored
    `[out, in]` (Hugging Face linear weights) and become `[in, out]`."""
    params = {k: read_tensor(tensors, top_names[k], shape, transpose(k))
              for k, shape in shapes.items() if k != "layers" and k in top_names}
    params["layers"] = {}
    for key, shape in shapes["layers"].items():
        per_layer = [read_tensor(tensors, layer_name(i, key), shape[1:], transpose(key))
                     for i in range(shape[0])]
        params["layers"][key] = np.stack(per_layer)
    return params
