"""What an engine's sizes imply in bytes, checked before anything is allocated.

In: the model's `ModelConfig` and a resolved `EngineConfig` (every bucket list filled). Out:
`memory_items` lists what the engine will hold, each a `MemoryItem` (the knobs that size it,
what it is, its bytes, "host" or "device"): the weights, the KV cache, the prefix cache's
pooler sidecar, the pooler slots, the scheduler's page bookkeeping and the largest step's
activations (logits, gathered K/V, attention scores). `check_memory` raises a ValueError
naming the largest item's knobs and bytes when the device's items (on a CPU backend, all of
them) exceed the device's memory, or the host's exceed the host's; the engine calls it before
it reads a weight or builds its scheduler and runner, so an absurd size (num_pages=10**9, a
config.json of 10**6 layers) fails at once instead of after minutes and gigabytes.

The estimates are lower bounds of what XLA allocates (no fragmentation, no compiler scratch),
so they refuse only what cannot fit; they never refuse what fits.
"""
from __future__ import annotations

import dataclasses
import os

from hetero_jax.config import EngineConfig
from hetero_jax.models.config import ModelConfig

PAGE_BOOKKEEPING_BYTES = 200  # host bytes per KV page: ref count, hash slot, free-list entry
F32 = 4


@dataclasses.dataclass(frozen=True)
class MemoryItem:
    knobs: str  # the sizes that make it, as `name=value, ...`
    what: str
    bytes: int
    where: str  # "host" | "device"


def memory_items(model: ModelConfig, cfg: EngineConfig, itemsize: int) -> list:
    """What an engine of these sizes holds (per device under tensor parallelism)."""
    tp, d, hd = cfg.tensor_parallel, model.hidden_size, model.head_dim
    kv_per_token = 2 * model.num_layers * model.num_kv_heads * hd * itemsize
    t, s, sc = cfg.token_buckets[-1], cfg.seq_buckets[-1], cfg.chunk_seq_buckets[-1]
    keys = cfg.page_buckets[-1] * cfg.page_size  # key slots a step gathers per sequence
    q_width = (model.num_heads + 2 * model.num_kv_heads) * hd
    activations = F32 * (t * (6 * d + 3 * model.intermediate_size + q_width)
                         + 3 * s * model.vocab_size + 2 * s * keys * model.num_kv_heads * hd
                         + sc * model.num_heads * min(cfg.chunk_size, t) * keys)
    buffer_len = cfg.max_model_len if cfg.buffered_head else 1
    pages = f"num_pages={cfg.num_pages} (page_size={cfg.page_size}, max_model_len=" \
            f"{cfg.max_model_len})"
    items = [
        MemoryItem(f"vocab_size={model.vocab_size}, hidden_size={d}, intermediate_size="
                   f"{model.intermediate_size}, num_hidden_layers={model.num_layers}, "
                   f"num_attention_heads={model.num_heads}, num_key_value_heads="
                   f"{model.num_kv_heads}, head_dim={hd}",
                   "the weights", model.num_params * itemsize // tp, "device"),
        MemoryItem(pages, "the KV cache", cfg.num_pages * cfg.page_size * kv_per_token // tp,
                   "device"),
        MemoryItem(pages, "the scheduler's page table", cfg.num_pages * PAGE_BOOKKEEPING_BYTES,
                   "host"),
        MemoryItem(pages, "the token table (the penalties' history)",
                   cfg.num_pages * cfg.page_size * 4, "device"),
        MemoryItem(f"max_num_seqs={cfg.max_num_seqs} (hidden_size={d}, buffered_head "
                   f"{'on' if cfg.buffered_head else 'off'})", "the pooler slots",
                   (cfg.max_num_seqs + 1) * d * F32 * (5 + buffer_len), "device"),
        MemoryItem(f"token_buckets={_shown(cfg.token_buckets)}, seq_buckets="
                   f"{_shown(cfg.seq_buckets)} (max_num_seqs={cfg.max_num_seqs}), page_buckets="
                   f"{_shown(cfg.page_buckets)} x page_size={cfg.page_size} (max_model_len="
                   f"{cfg.max_model_len}), "
                   f"chunk_seq_buckets={_shown(cfg.chunk_seq_buckets)}, with the model's "
                   f"hidden_size={d}, intermediate_size={model.intermediate_size}, vocab_size="
                   f"{model.vocab_size}", "the largest step's activations", activations,
                   "device")]
    if cfg.prefix_caching:
        items.append(MemoryItem(pages, "the prefix cache's pooler sidecar",
                                cfg.num_pages * d * F32 * 3, "device"))
    return items


def _shown(buckets: tuple) -> str:
    """A bucket list as an error shows it: the first and the largest."""
    return str(buckets) if len(buckets) <= 3 else f"({buckets[0]}, ..., {buckets[-1]})"


def host_memory_bytes() -> int:
    """The host's memory: physical, or the cgroup's limit when it is lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def device_memory() -> tuple:
    """(bytes, name) of the first device's memory; the host's for the CPU backend."""
    import jax

    device = jax.devices()[0]
    if device.platform != "cpu":
        limit = (device.memory_stats() or {}).get("bytes_limit")
        if limit:
            return int(limit), f"{device.device_kind} device"
    return host_memory_bytes(), "host (the CPU backend's device)"


def check_memory(model: ModelConfig, cfg: EngineConfig, itemsize: int) -> None:
    """ValueError naming the knobs and bytes of the largest item when the items cannot fit."""
    items = memory_items(model, cfg, itemsize)
    device_bytes, device_name = device_memory()
    host_bytes = host_memory_bytes()
    on_cpu = device_name.startswith("host")
    pools = [(items if on_cpu else [i for i in items if i.where == "device"], device_bytes,
              device_name)]
    if not on_cpu:
        pools.append(([i for i in items if i.where == "host"], host_bytes, "host"))
    for pool, limit, name in pools:
        need = sum(i.bytes for i in pool)
        if need > limit:
            top = max(pool, key=lambda i: i.bytes)
            raise ValueError(f"{top.knobs}: {top.what} need {top.bytes} bytes "
                             f"({top.bytes / 2**30:.1f} GiB), {need} bytes in all with the "
                             f"rest, more than the {limit} bytes of {name} memory; lower "
                             "these sizes")
