"""The rows of a batch job: input rows -> requests, outputs -> output rows (no jax).

In: an input file, JSONL (one JSON object a line) or Parquet (told apart by Parquet's magic
bytes, not the name; read only when `pyarrow` is importable). A row has an `id` (a string or an
integer) and either `embed` or `prompt` (a string, or a list of token ids); an `embed` row may
carry `PoolingParams` fields (`pooling`, `normalize`, `truncate`, `adapter`, `cache_salt`), a
`prompt` row `SamplingParams` fields (`max_tokens`, `temperature`, `top_k`, `top_p`, `seed`,
`stop_token_ids`, `ignore_eos`, `logprobs`, `cache_salt`, `stop` and the penalties; not `n`: a
row is one sample), with the same names, defaults and checks. A field set to null (or a Parquet
null) counts as absent; any other field is the row's error. A `prompt` row without a `seed`
samples with `row_seed(id)`, so its tokens depend on the row alone, not on where it runs or
what runs beside it.

Out: `read_rows` yields an `InputRow` per row in file order (its 1-based line in JSONL, row
in Parquet), with its request or the reason it has none; `output_row` turns an engine output
into the JSON object written for it and `error_row` a row that failed. `InputError` is what
makes a file no batch input at all (missing, unreadable, not JSONL, Parquet without pyarrow).

The input is read once: a regular file is checked, counted and then read, each pass a fresh
`open`; a pipe, a FIFO or `/dev/stdin` (`open_source` returns a `Source` with its `stream`)
is opened once, the lines its check reads are kept and handed out first, and no count is
made. Every problem of one line is that line's error, never the job's: not UTF-8 (a BOM on
line 1 is accepted), not JSON, nested deeper than the JSON reader follows, a number of more
digits than Python converts, a line over `MAX_ROW_BYTES` (skipped without being held).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import itertools
import numbers
import os
import reprlib
import stat
from collections.abc import Iterable, Iterator

from hetero_jax.outputs import EmbeddingOutput
from hetero_jax.requests import EmbedRequest, GenerateRequest, PoolingParams, SamplingParams

KINDS = {"embed": (EmbedRequest, PoolingParams), "prompt": (GenerateRequest, SamplingParams)}
PARAM_FIELDS = {kind: tuple(f.name for f in dataclasses.fields(params) if f.name != "n")
                for kind, (_, params) in KINDS.items()}  # a row is one sample: no `n`
PARQUET_MAGIC = b"PAR1"
PARQUET_BATCH_ROWS = 1024
MAX_ROW_BYTES = 16 * 2**20  # a longer JSONL line is that row's error (its bytes are skipped)
STREAM_HEAD_BYTES = 64 * 2**20  # a stream's lines held while looking for its first object


class InputError(ValueError):
    """The input is no batch input at all; the message names the file and why."""


@dataclasses.dataclass(frozen=True)
class Source:
    """A checked batch input: a regular file (`stream` None: read again for every pass), or
    a pipe, FIFO or character device, whose lines are read once from `stream`."""

    path: str
    format: str  # "jsonl" | "parquet"
    stream: Iterator | None = None  # raw lines (bytes) or over-long lines' lengths (int)


@dataclasses.dataclass(frozen=True)
class InputRow:
    line: int  # 1-based: the line of a JSONL file, the row of a Parquet file
    id: str | int | None  # None: the row has no usable id
    request: EmbedRequest | GenerateRequest | None  # None: `error` says why
    error: str | None = None


def row_seed(row_id, seed: int = 0) -> int:
    """The sampling seed of a prompt row that names none: fixed by its id and the job's seed."""
    digest = hashlib.blake2b(json.dumps([row_id, seed]).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**32


def input_format(path: str) -> str:
    """"parquet" or "jsonl" by the file's first bytes; InputError if it cannot be read."""
    if not os.path.exists(path):
        raise InputError(f"cannot read {path!r}: no such file")
    if os.path.isdir(path):
        raise InputError(f"cannot read {path!r}: it is a directory")
    try:
        with open(path, "rb") as f:
            head = f.read(len(PARQUET_MAGIC))
    except OSError as e:
        raise InputError(f"cannot read {path!r}: {e.strerror or e}") from None
    return "parquet" if head == PARQUET_MAGIC else "jsonl"


def json_kind(value) -> str:
    """What a parsed JSON value is, in JSON's words."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else "boolean"
    kinds = ((str, "string"), (numbers.Number, "number"), (list, "array"), (dict, "object"))
    return next((name for t, name in kinds if isinstance(value, t)), type(value).__name__)


def check_input(path: str) -> str:
    """The input's format ("jsonl" or "parquet") once it is known to be a batch input (an
    empty file is one); InputError otherwise. Reads JSONL only up to its first JSON object,
    and of Parquet only the schema, which must have an `id` column."""
    if input_format(path) == "parquet":
        pq = parquet_module(path)
        try:
            names = pq.read_schema(path).names
        except (OSError, ValueError) as e:
            raise InputError(f"cannot read {path!r} as Parquet: {e}") from None
        if "id" not in names:
            raise InputError(f"{path!r} has no 'id' column (its columns: {', '.join(names)})")
        return "parquet"
    with open(path, "rb") as f:
        _check_jsonl(path, _lines(f))
    return "jsonl"


def open_source(path: str) -> Source:
    """The checked input: a regular file (`check_input`), or a stream opened once, its first
    lines read up to its first JSON object and kept; InputError as `check_input`."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = 0
    if not mode or stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return Source(path, check_input(path))
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InputError(f"cannot read {path!r}: {e.strerror or e}") from None
    lines = _lines(f)
    first = next(lines, b"")
    if isinstance(first, bytes) and first.startswith(PARQUET_MAGIC):
        raise InputError(f"{path!r} is a pipe holding Parquet, which is read by seeking: "
                         "write it to a file first, or pipe JSONL")
    head = []
    _check_jsonl(path, _held(itertools.chain([first] if first else [], lines), head))
    return Source(path, "jsonl", itertools.chain(head, lines))


def _held(lines: Iterator, head: list) -> Iterator:
    """`lines`, each also appended to `head` (up to STREAM_HEAD_BYTES of them)."""
    held = 0
    for raw in lines:
        held += 0 if isinstance(raw, int) else len(raw)  # an over-long line is not held
        if held > STREAM_HEAD_BYTES:
            raise InputError(f"no JSON object in the first {STREAM_HEAD_BYTES} bytes of the "
                             "stream: not JSONL (one JSON object a line)")
        head.append(raw)
        yield raw


def _check_jsonl(path: str, lines: Iterable) -> None:
    """InputError unless a line holds a JSON object (or there are none); stops at the first."""
    first = None
    for line, record, problem in _jsonl_records(lines):
        if isinstance(record, dict):
            return
        first = first or (line, problem or f"a JSON {json_kind(record)}, not an object")
    if first:
        raise InputError(f"{path!r} is not JSONL (one JSON object a line): no line holds a "
                         f"JSON object; line {first[0]}: {first[1]}")


def read_rows(source: str | Source, seed: int = 0) -> Iterator[InputRow]:
    """Every row of the input (a path or a `Source`), in order (see the module docstring)."""
    source = source if isinstance(source, Source) else Source(source, input_format(source))
    if source.format == "parquet":
        records = _parquet_records(source.path)
    elif source.stream is not None:
        records = _jsonl_records(source.stream)
    else:
        records = _file_records(source.path)
    for line, record, problem in records:
        yield InputRow(line, None, None, problem) if problem else make_row(line, record, seed)


def _file_records(path: str) -> Iterator[tuple]:
    with open(path, "rb") as f:
        yield from _jsonl_records(_lines(f))


def _lines(f) -> Iterator:
    """The raw lines of a binary file; a line over MAX_ROW_BYTES comes as its length (an
    int), read in pieces and dropped."""
    limit = MAX_ROW_BYTES
    while raw := f.readline(limit + 1):
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield raw
            continue
        size, piece = len(raw), raw
        while piece and not piece.endswith(b"\n"):
            piece = f.readline(2**20)
            size += len(piece)
        yield size


def _jsonl_records(lines: Iterable) -> Iterator[tuple]:
    """(line, the parsed value, None) or (line, None, why it is no row); blank lines skipped."""
    for line, raw in enumerate(lines, 1):
        if isinstance(raw, int):
            yield line, None, f"a line of {raw} bytes, over the limit of {MAX_ROW_BYTES} bytes"
        elif raw.strip():
            yield (line, *_parse(raw, "utf-8-sig" if line == 1 else "utf-8"))


def _parse(raw: bytes, encoding: str) -> tuple:
    """(the JSON value, None) or (None, why the line is none)."""
    try:
        return json.loads(raw.decode(encoding)), None
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 text ({e.reason} at byte {e.start})"
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e.msg} at column {e.colno})"
    except RecursionError:
        return None, "JSON nested deeper than the reader follows (about 1,000 levels)"
    except ValueError as e:  # an integer of more digits than Python converts
        return None, f"not readable JSON ({e})"


def _parquet_records(path: str) -> Iterator[tuple]:
    """(row, a dict of the row's non-null columns, None) for every row of a Parquet file."""
    pq = parquet_module(path)
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH_ROWS)
        line = 0
        for batch in batches:
            for record in batch.to_pylist():
                line += 1
                yield line, record, None
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise InputError(f"cannot read {path!r} as Parquet: {e}") from None


def parquet_module(path: str):
    """`pyarrow.parquet`, or an InputError that says how to read `path` without it."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"{path!r} is a Parquet file, and reading Parquet needs pyarrow, "
                         "which is not installed (pip install pyarrow), or convert it to "
                         "JSONL") from None
    return pq


def make_row(line: int, record, seed: int = 0) -> InputRow:
    """One parsed record -> its InputRow: the request, or the first reason it has none."""
    if not isinstance(record, dict):
        return InputRow(line, None, None, f"not a JSON object but a JSON {json_kind(record)}")
    record = {k: v for k, v in record.items() if v is not None}
    row_id = record.pop("id", None)
    if row_id is None:
        return InputRow(line, None, None, "no 'id'")
    if isinstance(row_id, bool) or not isinstance(row_id, (str, numbers.Integral)):
        return InputRow(line, None, None, f"id={reprlib.repr(row_id)} must be a string or an "
                        f"integer, not a JSON {json_kind(row_id)}")
    row_id = row_id if isinstance(row_id, str) else int(row_id)
    try:
        return InputRow(line, row_id, make_request(row_id, record, seed))
    except (ValueError, TypeError) as e:
        return InputRow(line, row_id, None, str(e))
    except Exception as e:  # noqa: BLE001 - whatever one row does is that row's error
        return InputRow(line, row_id, None, f"{type(e).__name__}: {e}")


def make_request(row_id, fields: dict, seed: int = 0) -> EmbedRequest | GenerateRequest:
    """The request of a row's fields (its id removed); ValueError naming what is wrong."""
    kinds = [k for k in KINDS if k in fields]
    if len(kinds) != 1:
        raise ValueError("has both 'embed' and 'prompt'; expected one of them" if kinds else
                         "has neither 'embed' nor 'prompt'")
    kind = kinds[0]
    request_cls, params_cls = KINDS[kind]
    text = fields.pop(kind)
    unknown = sorted(set(fields) - set(PARAM_FIELDS[kind]))
    if unknown:
        hint = " (a row is one sample: one row per sample)" if "n" in unknown else ""
        raise ValueError(f"unknown field{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown))} for a {kind!r} row; expected "
                         f"{', '.join(PARAM_FIELDS[kind])}{hint}")
    expected = "a string or a list of token ids (integers)"
    if not isinstance(text, (str, list)):
        raise ValueError(f"{kind}={reprlib.repr(text)} is a JSON {json_kind(text)}; expected "
                         f"{expected}")
    bad = next((i for i, t in enumerate(text) if isinstance(t, bool) or not isinstance(
        t, numbers.Integral)), None) if isinstance(text, list) else None
    if bad is not None:
        raise ValueError(f"{kind} item {bad} is {reprlib.repr(text[bad])}, a JSON "
                         f"{json_kind(text[bad])}; expected {expected}")
    if kind == "prompt" and "seed" not in fields:
        fields["seed"] = row_seed(row_id, seed)
    return request_cls(text, params_cls(**fields))


def output_row(row_id, out) -> dict:
    """The JSON object written to OUTPUT for a finished `EmbeddingOutput` / `RequestOutput`."""
    row = {"id": row_id}
    if isinstance(out, EmbeddingOutput):
        row.update(embedding=out.embedding.tolist(), finish_reason=out.finish_reason)
    else:
        row.update(text=out.text, token_ids=list(out.token_ids), finish_reason=out.finish_reason)
        if out.logprobs is not None:
            row["logprobs"] = [dict(logprob=t["logprob"], top=[list(p) for p in t["top"]])
                               for t in out.logprobs]
    row["prompt_tokens"] = len(out.prompt_token_ids)
    return row


def failure(out) -> str | None:
    """Why an engine output is no result (finish_reason "error" or "abort"), or None."""
    if out.finish_reason in ("error", "abort"):
        return out.error or f"finish_reason={out.finish_reason!r}"
    if isinstance(out, EmbeddingOutput) and out.embedding is None:
        return "no embedding came back"
    return None


def error_row(row: InputRow, error: str, stage: str) -> dict:
    """The JSON object written to ERRORS: where the row is, what failed and at which stage
    ("input": the row itself, "engine": the engine's checks, "run": it failed running)."""
    return {"line": row.line, "id": row.id, "stage": stage, "error": error}
