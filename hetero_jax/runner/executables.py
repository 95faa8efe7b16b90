"""Ahead-of-time executables, one per bucket variant, over JAX's persistent compilation cache.

`ExecutableCache(build, on_build=...)`: `cache(key)` returns the executable of a variant,
building it on first use (`on_build(key)` first: `compile_progress.CompileNotice` says so on
stderr); it counts builds and, among them, loads from the persistent cache (a jax cache-hit
event during the build marks a load), and the seconds spent on both.

Memory mappings bound what a process can hold: XLA:CPU maps three regions per kernel (code,
read-only data, data), about 350-540 per variant of the small preset, and Linux allows
`vm.max_map_count` (65,530 here) per process; holding all 216 default variants crashed near
that limit. The cache therefore drops the least recently used executables while the process
holds more than `max_maps` mappings (default: half the limit); a dropped variant is rebuilt on
its next use, from the persistent cache in about 0.5 s when that is on.

`enable_compile_cache(path)` turns the persistent cache on for the process (and the worker
processes it starts); `WarmManifest` records, per engine configuration, which variants are on
disk, so that a second process of the same configuration skips them in `warmup()`.
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable

import jax
from jax import monitoring

from hetero_jax.warn import warn

_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_hits = threading.local()  # per thread: persistent-cache hits seen so far


def _on_event(event: str, **kwargs) -> None:
    if event == _HIT_EVENT:
        _hits.n = getattr(_hits, "n", 0) + 1


monitoring.register_event_listener(_on_event)


def process_maps() -> int | None:
    """Memory mappings this process holds (None where /proc is absent)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def default_max_maps() -> int | None:
    """Half of `vm.max_map_count` (None where it cannot be read: no bound)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read()) // 2
    except (OSError, ValueError):
        return None


class ExecutableCache:
    """`cache(key)` returns the executable of a variant, building it on first use and holding
    at most what `max_maps` allows (least recently used dropped first; at least one kept)."""

    def __init__(self, build: Callable, max_maps: int | None = None,
                 on_build: Callable[[tuple], None] | None = None):
        self._build = build  # key -> compiled executable
        self.on_build = on_build  # called with a key before it is built
        self._held: collections.OrderedDict = collections.OrderedDict()
        self.max_maps = default_max_maps() if max_maps is None else max_maps
        self.builds = 0  # compiled, or loaded from the persistent cache
        self.loads = 0  # builds served by the persistent cache
        self.dropped = 0  # executables released under the mapping bound
        self.seconds = 0.0  # spent compiling and loading

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: tuple) -> bool:
        return key in self._held

    def held(self) -> list:
        """(key, executable) pairs held now, the least recently used first."""
        return list(self._held.items())

    def __call__(self, key: tuple):
        if key in self._held:
            self._held.move_to_end(key)
            return self._held[key]
        if self.on_build:
            self.on_build(key)
        start, hits = time.perf_counter(), getattr(_hits, "n", 0)
        executable = self._build(key)
        self.seconds += time.perf_counter() - start
        self.builds += 1
        self.loads += getattr(_hits, "n", 0) > hits
        self._held[key] = executable
        self._release()
        return executable

    def _release(self) -> None:
        while len(self._held) > 1 and self.max_maps and (process_maps() or 0) > self.max_maps:
            self._held.popitem(last=False)
            self.dropped += 1


# XLA:CPU's LLVM at optimisation level 1 instead of its default: 25% fewer compile CPU seconds
# over seven small-preset variants (9-33% each), with the steps' CPU time within 0.96-1.02x
# (scripts/bench_compile_options.py, docs/results.md); level 0 compiles faster still but makes
# the steps 1.5-2.4x slower. No fast-math either way: the same results.
CPU_COMPILE_OPTIONS = {"xla_backend_optimization_level": 1}


def compile_options(backend: str) -> dict:
    """The XLA options of a step compile on a jax `backend` (`CPU_COMPILE_OPTIONS` on a CPU,
    XLA's defaults elsewhere). They are part of the persistent cache's key."""
    return dict(CPU_COMPILE_OPTIONS) if backend == "cpu" else {}


def default_compile_cache() -> str:
    """$XDG_CACHE_HOME/hetero-jax/xla, or ~/.cache/hetero-jax/xla."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hetero-jax", "xla")


def enable_compile_cache(path: str | None) -> str | None:
    """Persistent XLA cache in `path` for this process and the workers it starts; "auto": the
    one already set (by the user or an earlier engine), else `default_compile_cache()`; None or
    "none": leave jax as it is. Returns the directory in use (None: off). The cache is
    process-wide: the first directory set holds."""
    current = jax.config.jax_compilation_cache_dir
    if path in (None, "none"):
        return current
    if path == "auto":
        if current:
            return current
        path = default_compile_cache()
    if current and os.path.abspath(current) != os.path.abspath(path):
        warn(f"compile_cache={path!r} not used: this process already caches compiles in "
             f"{current!r} (JAX's cache is process-wide; the first one set holds)")
        return current
    os.makedirs(path, exist_ok=True)
    values = dict(jax_compilation_cache_dir=path, jax_persistent_cache_min_compile_time_secs=0.0,
                  jax_persistent_cache_min_entry_size_bytes=0)
    for name, value in values.items():
        os.environ[name.upper()] = str(value)  # read by the workers' jax at import
        jax.config.update(name, value)
    return path


class WarmManifest:
    """Which variants of one configuration are in the persistent cache directory `root`:
    `<root>/hetero-jax-warm/<fingerprint>.json`, a sorted list of variant keys. The
    fingerprint covers everything a compile depends on (jax, backend, XLA flags and compile
    options, model and engine configuration, parameter shapes), so a stale entry cannot match."""

    def __init__(self, root: str, fingerprint: str):
        self.path = os.path.join(root, "hetero-jax-warm", fingerprint + ".json")
        self._lock = threading.Lock()

    @staticmethod
    def fingerprint(*parts) -> str:
        devices = [d.device_kind for d in jax.devices()]
        text = repr((jax.__version__, jax.default_backend(), devices,
                     os.environ.get("XLA_FLAGS", ""), compile_options(jax.default_backend()),
                     parts))
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    def keys(self) -> set:
        try:
            with open(self.path) as f:
                return {tuple(k) for k in json.load(f)}
        except (OSError, ValueError):
            return set()

    def add(self, keys) -> None:
        """Record `keys` (written atomically: a killed process leaves the old list)."""
        with self._lock:
            merged = sorted(self.keys() | {tuple(k) for k in keys})
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(merged, f)
            os.replace(tmp, self.path)
