"""Host-side KV page allocator. Page 0 is reserved: padding rows write there."""
from __future__ import annotations

SCRATCH_PAGE = 0


class PageAllocator:
    def __init__(self, num_pages: int):
        assert num_pages >= 2, f"{num_pages=} must be >= 2 (page 0 is the scratch page)"
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list | None:
        """n fresh pages, or None (and nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list) -> None:
        self._free.extend(reversed(pages))
