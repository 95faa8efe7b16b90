"""Host-side allocators of the device state: KV pages and pooler slots (plain Python).

The scheduler owns both: a request gets its pages and, for an embedding on the decoder, its
pooler slot when it is admitted, and gives them back when it finishes, is aborted or (pages
only) preempted. Page 0 is reserved: padding rows write there. Allocation returns None when
it cannot, and the caller preempts or waits.
"""
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
