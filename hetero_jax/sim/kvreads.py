"""KV pages a decode step reads, with and without cascade attention (imports no jax).

In: a step's decode items (their page tables and KV lengths) and the engine's cascade
settings. Out: the pages of KV the attention reads. Without cascade every sequence reads
every page of its context. With cascade (`ops/cascade.py`: decode-only steps, at least two
sequences; `CascadeSettings.mixed` models the decodes of mixed steps too, which the engine
does not do yet) the engine cuts the decode sequences into at most G tiles of at most M rows that
share leading pages, and each tile reads its shared pages once; it does so only when the tiles
save at least `min_saved_pages` page reads. `plan_savings` counts them from the engine's own
planner, `sched.tiles.plan_tiles` (jax-free).
"""
from __future__ import annotations

import dataclasses

from hetero_jax.sched.output import DECODE
from hetero_jax.sched.tiles import plan_tiles


@dataclasses.dataclass(frozen=True)
class CascadeSettings:
    """The engine's cascade knobs (`EngineConfig.cascade_rows`, `cascade_min_pages`) and the
    sequence buckets that set the tile count G = S // M of a step with S sequence slots."""

    rows: int = 8  # M; 0 turns cascade off
    min_saved_pages: int = 16
    max_num_seqs: int = 32
    planned: bool = False  # tiles sized by the planner: up to S tiles of up to S rows
    mixed: bool = False  # cascade also over the decodes of a step with prefill or embedding

    def tiles(self, num_seqs: int) -> tuple:
        """(G, M) for a step of `num_seqs` decode sequences (S: its sequence bucket, powers
        of two from min(8, max_num_seqs) up to max_num_seqs, as `EngineConfig` pads); with
        `planned`, (S, S): `plan_tiles` cuts the runs that share a first page into as few
        tiles as they need, none capped at `rows`."""
        s = min(8, self.max_num_seqs)
        while s < num_seqs:
            s = min(2 * s, self.max_num_seqs)
        if self.planned:  # a tile per group of sequences sharing pages, each as long as it is
            return s, s
        rows = min(self.rows, s)
        return s // rows, rows


def plan_savings(page_tables: list, kv_lens: list, page_size: int, num_tiles: int, rows: int,
                 min_saved_pages: int) -> int:
    """Page reads the cascade tiles of `sched.tiles.plan_tiles` save ((members - 1) x shared
    pages, summed over the kept tiles), or 0 when the engine would run plain attention."""
    plan = plan_tiles(page_tables, kv_lens, page_size, num_tiles, rows, min_saved_pages)
    return 0 if plan is None else sum((len(m) - 1) * n for m, n in plan[0])


def kv_pages_saved(items: list, page_size: int, cascade: CascadeSettings | None) -> int:
    """Page reads a step of `items` (`ScheduledItem`s) saves under cascade attention (a
    decode-only step, or with `cascade.mixed` the decodes of any step)."""
    decodes = [it for it in items if it.kind == DECODE]
    if cascade is None or not cascade.rows or len(decodes) < 2 or (
            len(decodes) < len(items) and not cascade.mixed):
        return 0
    return plan_savings([it.pages for it in decodes], [it.start + 1 for it in decodes],
                        page_size, *cascade.tiles(len(decodes)), cascade.min_saved_pages)
