"""Cascade attention's host-side plan: which decode sequences share which pages (no jax).

In: the page tables and KV lengths of a step's decode sequences and the engine's cascade knobs
(`CascadeSettings`). Out: tiles of at most M sequences sharing leading pages and, per
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
    """Length of the common prefix of two page lists (of a sorted run: the first and last,
    whose common prefix every list between them shares), by bisection over slices."""
    n = min(len(first), len(last))
    if first[:n] == last[:n]:
        return n
    lo, hi = 0, n  # first[:lo] == last[:lo], first[:hi] != last[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if first[:mid] == last[:mid] else (lo, mid)
    return lo


def _adjacent(full: list, run: list) -> list:
    """The pages each list of a sorted `run` (indices into `full`) shares with the next: at
    least the c the whole run shares, and past c only where the lists agree on page c (one
    look for most pairs; the rest bisect)."""
    c = _common_pages(full[run[0]], full[run[-1]])
    out = []
    for a, b in zip(run, run[1:]):
        x, y = full[a], full[b]
        out.append(c if len(x) <= c or len(y) <= c or x[c] != y[c] else _common_pages(x, y))
    return out


def _split_run(lcp: list) -> tuple:
    """The tiles over a sorted run of n page lists (lcp[i]: the pages lists i and i + 1
    share) that save most reads, exactly: (saved, [(first, last, shared pages)]).

    best[j + 1], the most the first j + 1 lists save, is best[j] (list j in no tile) or, for a
    tile i..j, best[i] + (j - i) x min(lcp[i:j]). The starts i are kept on a stack in blocks
    of equal min(lcp[i:j]) = h, each with max(best[i] - h * i), so a step reads each block
    once; a block is re-scored only when a smaller lcp joins it to the one below (a run of
    nested prefixes, a system prompt then documents, has a few blocks: about n x levels)."""
    n = len(lcp) + 1
    if n == 1:
        return 0, []
    if min(lcp) == max(lcp):  # one shared prefix: one tile of all
        return (n - 1) * lcp[0], [(0, n - 1, lcp[0])]
    best, choice = [0, 0], [None, None]  # choice[j + 1]: (start, shared) of the tile ending at j
    stack = []  # [h, max of best[i] - h * i, its i, every start i of the block]
    for j in range(1, n):
        h, top, top_i, starts = lcp[j - 1], best[j - 1] - lcp[j - 1] * (j - 1), j - 1, [j - 1]
        while stack and stack[-1][0] >= h:
            bh, bval, bi, bstarts = stack.pop()
            if bh > h:  # re-scored at the smaller h
                bval, bi = max((best[i] - h * i, i) for i in bstarts)
            if bval > top:
                top, top_i = bval, bi
            if len(bstarts) > len(starts):  # the longer list absorbs the shorter
                bstarts, starts = starts, bstarts
            starts.extend(bstarts)
        stack.append([h, top, top_i, starts])
        tile = max(((v + bh * j, i, bh) for bh, v, i, _ in stack), default=None)
        if tile is not None and tile[0] > best[j]:
            best.append(tile[0])
            choice.append(tile[1:])
        else:
            best.append(best[j])
            choice.append(None)
    tiles, j = [], n - 1
    while j >= 0:
        if choice[j + 1] is None:
            j -= 1
        else:
            i, h = choice[j + 1]
            tiles.append((i, j, h))
            j = i - 1
    return best[-1], tiles[::-1]


def plan_tiles(page_tables: list, kv_lens: list, page_size: int, num_tiles: int, rows: int,
               min_saved_pages: int) -> tuple | None:
    """Tiles for decode sequences with page tables `page_tables` ([Sd] lists) and `kv_lens`.

    Sequences are sorted by their page tables, so those with long common prefixes sit side by
    side, and grouped into runs that share their first page. A run of at most `rows` is split
    where that saves most reads (`_split_run`: a system prompt shared by all and a document
    shared by some make a tile per document); a longer run is cut into runs of `rows`. A
    tile's shared pages are its common prefix, capped so that each sequence keeps its last
    token's page.
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
        j = i + 1
        while j < len(order) and full[order[j]][0] == full[order[i]][0]:
            j += 1
        group, i = order[i:j], j
        if len(group) <= rows:
            runs += [(group[lo:hi + 1], n) for lo, hi, n in _split_run(_adjacent(full, group))[1]]
            continue
        for k in range(0, len(group), rows):
            run = group[k:k + rows]
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
    (`seq_buckets`; None: the default buckets of `max_num_seqs`). `planned`: tiles sized by
    the planner; `mixed`: cascade over the decodes of a step with prefill or embedding chunks
    too. The engine on the Pallas kernel does both (its tiles are data, `ops.cascade.TileList`);
    on XLA neither; the simulator takes each as a what-if."""

    rows: int = 8  # M; 0 turns cascade off
    min_saved_pages: int = 16
    max_num_seqs: int = 32
    seq_buckets: tuple | None = None
    planned: bool = False  # up to S // 2 tiles of up to S rows: as many and as long as needed
    mixed: bool = False  # cascade also over the decodes of a mixed step (kv_pages_saved)
    block_rows: int = 0  # members one read of a tile's shared pages serves (0: the whole tile)

    def tiles(self, num_seqs: int) -> tuple:
        """(G, M) for a step of `num_seqs` sequences (S: its sequence bucket); with `planned`,
        (S // 2, S): `plan_tiles` cuts the runs that share a first page into as few tiles as
        they need, none capped at `rows` (a tile has two members or more)."""
        s = pad_to_bucket(num_seqs, self.seq_buckets or default_seq_buckets(self.max_num_seqs))
        if self.planned:
            return s // 2, s
        rows = min(self.rows, s)
        return s // rows, rows

    def plan(self, items: list, page_size: int) -> tuple | None:
        """`plan_tiles` over the decodes of a step of `items` (`ScheduledItem`s sorted by kind,
        decodes last), its indices the step's, or None (plain attention): at least two
        decodes, none penalized (the penalties read whole page tables), in a decode-only step
        unless `mixed`."""
        decodes = [it for it in items if it.kind == DECODE]
        if not self.rows or len(decodes) < 2 or (len(decodes) < len(items) and not self.mixed):
            return None
        if any(it.knobs is not None and it.knobs.penalized for it in decodes):  # None: sim
            return None
        lead = len(items) - len(decodes)
        assert all(it.kind == DECODE for it in items[lead:]), "decodes come last in a step"
        return in_step(plan_tiles([it.pages for it in decodes], [it.start + 1 for it in decodes],
                                  page_size, *self.tiles(len(items)), self.min_saved_pages), lead)


def in_step(plan: tuple | None, lead: int) -> tuple | None:
    """A plan of `plan_tiles` over a step's decodes as indices of the step, whose first `lead`
    sequences are its chunks (they skip no pages)."""
    if plan is None or not lead:
        return plan
    return [([lead + j for j in m], n) for m, n in plan[0]], [0] * lead + plan[1]


def kv_pages_saved(items: list, page_size: int, cascade: CascadeSettings | None) -> int:
    """Page reads a step of `items` (`ScheduledItem`s) saves under cascade attention (a
    decode-only step, or with `cascade.mixed` the decodes of any step)."""
    plan = None if cascade is None else cascade.plan(items, page_size)
    return 0 if plan is None else saved_pages(plan[0], cascade.block_rows)


def saved_pages(tiles: list, block_rows: int = 0) -> int:
    """Page reads `tiles` ([(members, shared_pages)]) save: (members - reads) x shared pages,
    a tile read once, or once per `block_rows` members."""
    return sum((len(m) - (-(-len(m) // block_rows) if block_rows else 1)) * n for m, n in tiles)


# (token, query head) rows of one Pallas program where chunks run, as the cascade tiles' launch
# uses them (`ops.pallas_attention.default_block_q(..., decode_only=False)`)
KERNEL_TILE_ROWS = 64


def kernel_block_rows(num_heads: int, num_kv_heads: int) -> int:
    """Members of a cascade tile that one program of the Pallas kernel serves: its rows over
    the query heads of a KV head, rounded up to a power of two."""
    group = num_heads // num_kv_heads
    return max(1, KERNEL_TILE_ROWS // (1 << (group - 1).bit_length()))
