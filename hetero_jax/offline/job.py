"""The batch job's loop: input rows -> a front -> OUTPUT and ERRORS, as the rows finish.

In: `rows.InputRow`s in file order, a `Front`, an `OutputJournal` and an `ErrorLog`. `Feed`
sorts the rows as they are read: a row with no request, or a later row with an id already
seen, goes to ERRORS (stage "input"); a row whose id OUTPUT holds already is skipped; the
rest go to the front as (row, request) pairs. The front hands back a list of (row, result) (a
`RequestResult`: the output, or the `RequestError` that refused the request, whose `alone()`
names it without an index) each time some requests finish; each list is written at once
(`OutputJournal.append`: one write, flush and fsync), its failures and the feed's bad rows go
to ERRORS, and the counts to a `Tally`. One thread: the front runs inside the job's loop and
pulls the next rows only when it has room for them, so a run holds at most its front's
requests in flight.

`Front` is all the job needs from the engines, and `EngineFront` serves one `Engine` step by
step through the one synchronous drive (`serving.drive`); a front over several engines
(`replica_front`, `ray_data`) only has to keep the same contract. Imports no jax: the engine
is built by the caller (`offline.cli`).
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from hetero_jax.offline.journal import ErrorLog, OutputJournal
from hetero_jax.offline.rows import InputRow, error_row, failure, output_row
from hetero_jax.outputs import EmbeddingOutput
from hetero_jax.serving.drive import Drive


class Front(Protocol):
    def serve(self, items: Iterable[tuple]) -> Iterator[list]:
        """(key, request) pairs -> lists of (key, `RequestResult`), each list as soon as its
        requests have finished, every key exactly once: the request's output
        (`finish_reason="error"` when it failed running), or the `RequestError` with which
        the engine's checks refused it. `items` is pulled lazily, as room frees up."""


class EngineFront:
    """One `Engine`, driven through a `serving.drive.Drive`, with at most `max_in_flight`
    requests in it at a time (queued ones included, so the scheduler has both kinds to choose
    from). An error of a step that no single request is to blame for is raised (the requests
    in flight are aborted and nothing of theirs is written)."""

    def __init__(self, engine, max_in_flight: int):
        assert max_in_flight >= 1, f"{max_in_flight=} must be >= 1"
        self.engine, self.max_in_flight = engine, max_in_flight

    def serve(self, items: Iterable[tuple]) -> Iterator[list]:
        items, drive = iter(items), Drive(self.engine)
        try:
            while True:
                room = self.max_in_flight - len(drive)
                batch = list(itertools.islice(items, room))
                results = drive.admit(batch) + drive.step()
                if results:
                    yield results
                if len(batch) < room and not len(drive):
                    return
        finally:
            drive.abort_all()


@dataclasses.dataclass
class Tally:
    """What a run did. Tokens count the rows written in this run."""

    embeds: int = 0
    gens: int = 0
    prompt_tokens: int = 0  # input tokens of the rows written (embedding inputs and prompts)
    gen_tokens: int = 0
    skipped: int = 0  # rows OUTPUT held already
    bad_rows: int = 0  # ERRORS, stage "input": the row itself, or a repeated id
    refused: int = 0  # ERRORS, stage "engine": the engine's checks
    failed: int = 0  # ERRORS, stage "run": failed while running
    wall_s: float = 0.0

    @property
    def written(self) -> int:
        return self.embeds + self.gens

    @property
    def errors(self) -> int:
        return self.bad_rows + self.refused + self.failed


class Feed:
    """Iterating yields (row, request) for the rows to run; the other rows are counted
    (`skipped`) or kept as error rows until `take_errors`."""

    def __init__(self, rows: Iterable[InputRow], done: set):
        self._rows, self._done = rows, done
        self._first_line = {}  # id -> the line of its first row
        self._errors = []
        self.skipped = self.bad_rows = 0

    def __iter__(self) -> Iterator[tuple]:
        for row in self._rows:
            first = row.line if row.id is None else self._first_line.setdefault(row.id, row.line)
            if first != row.line:
                self._reject(row, f"duplicate id {row.id!r}: line {first} has it already")
            elif row.request is None:
                self._reject(row, row.error)
            elif row.id in self._done:
                self.skipped += 1
            else:
                yield row, row.request

    def _reject(self, row: InputRow, why: str) -> None:
        self.bad_rows += 1
        self._errors.append(error_row(row, why, "input"))

    def take_errors(self) -> list:
        errors, self._errors = self._errors, []
        return errors


def count_to_run(rows: Iterable[InputRow], done: set) -> int:
    """How many rows a run would hand to the front (for a progress bar's total)."""
    return sum(1 for _ in Feed(rows, done))


def run_job(rows: Iterable[InputRow], front: Front, journal: OutputJournal, errors: ErrorLog,
            on_batch: Callable[[int, Tally], None] | None = None) -> Tally:
    """Run every row not in OUTPUT yet; `on_batch(rows finished, tally)` after each batch."""
    tally, feed, start = Tally(), Feed(rows, journal.done), time.perf_counter()
    for batch in front.serve(feed):
        written, failed = [], feed.take_errors()
        for row, result in batch:
            problem = _problem(row, result, tally)
            if problem:
                failed.append(problem)
            else:
                written.append(output_row(row.id, result.output))
                _count(result.output, tally)
        journal.append(written)
        errors.append(failed)
        tally.wall_s = time.perf_counter() - start
        if on_batch:
            on_batch(len(batch), tally)
    errors.append(feed.take_errors())
    tally.skipped, tally.bad_rows = feed.skipped, feed.bad_rows
    tally.wall_s = time.perf_counter() - start
    return tally


def _problem(row: InputRow, result, tally: Tally) -> dict | None:
    """The error row of a refused or failed request (counted), or None for a result."""
    if result.error is not None:  # named as alone: the error row has the line
        tally.refused += 1
        return error_row(row, result.error.alone(), "engine")
    why = failure(result.output)
    if why is None:
        return None
    tally.failed += 1
    return error_row(row, why, "run")


def _count(out, tally: Tally) -> None:
    tally.prompt_tokens += len(out.prompt_token_ids)
    if isinstance(out, EmbeddingOutput):
        tally.embeds += 1
    else:
        tally.gens += 1
        tally.gen_tokens += len(out.token_ids)
