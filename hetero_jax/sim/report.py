"""Summary numbers and tables shared by the simulator, the bench and the command line.

In: lists of latencies (`percentile`), or result rows (dicts) and a column spec
(`format_table`). Out: a number, or the table as one string. Imports no jax (plain Python),
so the simulator and `scripts/bench_hol.py --sim-only` can use it without the engine.
"""
from __future__ import annotations


def percentile(xs: list, q: float) -> float | None:
    """Linear-interpolated q-th percentile (0..100) of xs; None when xs is empty."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    return "-" if value is None else fmt.format(value)


def format_table(rows: list, columns: list) -> str:
    """`columns`: [(header, row key, format)]. One line per row under a header and a rule;
    a value that is missing or None prints as `-`. Text columns (every value a string) are
    left-aligned, the others right-aligned."""
    cells = [[h for h, _, _ in columns]] + [[_cell(r, k, f) for _, k, f in columns]
                                            for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    text = [all(isinstance(r.get(k), str) for r in rows) for _, k, _ in columns]
    lines = ["  ".join(c.ljust(w) if left else c.rjust(w)
                       for c, w, left in zip(line, widths, text)) for line in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(line.rstrip() for line in lines)
