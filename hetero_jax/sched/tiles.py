"""Cascade attention's host-side plan: which decode sequences share which pages (no jax).

In: the page tables and KV lengths of a decode-only step's sequences and the engine's cascade
knobs (`CascadeSettings`). Out: tiles of at most M sequences sharing leading pages and, per
sequence, where its own pages start, or None when the tiles would save too few page reads.
The scheduler plans each step it forms (`CascadeSettings.plan`, into
`SchedulerOutput.cascade`), the runner (`runner/batch.py`) lays that plan out for
`ops.cascade`, and the cost models (`costmodel.py`, the simulator's and the cost-aware IBS's)
count the page reads it saves (`kv_pages_saved`). Without cascade every sequence reads every
page of its context; with it each tile reads its shared pages once.
"""
from __future__ import annotations

import collections
import dataclasses

from hetero_jax.sched.output import DECODE
from hetero_jax.sched.shapes import default_seq_buckets, pad_to_bucket


def _common_pages(first: tuple, last: tuple) -> int:
    """Length of the common prefix of two page lists: the first and last of a sorted run,
    whose common prefix every list between them shares."""
    n = min(len(first), len(last))
    return next((i for i in range(n) if first[i] != last[i]), n)


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
    # only a sequence whose first full page another one holds too can join a run
    firsts = collections.Counter(t[0] for t, n in zip(page_tables, kv_lens) if n > page_size)
    full = [tuple(t[:(n - 1) // page_size]) if n > page_size and firsts[t[0]] > 1 else ()
            for t, n in zip(page_tables, kv_lens)]
    order = sorted((i for i in range(len(full)) if full[i]), key=lambda i: full[i])
    runs, i = [], 0
    while i < len(order):
        run = [order[i]]
        while (len(run) < rows and i + len(run) < len(order)
               and full[order[i + len(run)]][0] == full[run[0]][0]):
            run.append(order[i + len(run)])
        i += len(run)
        if len(run) > 1:
            runs.append((run, _common_pages(full[run[0]], full[run[-1]])))
    runs.sort(key=lambda r: (len(r[0]) - 1) * r[1], reverse=True)
    tiles = runs[:num_tiles]
    if saved_pages(tiles) < min_saved_pages:
        return None
    offsets = [0] * len(full)
    for members, n in tiles:
        for j in members:
            offsets[j] = n
    return tiles, offsets


@dataclasses.dataclass(frozen=True)
class CascadeSettings:
    """The engine's cascade knobs (`EngineConfig.cascade_rows`, `cascade_min_pages`) and the
    sequence buckets that set the tile count G = S // M of a step with S sequence slots
    (`seq_buckets`; None: the default buckets of `max_num_seqs`). `planned` and `mixed` are the
    simulator's what-ifs, which the engine does not do yet: tiles sized by the planner, and
    cascade over the decodes of a step with prefill or embedding chunks too."""

    rows: int = 8  # M; 0 turns cascade off
    min_saved_pages: int = 16
    max_num_seqs: int = 32
    seq_buckets: tuple | None = None
    planned: bool = False  # up to S tiles of up to S rows: as many and as long as runs need
    mixed: bool = False  # cascade also over the decodes of a mixed step (kv_pages_saved)

    def tiles(self, num_seqs: int) -> tuple:
        """(G, M) for a step of `num_seqs` decode sequences (S: its sequence bucket); with
        `planned`, (S, S): `plan_tiles` cuts the runs that share a first page into as few
        tiles as they need, none capped at `rows`."""
        s = pad_to_bucket(num_seqs, self.seq_buckets or default_seq_buckets(self.max_num_seqs))
        if self.planned:
            return s, s
        rows = min(self.rows, s)
        return s // rows, rows

    def plan(self, items: list, page_size: int) -> tuple | None:
        """`plan_tiles` for a step of `items` (`ScheduledItem`s), or None (plain attention):
        only decode-only steps of at least two sequences, none penalized (the penalties read
        whole page tables), are planned."""
        if not self.rows or len(items) < 2 or any(it.kind != DECODE for it in items):
            return None
        if any(it.knobs is not None and it.knobs.penalized for it in items):  # None: sim
            return None
        return plan_tiles([it.pages for it in items], [it.start + 1 for it in items], page_size,
                          *self.tiles(len(items)), self.min_saved_pages)


def kv_pages_saved(items: list, page_size: int, cascade: CascadeSettings | None) -> int:
    """Page reads a step of `items` (`ScheduledItem`s) saves under cascade attention (a
    decode-only step, or with `cascade.mixed` the decodes of any step)."""
    if cascade is not None and cascade.mixed:
        items = [it for it in items if it.kind == DECODE]
    plan = None if cascade is None else cascade.plan(items, page_size)
    return 0 if plan is None else saved_pages(plan[0])


def saved_pages(tiles: list) -> int:
    """Page reads `tiles` ([(members, shared_pages)]) save: (members - 1) x shared pages."""
    return sum((len(m) - 1) * n for m, n in tiles)
