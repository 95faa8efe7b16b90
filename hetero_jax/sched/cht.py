"""The Chunked Hash Tree (Feather): which waiting request shares most with the running batch.

In: the scheduler's generation requests, through `add` (queued), `admit` (waiting -> running),
`preempt` (running -> waiting) and `remove` (finished or aborted, from either state). Out:
`find_best()`, the waiting request with the fewest missing chunks, and `ranked()`, the
waiting requests in that order. Plain Python; imports no jax.

A request's prompt is cut into chunks of `chunk_pages` KV pages. Its chunk keys are the chain
digests (`hashing.py`, the same ones the prefix cache keys on) of the pages at the chunk
boundaries; a digest covers every token before it, so two requests share key c exactly when
they share their first c chunks, and the keys of all requests form a tree without one being
stored. Per key the index keeps how many running requests hold it (the working set) and which
waiting requests have it. A waiting request's missing count is its chunks (the full ones and
a partial last one, which no one shares) minus its keys in the working set; the counts sit in
a heap keyed (missing, arrival) with lazy deletion: a change pushes a new entry and the old
one is skipped when it surfaces. A key enters or leaves the working set only when its count
moves between 0 and 1, and only then are the waiting requests that hold it touched.

The tip is the longest chain common to every running request (its keys, in order); admitting
a request cuts it to their common prefix, a request leaving lets it grow again (checked from
one running request's keys). `find_best()` is cached until the next change.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools

from hetero_jax.sched.hashing import chain_seed, extend_hashes
from hetero_jax.sched.request import Request

INDEX_SEED = chain_seed("hetero-jax cht")  # for requests that carry no prefix-cache seed


@dataclasses.dataclass(frozen=True)
class Best:
    """What `find_best` returns: the request and what admitting it would do to the batch."""

    request: Request
    missing: int  # its chunks not in the working set
    held: int  # its chunks in the working set (a prefix of its keys)
    tip_before: int  # chunks common to the whole running batch now (0 when none runs)
    tip_after: int  # ... once it joined
    peers: int  # waiting requests (itself included) that hold its first key, 1 without keys

    @property
    def loss(self) -> int:
        """Chunks of the batch's common prefix lost by admitting it."""
        return max(self.tip_before - self.tip_after, 0)


def chunk_keys(req: Request, page_size: int, chunk_pages: int) -> list:
    """The digests at the chunk boundaries of `req`'s prompt: [key of chunk 0, ...]."""
    if chunk_pages < 1:
        raise ValueError(f"chunk_pages={chunk_pages} must be >= 1")
    prompt = req.prompt_token_ids
    if req.cache_seed is not None:  # share the prefix cache's digests
        hashes = req.block_hashes
        if len(hashes) < len(prompt) // page_size:
            extend_hashes(hashes, prompt, page_size, req.cache_seed)
    else:
        hashes = extend_hashes([], prompt, page_size, INDEX_SEED)
    full = len(prompt) // page_size // chunk_pages
    return [hashes[(c + 1) * chunk_pages - 1] for c in range(full)]


class ChunkedHashTree:
    def __init__(self, page_size: int, chunk_pages: int):
        if chunk_pages < 1:
            raise ValueError(f"chunk_pages={chunk_pages} must be >= 1")
        self.page_size, self.chunk_pages = page_size, chunk_pages
        self.keys: dict = {}  # request_id -> [chunk keys]
        self.chunks: dict = {}  # request_id -> chunk count (a partial last one included)
        self.count: dict = {}  # key -> running requests holding it (entries > 0 only)
        self.waiters: dict = {}  # key -> {request_id: None} of the waiting requests with it
        self.running: dict = {}  # request_id -> Request
        self.waiting: dict = {}  # request_id -> Request
        self.held: dict = {}  # waiting request_id -> its keys in the working set
        self.arrival: dict = {}  # request_id -> arrival number (kept over preemptions)
        self.tip: list = []  # keys common to every running request
        self._heap: list = []  # (missing, arrival, request_id, version)
        self._version: dict = {}  # waiting request_id -> version of its live heap entry
        self._counter = itertools.count()
        self._best: Best | None = None
        self._fresh = False

    # -- changes -----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """A new waiting request."""
        rid = req.request_id
        assert rid not in self.keys, f"request {rid} is already indexed"
        keys = chunk_keys(req, self.page_size, self.chunk_pages)
        self.keys[rid] = keys
        tokens = self.page_size * self.chunk_pages
        self.chunks[rid] = max(-(-len(req.prompt_token_ids) // tokens), 1)
        self.arrival[rid] = next(self._counter)
        self._wait(req)

    def admit(self, req: Request) -> None:
        """A waiting request joins the running batch."""
        rid = req.request_id
        self._unwait(rid)
        keys = self.keys[rid]
        self.tip = keys[:] if not self.running else _common(self.tip, keys)
        self.running[rid] = req
        for key in keys:
            n = self.count.get(key, 0)
            self.count[key] = n + 1
            if n == 0:
                self._shift(key, +1)
        self._changed()

    def preempt(self, req: Request) -> None:
        """A running request goes back to the waiting queue (its arrival number is kept)."""
        self._leave(req.request_id)
        self._wait(req)

    def remove(self, req: Request) -> None:
        """A request finished or was aborted, running or waiting."""
        rid = req.request_id
        if rid in self.running:
            self._leave(rid)
        elif rid in self.waiting:
            self._unwait(rid)
        else:
            return
        for table in (self.keys, self.chunks, self.arrival):
            table.pop(rid, None)
        self._changed()

    # -- queries -----------------------------------------------------------------------------
    def missing(self, rid) -> int:
        return self.chunks[rid] - self.held[rid]

    def find_best(self) -> Best | None:
        """The waiting request with the fewest missing chunks (ties: the earliest arrival)."""
        if not self._fresh:
            self._best = self._describe(self._top())
            self._fresh = True
        return self._best

    def ranked(self):
        """The waiting requests by (missing, arrival), lazily; the order follows changes made
        between yields (an admission re-ranks the rest). Requests yielded and still waiting
        are not yielded again by this iterator."""
        aside, seen = [], set()
        try:
            while True:
                entry = self._pop_live()
                if entry is None:
                    return
                aside.append(entry)
                if entry[2] not in seen:
                    seen.add(entry[2])
                    yield self.waiting[entry[2]]
        finally:
            for entry in aside:
                if self._version.get(entry[2]) == entry[3]:
                    heapq.heappush(self._heap, entry)
            if aside:  # a best found while they were set aside is stale now
                self._changed()

    def describe(self, req: Request) -> Best:
        """What admitting the waiting request `req` would do (as `find_best` reports it)."""
        return self._describe(req.request_id)

    def tip_after(self, rid) -> int:
        keys = self.keys[rid]
        if not self.running:
            return len(keys)
        n = 0
        while n < len(self.tip) and n < len(keys) and keys[n] == self.tip[n]:
            n += 1
        return n

    # -- internals ---------------------------------------------------------------------------
    def _describe(self, rid) -> Best | None:
        if rid is None:
            return None
        keys = self.keys[rid]
        peers = len(self.waiters[keys[0]]) if keys else 1
        return Best(self.waiting[rid], self.missing(rid), self.held[rid],
                    len(self.tip) if self.running else 0, self.tip_after(rid), peers)

    def _wait(self, req: Request) -> None:
        rid = req.request_id
        self.waiting[rid] = req
        held = 0
        for key in self.keys[rid]:
            self.waiters.setdefault(key, {})[rid] = None
            held += key in self.count
        self.held[rid] = held
        self._push(rid)
        self._changed()

    def _unwait(self, rid) -> None:
        del self.waiting[rid]
        for key in self.keys[rid]:
            group = self.waiters[key]
            del group[rid]
            if not group:
                del self.waiters[key]
        del self.held[rid]
        del self._version[rid]

    def _leave(self, rid) -> None:
        """A running request leaves the batch: drop its keys, let the tip grow back."""
        del self.running[rid]
        for key in self.keys[rid]:
            n = self.count[key] - 1
            if n:
                self.count[key] = n
            else:
                del self.count[key]
                self._shift(key, -1)
        if not self.running:
            self.tip = []
        else:
            keys, size = self.keys[next(iter(self.running))], len(self.running)
            while len(self.tip) < len(keys) and self.count.get(keys[len(self.tip)]) == size:
                self.tip.append(keys[len(self.tip)])
        self._changed()

    def _shift(self, key, delta: int) -> None:
        """`key` entered (+1) or left (-1) the working set: re-rank the waiting that hold it."""
        for rid in self.waiters.get(key, ()):
            self.held[rid] += delta
            self._push(rid)

    def _push(self, rid) -> None:
        version = self._version.get(rid, -1) + 1
        self._version[rid] = version
        heapq.heappush(self._heap, (self.missing(rid), self.arrival[rid], rid, version))
        if len(self._heap) > 4 * len(self.waiting) + 64:  # mostly stale: rebuild
            self._heap = [(self.missing(r), self.arrival[r], r, self._version[r])
                          for r in self.waiting]
            heapq.heapify(self._heap)

    def _pop_live(self):
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self._version.get(entry[2]) == entry[3]:
                return entry
        return None

    def _top(self):
        while self._heap:
            entry = self._heap[0]
            if self._version.get(entry[2]) == entry[3]:
                return entry[2]
            heapq.heappop(self._heap)
        return None

    def _changed(self) -> None:
        self._fresh = False


def _common(a: list, b: list) -> list:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return a[:n]
