"""Cascade attention's host-side plan: which decode sequences share which pages (no jax).

In: the page tables and KV lengths of a decode-only step's sequences. Out: tiles of at most M
sequences sharing leading pages and, per sequence, where its own pages start, or None when the
tiles would save too few page reads. The engine's runner (`runner/batch.py`) lays the plan out
for `ops.cascade`; the simulator (`sim/kvreads.py`) counts the page reads it saves.
"""
from __future__ import annotations


def _common_pages(tables: list) -> int:
    """Length of the longest common prefix of page lists."""
    n = min(len(t) for t in tables)
    first = tables[0]
    for i in range(n):
        if any(t[i] != first[i] for t in tables[1:]):
            return i
    return n


def plan_tiles(page_tables: list, kv_lens: list, page_size: int, num_tiles: int, rows: int,
               min_saved_pages: int) -> tuple | None:
    """Tiles for decode sequences with page tables `page_tables` ([Sd] lists) and `kv_lens`.

    Sequences are sorted by their page tables, so those with long common prefixes sit side by
    side, then cut into runs of at most `rows` that share their first page; a run's shared
    pages are its common prefix, capped so that each sequence keeps its last token's page.
    The `num_tiles` runs that save most page reads ((members - 1) x shared pages) are kept.
    Returns ([(members, shared_pages)], rest_offsets [Sd]) or None when the kept tiles save
    fewer than `min_saved_pages` page reads.
    """
    full = [[int(p) for p in t[:(n - 1) // page_size]] for t, n in zip(page_tables, kv_lens)]
    order = sorted((i for i in range(len(full)) if full[i]), key=lambda i: full[i])
    runs, i = [], 0
    while i < len(order):
        run = [order[i]]
        while (len(run) < rows and i + len(run) < len(order)
               and full[order[i + len(run)]][0] == full[run[0]][0]):
            run.append(order[i + len(run)])
        i += len(run)
        if len(run) > 1:
            runs.append((run, _common_pages([full[j] for j in run])))
    runs.sort(key=lambda r: (len(r[0]) - 1) * r[1], reverse=True)
    tiles = runs[:num_tiles]
    if sum((len(m) - 1) * n for m, n in tiles) < min_saved_pages:
        return None
    offsets = [0] * len(full)
    for members, n in tiles:
        for j in members:
            offsets[j] = n
    return tiles, offsets
