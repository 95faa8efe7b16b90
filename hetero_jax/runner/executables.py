"""Ahead-of-time executables, one per bucket variant, with a compile count and time.

Not JAX's persistent compilation cache (`jax_compilation_cache_dir`, the bench's
`--compile-cache`): this is the in-process table from a variant key to its compiled step.
"""
from __future__ import annotations

import time
from collections.abc import Callable


class ExecutableCache:
    """`cache(key)` returns the executable of a variant, building it on first use."""

    def __init__(self, build: Callable):
        self._build = build  # key -> compiled executable
        self._executables: dict = {}
        self.seconds = 0.0  # spent compiling

    def __len__(self) -> int:
        return len(self._executables)

    def __call__(self, key: tuple):
        if key not in self._executables:
            start = time.perf_counter()
            self._executables[key] = self._build(key)
            self.seconds += time.perf_counter() - start
        return self._executables[key]
