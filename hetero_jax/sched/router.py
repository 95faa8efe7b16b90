"""The replica router: which replica serves a request (host only, imports no jax).

In: a request's page digests (`hashing.page_hashes` of its prompt, under the chain seed its
K/V would have; [] when it uses no prefix cache), every replica's load (its outstanding
tokens, as the caller counts them: uncomputed input plus outputs still to generate) and which
replicas may take it. Out: one replica index. Two rules:

- `least-tokens`: the replica with the least load (ties: the lowest index).
- `prefix-affinity`: the replica whose cache holds the longest prefix of the request (in
  pages, ties broken by load, then index), unless that replica is overloaded; then, and when
  no replica holds even the first page, `least-tokens`. A replica is overloaded when
  `load > load_ratio * least load + load_slack` (tokens, over the replicas that may take the
  request): affinity may pile work on one replica only that far.

What a replica's cache holds is the router's own ledger, not the replica's pool: each choice
records the request's digests on the chosen replica (it will compute or reuse those pages),
in an LRU of at most `cache_pages` digests per replica, a prefix's digests kept fresher than
its extensions (the first page of a chain is evicted last). A replica that died is forgotten.
`RoutingStats` counts the choices of each kind. Used by `serving.replicas` (real engines in
processes) and `sim.simulate` (simulated replicas).
"""
from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence

ROUTERS = ("least-tokens", "prefix-affinity")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    policy: str = "least-tokens"
    cache_pages: int = 16384  # digests remembered per replica (its KV pool's pages, say)
    load_ratio: float = 2.0  # prefix-affinity's bound: load > ratio * least load + slack
    load_slack: int = 4096  # tokens

    def __post_init__(self):
        if self.policy not in ROUTERS:
            raise ValueError(f"router={self.policy!r} must be one of {', '.join(ROUTERS)}")
        if isinstance(self.cache_pages, bool) or not isinstance(self.cache_pages, int) or \
                self.cache_pages < 1:
            raise ValueError(f"cache_pages={self.cache_pages!r} must be an integer >= 1")
        if not (isinstance(self.load_ratio, (int, float)) and 1 <= self.load_ratio < math.inf):
            raise ValueError(f"load_ratio={self.load_ratio!r} must be a number >= 1")
        if isinstance(self.load_slack, bool) or not isinstance(self.load_slack, int) or \
                self.load_slack < 0:
            raise ValueError(f"load_slack={self.load_slack!r} must be an integer >= 0")


@dataclasses.dataclass
class RoutingStats:
    least_tokens: int = 0  # choices by load alone (no replica held a page, or least-tokens)
    affinity: int = 0  # sent to the replica holding the longest prefix
    overloaded: int = 0  # the longest prefix's replica was overloaded: sent by load instead
    affinity_pages: int = 0  # pages the affinity choices found on their replica


class Router:
    def __init__(self, num_replicas: int, config: RouterConfig | None = None):
        assert num_replicas >= 1, f"{num_replicas=} must be >= 1"
        self.config = config or RouterConfig()
        self.num_replicas = num_replicas
        self._caches = [collections.OrderedDict() for _ in range(num_replicas)]
        self.stats = RoutingStats()

    def route(self, hashes: Sequence[bytes], loads: Sequence[float],
              eligible: Sequence[int] | None = None) -> int:
        """The replica for a request with page digests `hashes`, given every replica's load;
        `eligible` (default: all) are the replicas that may take it. Records the choice."""
        assert len(loads) == self.num_replicas, f"{len(loads)=} != {self.num_replicas=}"
        eligible = range(self.num_replicas) if eligible is None else eligible
        if not eligible:
            raise ValueError("no replica can take the request (every replica is down)")
        least = min(eligible, key=lambda r: (loads[r], r))
        choice = least
        if self.config.policy == "prefix-affinity" and hashes:
            held = {r: self.cached_pages(r, hashes) for r in eligible}
            best = min(eligible, key=lambda r: (-held[r], loads[r], r))
            if held[best] == 0:
                self.stats.least_tokens += 1
            elif loads[best] > self.config.load_ratio * loads[least] + self.config.load_slack:
                self.stats.overloaded += 1
            else:
                choice = best
                self.stats.affinity += 1
                self.stats.affinity_pages += held[best]
            self._record(choice, hashes)
        else:
            self.stats.least_tokens += 1
        return choice

    def cached_pages(self, replica: int, hashes: Sequence[bytes]) -> int:
        """How many leading pages of `hashes` the router believes `replica` holds."""
        cache = self._caches[replica]
        n = 0
        while n < len(hashes) and hashes[n] in cache:
            n += 1
        return n

    def forget(self, replica: int) -> None:
        """`replica` lost its cache (it died, or was reset): it holds nothing now."""
        self._caches[replica].clear()

    def _record(self, replica: int, hashes: Sequence[bytes]) -> None:
        """The replica holds `hashes` now, the first page the most recently used."""
        cache = self._caches[replica]
        for digest in reversed(hashes):
            cache[digest] = None
            cache.move_to_end(digest)
        while len(cache) > self.config.cache_pages:
            cache.popitem(last=False)
