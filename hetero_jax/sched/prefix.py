"""The scheduler's side of prefix caching: look up at admission, register after each step.

In: the scheduler's `Request`s (their tokens, `cache_seed`, pages) and the `PagePool`. A
request's `block_hashes` (the chain digests of its full pages, `hashing.py`) grow as its
tokens do, prompt and generated alike. At admission `lookup` returns the pages of its longest
cached prefix, capped so that at least one token runs (`(num_tokens - 1) // page_size`
pages): the request's computed tokens start there. After a step, `computed` registers every
page the step filled. A page is registered only once a step has written its K/V (and, on the
device, its pooler sidecar), so a cached page is always complete.

The same prefix arriving twice: while a running request is computing a page that a waiting
request would otherwise compute again (its next uncached digest is "in flight"), `lookup`
returns None and the scheduler holds the waiting request back; it is admitted once the page
is registered (and hits it) or its owner leaves. So 16 requests that share a 512-token prompt
compute it once, not once per step's chunk slots.
"""
from __future__ import annotations

from hetero_jax.sched.allocators import PagePool
from hetero_jax.sched.hashing import extend_hashes
from hetero_jax.sched.request import Request


class PrefixCache:
    def __init__(self, pool: PagePool, page_size: int):
        self.pool, self.page_size = pool, page_size
        self._inflight: dict = {}  # digest -> request_id of the running request computing it

    @property
    def enabled(self) -> bool:
        return self.pool.caching

    def _uses(self, req: Request) -> bool:
        return self.enabled and req.cache_seed is not None

    def _hashes(self, req: Request, num_pages: int) -> list:
        """The request's digests, extended to at least `num_pages` full pages if known."""
        if len(req.block_hashes) < num_pages:
            extend_hashes(req.block_hashes, req.token_ids(0, num_pages * self.page_size),
                          self.page_size, req.cache_seed)
        return req.block_hashes

    def lookup(self, req: Request) -> list | None:
        """Pages of the cached prefix of a waiting request ([] when it uses no cache), or None
        when its next page is being computed by a running request (hold it back)."""
        if not self._uses(req):
            return []
        cap = (req.num_tokens - 1) // self.page_size
        hashes = self._hashes(req, cap)[:cap]
        hit = self.pool.lookup(hashes)
        if len(hit) < cap and self._inflight.get(hashes[len(hit)], req.request_id) != \
                req.request_id:
            return None
        return hit

    def admitted(self, req: Request, hit: list) -> None:
        """`req` took the `hit` pages and computes the rest: count the query, mark the pages
        it will compute as in flight."""
        req.num_cached_tokens = len(hit) * self.page_size
        req.num_registered = len(hit)
        if not self._uses(req):
            return
        cap = (req.num_tokens - 1) // self.page_size
        self.pool.record_query(cap, len(hit))
        for digest in self._hashes(req, req.num_tokens // self.page_size)[len(hit):]:
            self._inflight.setdefault(digest, req.request_id)

    def computed(self, req: Request) -> None:
        """Register the pages a step filled (all their tokens' K/V computed)."""
        full = req.num_computed_tokens // self.page_size
        if not self._uses(req) or full <= req.num_registered:
            return
        hashes = self._hashes(req, full)
        for i in range(req.num_registered, full):
            self.pool.register(req.pages[i], hashes[i])
            self._drop_inflight(req, hashes[i])
        req.num_registered = full

    def released(self, req: Request) -> None:
        """`req` gave its pages back (finished, aborted or preempted)."""
        if self._uses(req):
            for digest in req.block_hashes[req.num_registered:]:
                self._drop_inflight(req, digest)
        req.num_registered = 0

    def _drop_inflight(self, req: Request, digest: bytes) -> None:
        if self._inflight.get(digest) == req.request_id:
            del self._inflight[digest]
