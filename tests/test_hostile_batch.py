"""Nothing silent in `hetero-jax batch` (issue 30): a piped input is read once and every row
runs; one hostile row (nested 1,500 deep, over the size limit, a 5,000-digit number, a BOM)
is that row's error with its line; OUTPUT and ERRORS are regular files or `-`, ERRORS is
locked like OUTPUT; every flag of every command has help text; and a property test over
generated hostile files: every good row once, equal to a clean run, every bad row in ERRORS
with its line. The jobs run on `test_batch_job.FakeFront` (no jax)."""
import argparse
import fcntl
import json
import os
import random
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetero_jax import cli
from hetero_jax.offline import cli as batch_cli
from hetero_jax.offline import rows as rows_mod
from hetero_jax.offline.journal import ErrorLog, OutputError
from tests.test_batch_job import (KILL_SCRIPT, ROOT, FakeFront, batch_process, by_id, fake_front,
                                  killed_then_finished, mixed_rows, read_jsonl, run_rows,
                                  write_jsonl)


@pytest.fixture
def fake_engine(monkeypatch):
    monkeypatch.setattr(batch_cli, "make_front", fake_front)


def run_cli(argv) -> int:
    try:
        return cli.main(["batch", *argv, "--no-progress"])
    except SystemExit as e:
        return e.code


# -- 1. an input read once: pipes, FIFOs, /dev/stdin ----------------------------------------

def piped_run(tmp_path, source: str, stdin=None, writer=None):
    out = str(tmp_path / "out.jsonl")
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, source, "--output", out,
                             "--no-progress"], cwd=ROOT, stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        if writer:
            writer()
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, stdout.decode(), stderr.decode(), out


def test_rows_from_a_pipe_run_once_each(tmp_path):
    rows = mixed_rows(40)
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    proc_in = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    status, stdout, stderr, out = piped_run(tmp_path, "/dev/stdin", stdin=proc_in.stdout,
                                            writer=lambda: (proc_in.stdin.write(data),
                                                            proc_in.stdin.close()))
    proc_in.wait()
    assert status == 0, stderr[-2000:]
    assert "40 rows written" in stdout, stdout
    assert sorted(by_id(read_jsonl(out)), key=str) == sorted((r["id"] for r in rows), key=str)


def test_rows_from_a_fifo_run_once_each(tmp_path):
    rows = mixed_rows(30)
    src = write_jsonl(tmp_path / "rows.jsonl", rows)
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    feeder = subprocess.Popen(["sh", "-c", f"cat {src} > {fifo}"])
    status, stdout, stderr, out = piped_run(tmp_path, fifo)
    feeder.kill()
    assert status == 0, stderr[-2000:]
    assert "30 rows written" in stdout, stdout
    assert len(by_id(read_jsonl(out))) == 30


# -- 2. one hostile row is that row's error -------------------------------------------------

def test_hostile_rows_are_their_own_errors_with_their_lines(tmp_path, fake_engine, monkeypatch):
    monkeypatch.setattr(rows_mod, "MAX_ROW_BYTES", 4500)
    lines = ['\ufeff{"id": "a", "embed": "x"}',  # a UTF-8 BOM on line 1
             '{"id": "deep", "embed": ' + "[" * 1500 + "]" * 1500 + "}",
             '{"id": "huge", "prompt": "' + "y" * 5000 + '"}',
             '{"id": "digits", "prompt": "x", "max_tokens": ' + "9" * 4400 + "}",
             '{"id": "nest", "prompt": [[[[[[[[1]]]]]]]]}',
             '{"id": "b", "prompt": "z", "max_tokens": 2}']
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = str(tmp_path / "out.jsonl")
    assert run_cli([inp, "--output", out]) == 0
    assert sorted(by_id(read_jsonl(out))) == ["a", "b"]
    errors = {e["line"]: e for e in read_jsonl(out + ".errors.jsonl")}
    assert sorted(errors) == [2, 3, 4, 5], errors
    assert "nested" in errors[2]["error"] and "deeper" in errors[2]["error"]
    assert "4500" in errors[3]["error"] and "bytes" in errors[3]["error"]
    assert "digits" in errors[4]["error"] or "number" in errors[4]["error"]
    assert len(errors[5]["error"]) < 300, errors[5]["error"]


def test_a_first_line_with_a_bom_or_deep_nesting_still_makes_a_batch_input(tmp_path):
    bom = write_jsonl(tmp_path / "bom.jsonl", ['\ufeff{"id": 1, "embed": "x"}'])
    deep = write_jsonl(tmp_path / "deep.jsonl", ["[" * 5000 + "]" * 5000,
                                                 '{"id": 1, "embed": "x"}'])
    assert rows_mod.check_input(bom) == rows_mod.check_input(deep) == "jsonl"
    assert [r.request is not None for r in rows_mod.read_rows(bom)] == [True]
    assert [r.line for r in rows_mod.read_rows(deep) if r.error] == [1]


# -- 3. special output files --------------------------------------------------------------

def special_outputs(tmp_path) -> list:
    good = write_jsonl(tmp_path / "good.jsonl", [{"id": 1, "embed": "x"}])
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    out = str(tmp_path / "out.jsonl")
    return [([good, "--output", "/dev/full"], "argument --output: '/dev/full' is not a "
             "regular file"),
            ([good, "--output", fifo], f"argument --output: {fifo!r} is not a regular file"),
            ([good, "--output", out, "--errors", "/dev/full"],
             "argument --errors: '/dev/full' is not a regular file"),
            ([good, "--output", out, "--errors", fifo],
             f"argument --errors: {fifo!r} is not a regular file")]


def test_outputs_must_be_regular_files(tmp_path, fake_engine, capsys):
    for argv, message in special_outputs(tmp_path):
        assert run_cli(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert message in err and "or - for" in err, (argv, err)
    assert not os.path.exists(tmp_path / "out.jsonl")


def test_output_dash_writes_rows_to_stdout_without_resume(tmp_path, fake_engine, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", mixed_rows(12) + ['{"id": "bad"}'])
    assert run_cli([inp, "--output", "-"]) == 0
    captured = capsys.readouterr()
    got = [json.loads(line) for line in captured.out.splitlines()]
    assert sorted(by_id(got), key=str) == sorted((r["id"] for r in mixed_rows(12)), key=str)
    assert '"line": 13' in captured.err and "rows written" in captured.err
    assert "- for stdout" in batch_cli.build_parser().format_help()


def test_the_errors_file_is_locked_like_the_output(tmp_path, fake_engine, capsys):
    good = write_jsonl(tmp_path / "good.jsonl", [{"id": 1, "embed": "x"}])
    errors = tmp_path / "shared.errors.jsonl"
    errors.write_text('{"line": 1}\n')
    with open(errors, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(OutputError, match="is being written by another batch job"):
            ErrorLog(str(errors))
        assert run_cli([good, "--output", str(tmp_path / "o.jsonl"), "--errors",
                        str(errors)]) == 2
        assert "argument --errors:" in capsys.readouterr().err
    assert errors.read_text() == '{"line": 1}\n', "a refused run emptied another job's errors"


# -- 11. help on every flag ------------------------------------------------------------------

def every_parser():
    from hetero_jax.bench.config import build_parser as bench_parser
    from hetero_jax.sim.cli import build_parser as sim_parser

    todo = [cli.build_parser(), batch_cli.build_parser(), bench_parser(), sim_parser()]
    while todo:
        parser = todo.pop()
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())


def test_every_flag_of_every_command_has_help_text():
    missing = [(p.prog, a.dest) for p in every_parser() for a in p._actions
               if a.dest != "help" and not isinstance(a, argparse._SubParsersAction)
               and not (a.help and a.help.strip())]
    assert not missing, missing


# -- the property: hostile files ----------------------------------------------------------

OVER_LIMIT = '{"id": "k", "prompt": "' + "w" * 3000 + '"}'  # over the tests' 2048-byte limit
BAD_LINES = [
    "[" * 1500 + "]" * 1500, '{"id": 1, "embed": ' + "[" * 2000 + "]" * 2000 + "}",
    "\udcff\udcfe not utf-8", "not json", '"a string"', "[1, 2]", "null", '{"embed": "x"}',
    '{"id": [1], "embed": "x"}', '{"id": true, "embed": "x"}', '{"id": 1.5, "prompt": "x"}',
    '{"id": "k", "prompt": "x", "embed": "y"}', '{"id": "k"}', '{"id": "k", "prompt": 5}',
    '{"id": "k", "prompt": "x", "max_tokens": -1}', '{"id": "k", "prompt": "x", "n": 2}',
    '{"id": "k", "prompt": "x", "max_tokens": ' + "7" * 4500 + "}",
    OVER_LIMIT, '{"id": "k", "embed": "x", "pooling": 3}',
    '{"id": "k", "prompt": "x", "temperature": NaN}', '{"id": "k", "prompt": {"a": 1}}',
]


def hostile_file(draw_lines: list, bad_lines=tuple(BAD_LINES)) -> tuple:
    """(file lines, {good id: its row}, [lines that must be errors])"""
    lines, good, bad = [], {}, []
    for i, (kind, pick) in enumerate(draw_lines, 1):
        if kind == "good":
            row = dict(mixed_rows(60, seed=pick % 7)[pick % 60], id=f"g{i}")
            good[row["id"]] = row
            lines.append(json.dumps(row))
        else:
            lines.append(bad_lines[pick % len(bad_lines)].replace('"k"', f'"b{i}"'))
            bad.append(i)
    return lines, good, bad


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["good", "good", "bad"]), st.integers(0, 10**6)),
                min_size=1, max_size=30))
def test_hostile_files_keep_every_good_row_once_and_name_every_bad_line(tmp_path_factory, drawn):
    tmp = tmp_path_factory.mktemp("hostile")
    lines, good, bad = hostile_file(drawn)
    rows_mod.MAX_ROW_BYTES, limit = 2048, rows_mod.MAX_ROW_BYTES
    try:
        path = tmp / "in.jsonl"
        path.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape") + b"\n")
        run_rows(str(path), tmp / "out.jsonl", FakeFront())
        clean = write_jsonl(tmp / "clean.jsonl", list(good.values()))
        run_rows(clean, tmp / "clean.out.jsonl", FakeFront())
    finally:
        rows_mod.MAX_ROW_BYTES = limit
    assert by_id(read_jsonl(tmp / "out.jsonl")) == by_id(read_jsonl(tmp / "clean.out.jsonl"))
    errors = read_jsonl(tmp / "out.jsonl.errors.jsonl")
    assert sorted(e["line"] for e in errors) == bad


@pytest.mark.slow  # about 20 s: 3 seeds x (a clean run, 3 killed runs and the last one)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hostile_files_killed_and_resumed_keep_every_good_row_once(tmp_path, seed):
    rng = random.Random(seed)
    drawn = [(rng.choice(["good", "good", "bad"]), rng.randrange(10**6)) for _ in range(200)]
    lines, good, bad = hostile_file(drawn, [b for b in BAD_LINES if b != OVER_LIMIT])
    inp = tmp_path / "in.jsonl"
    inp.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape") + b"\n")
    clean = write_jsonl(tmp_path / "clean.jsonl", list(good.values()))
    ref, out = str(tmp_path / "ref.jsonl"), str(tmp_path / "out.jsonl")
    flags = ["--no-progress", "--compile-cache", "none"]
    proc = batch_process([clean, "--output", ref, *flags])
    assert proc.wait(timeout=60) == 0, proc.stderr.read()[-2000:]
    landed = killed_then_finished([str(inp), "--output", out, *flags], out,
                                  os.path.getsize(ref), kills=3, seed=seed, script=KILL_SCRIPT,
                                  timeout=60)
    assert landed >= 2
    assert by_id(read_jsonl(out)) == by_id(read_jsonl(ref))
    assert sorted(e["line"] for e in read_jsonl(out + ".errors.jsonl")) == bad
