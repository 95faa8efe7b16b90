"""KV pages a decode step reads, with and without cascade attention (imports no jax).

In: a step's decode items (their page tables and KV lengths) and the engine's cascade
settings. Out: the pages of KV the attention reads. Without cascade every sequence reads
every page of its context. With cascade (`ops/cascade.py`: decode-only steps, at least two
sequences) the engine cuts the decode sequences into at most G tiles of at most M rows that
share leading pages, and each tile reads its shared pages once; it does so only when the tiles
save at least `min_saved_pages` page reads. `plan_savings` follows `ops.cascade.plan_tiles`
step by step (sort the page tables, cut runs of up to M that share their first page, keep the
G runs that save most), which cannot be imported here because that module imports jax;
tests/test_sim_kvreads.py checks the two agree on random page tables.
"""
from __future__ import annotations

import dataclasses

from hetero_jax.sched.output import DECODE


@dataclasses.dataclass(frozen=True)
class CascadeSettings:
    """The engine's cascade knobs (`EngineConfig.cascade_rows`, `cascade_min_pages`) and the
    sequence buckets that set the tile count G = S // M of a step with S sequence slots."""

    rows: int = 8  # M; 0 turns cascade off
    min_saved_pages: int = 16
    max_num_seqs: int = 32

    def tiles(self, num_seqs: int) -> tuple:
        """(G, M) for a step of `num_seqs` decode sequences (S: its sequence bucket, powers
        of two from min(8, max_num_seqs) up to max_num_seqs, as `EngineConfig` pads)."""
        s = min(8, self.max_num_seqs)
        while s < num_seqs:
            s = min(2 * s, self.max_num_seqs)
        rows = min(self.rows, s)
        return s // rows, rows


def _common_pages(tables: list) -> int:
    n = min(len(t) for t in tables)
    first = tables[0]
    for i in range(n):
        if any(t[i] != first[i] for t in tables[1:]):
            return i
    return n


def plan_savings(page_tables: list, kv_lens: list, page_size: int, num_tiles: int, rows: int,
                 min_saved_pages: int) -> int:
    """Page reads the cascade tiles save ((members - 1) x shared pages, summed over the kept
    tiles), or 0 when that is under `min_saved_pages` (the engine then runs plain attention)."""
    full = [list(t[:(n - 1) // page_size]) for t, n in zip(page_tables, kv_lens)]
    order = sorted((i for i in range(len(full)) if full[i]), key=lambda i: full[i])
    runs, i = [], 0
    while i < len(order):
        run = [order[i]]
        while (len(run) < rows and i + len(run) < len(order)
               and full[order[i + len(run)]][0] == full[run[0]][0]):
            run.append(order[i + len(run)])
        i += len(run)
        if len(run) > 1:
            runs.append((len(run) - 1) * _common_pages([full[j] for j in run]))
    saved = sum(sorted(runs, reverse=True)[:num_tiles])
    return saved if saved >= min_saved_pages else 0


def kv_pages_saved(items: list, page_size: int, cascade: CascadeSettings | None) -> int:
    """Page reads a step of `items` (`ScheduledItem`s) saves under cascade attention."""
    if cascade is None or not cascade.rows or len(items) < 2 or any(
            it.kind != DECODE for it in items):
        return 0
    return plan_savings([it.pages for it in items], [it.start + 1 for it in items], page_size,
                        *cascade.tiles(len(items)), cascade.min_saved_pages)
