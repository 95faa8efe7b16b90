"""Host-side allocators of the device state: KV pages (a caching pool) and pooler slots.

The scheduler owns both: a request gets its pages and, for an embedding on the decoder, its
pooler slot when it is admitted, and gives them back when it finishes, is aborted or (pages
only) preempted. Page 0 is reserved: padding rows write there. Allocation returns None when
it cannot, and the caller preempts or waits.

`PagePool` is also the prefix cache (after vLLM's block pool). Every page has a reference
count; a full page whose K/V a step has computed is registered under its chain digest
(`hashing.py`), and a later request whose digests match takes a reference on it instead of
computing it again. A page whose count drops to 0 keeps its digest and goes to the back of an
LRU free queue (a request frees its pages last-page-first, so its deepest pages are evicted
first; pages that hold nothing cached go to the front); `allocate` takes pages from the front
and forgets a taken page's digest then (an eviction). Pages with a count above 0 are never
handed out, so a shared page is never written. Counters: `queries`, `query_pages`, `hit_pages`
(admissions' lookups, `record_query`), `evictions`; `stats()` reads them with the free pages.
"""
from __future__ import annotations

import collections
import dataclasses

SCRATCH_PAGE = 0


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """A snapshot of the KV page pool and its prefix cache (`Scheduler.cache_stats()`)."""

    free_pages: int  # pages no request holds (cached ones included: they are evictable)
    cached_pages: int  # free or held pages that hold a registered prefix
    queries: int  # admissions that looked their prompt up
    query_pages: int  # full prompt pages those admissions asked for
    hit_pages: int  # of which found cached
    evictions: int  # cached pages handed out again (their digest forgotten)


class PagePool:
    def __init__(self, num_pages: int, caching: bool = False):
        assert num_pages >= 2, f"{num_pages=} must be >= 2 (page 0 is the scratch page)"
        self.num_pages, self.caching = num_pages, caching
        self.ref_count = [0] * num_pages
        self.page_hash: list = [None] * num_pages  # page -> digest, while it is registered
        self.cached: dict = {}  # digest -> page
        self._free = collections.OrderedDict.fromkeys(range(1, num_pages))  # front: next out
        self.queries = self.query_pages = self.hit_pages = self.evictions = 0

    @property
    def num_free(self) -> int:
        """Pages no request holds (cached ones included: they are evictable)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def allocate(self, n: int) -> list | None:
        """n pages with count 1, or None (and nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        pages = [self._free.popitem(last=False)[0] for _ in range(n)]
        for page in pages:
            self._forget(page)
            self.ref_count[page] = 1
        return pages

    def free(self, pages: list) -> None:
        """Drop one reference on each page, last page first (so the deepest go first)."""
        for page in reversed(pages):
            assert self.ref_count[page] > 0, f"page {page} freed with count 0"
            self.ref_count[page] -= 1
            if self.ref_count[page] == 0:
                self._free[page] = None
                if self.page_hash[page] is None:
                    self._free.move_to_end(page, last=False)

    def lookup(self, hashes: list) -> list:
        """The pages of the longest cached prefix of `hashes` (no reference taken)."""
        pages = []
        for h in hashes:
            page = self.cached.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def record_query(self, num_pages: int, num_hit: int) -> None:
        """Count one admission's lookup: `num_pages` asked for, `num_hit` found."""
        self.queries += 1
        self.query_pages += num_pages
        self.hit_pages += num_hit

    def can_take(self, hit: list, n: int) -> bool:
        """Whether `touch(hit)` then `allocate(n)` would succeed (hit pages that are free
        leave the free queue when touched)."""
        return n <= len(self._free) - sum(self.ref_count[p] == 0 for p in hit)

    def touch(self, pages: list) -> None:
        """Take a reference on each page (cache hits)."""
        for page in pages:
            if self.ref_count[page] == 0:
                del self._free[page]
            self.ref_count[page] += 1

    def register(self, page: int, digest: bytes) -> None:
        """`page` now holds the computed K/V of the chain prefix `digest`. A digest already
        cached elsewhere (two requests computed the same prefix) keeps its first page."""
        if self.caching and digest not in self.cached and self.page_hash[page] is None:
            self.cached[digest] = page
            self.page_hash[page] = digest

    def stats(self) -> CacheStats:
        return CacheStats(self.num_free, self.num_cached, self.queries, self.query_pages,
                          self.hit_pages, self.evictions)

    def reset(self) -> None:
        """Forget every digest. Pages held by running requests stay theirs (still correct),
        but no later request finds them; caching resumes with the next page computed."""
        for page in list(self.cached.values()):
            self.page_hash[page] = None
        self.cached.clear()

    def _forget(self, page: int) -> None:
        digest = self.page_hash[page]
        if digest is not None:
            del self.cached[digest]
            self.page_hash[page] = None
            self.evictions += 1


class SlotAllocator:
    """Pooler slots `0 .. num_slots - 1` (the device's pooler state has one more, the dummy
    slot that padding rows write to)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        assert slot not in self._free, f"pooler slot {slot} freed twice"
        self._free.append(slot)
