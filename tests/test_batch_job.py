"""`hetero-jax batch`: its rows equal the engine's own outputs, a rerun skips what is written,
killed runs (SIGKILL at random points) resume to the uninterrupted result with every id once,
bad rows land in the errors file with their line numbers, and bad command lines are argparse
errors before any model work. This module imports no jax at import time: the kill tests'
subprocesses import its `FakeFront`, a deterministic, jax-free stand-in for the engine."""
import fcntl
import json
import os
import random
import subprocess
import sys
import time
import types
import zlib

import numpy as np
import pytest

from hetero_jax import cli
from hetero_jax.offline import cli as batch_cli
from hetero_jax.offline.job import EngineFront, run_job
from hetero_jax.offline.journal import ErrorLog, OutputError, OutputJournal
from hetero_jax.offline.rows import make_row, read_rows, row_seed
from hetero_jax.outputs import EmbeddingOutput, RequestOutput, RequestResult
from hetero_jax.requests import EmbedRequest, PoolingParams, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEN = dict(max_tokens=8, temperature=0.0)


class FakeFront:
    """An engine stand-in: an embedding and generated tokens that depend on the request's
    input alone, in batches of 1 to 7 rows, `delay` s apart; ids in `fail` fail running."""

    def __init__(self, delay: float = 0.0, fail=(), dim: int = 384):
        self.delay, self.fail, self.dim = delay, set(fail), dim
        self.served = []  # the ids handed to serve, in order

    def serve(self, items):
        rng, batch = random.Random(0), []
        for row, request in items:
            self.served.append(row.id)
            batch.append((row, RequestResult(self.result(row.id, request))))
            if len(batch) >= rng.randint(1, 7):
                time.sleep(self.delay)
                yield batch
                batch = []
        if batch:
            yield batch

    def result(self, row_id, request):
        text = request.input if isinstance(request, EmbedRequest) else request.prompt
        ids = list(text.encode()) if isinstance(text, str) else list(text)
        rng = np.random.default_rng(zlib.crc32(json.dumps(text).encode()))
        if isinstance(request, EmbedRequest):
            vec = None if row_id in self.fail else rng.standard_normal(self.dim, np.float32)
            return EmbeddingOutput(0, ids, vec, "error" if vec is None else "embedded", {},
                                   error="boom" if vec is None else None)
        if row_id in self.fail:
            return RequestOutput(0, ids, [], None, "error", None, {}, error="boom")
        tokens = rng.integers(0, 256, request.params.max_tokens).tolist()
        return RequestOutput(0, ids, tokens, bytes(tokens).decode("latin-1"), "length", None, {})


def fake_front(args):
    """`offline.cli.make_front` for the kill tests' subprocesses: no engine."""
    stats = types.SimpleNamespace(compile_s=0.0, compiles=0)
    return FakeFront(delay=0.004), types.SimpleNamespace(stats=stats), "model: a fake front"


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    return str(path)


def read_jsonl(path) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f]


def by_id(rows) -> dict:
    out = {r["id"]: r for r in rows}
    assert len(out) == len(rows), "an id was written twice"
    return out


def mixed_rows(n: int, seed: int = 0) -> list:
    """n rows: embeddings (text, token ids, four poolings) and generations (greedy, sampled
    with and without a seed)."""
    rng, rows = random.Random(seed), []
    for i in range(n):
        text = " ".join(rng.choice(["jax", "pages", "embed", "batch", "the", "scan"])
                        for _ in range(rng.randint(2, 30)))
        if i % 3:
            rows.append({"id": f"e{i}", "embed": text if i % 5 else [256, 7 + i, 9, 300],
                         "pooling": ["mean", "last", "cls", "weighted_mean"][i % 4],
                         "normalize": i % 2 == 0})
        else:  # greedy, sampled with a seed, greedy, sampled without one, ...
            knobs = {} if i % 6 == 0 else {"temperature": 0.9, "top_p": 0.9}
            rows.append({"id": i, "prompt": text, **GEN, **knobs,
                         **({"seed": i} if i % 4 == 3 else {})})
    return rows


# -- rows ----------------------------------------------------------------------------------

def test_row_fields_map_to_params_and_a_missing_seed_comes_from_the_id():
    row = make_row(3, {"id": "q", "prompt": [1, 2], "max_tokens": 4, "top_k": 5, "seed": None,
                       "stop_token_ids": [10]}, seed=7)
    assert row.request.params == SamplingParams(max_tokens=4, top_k=5, stop_token_ids=(10,),
                                                seed=row_seed("q", 7))
    assert row_seed("q", 7) == row_seed("q", 7) != row_seed("q", 8) != row_seed("r", 7)
    emb = make_row(4, {"id": 5, "embed": "x", "pooling": "cls", "truncate": True})
    assert (emb.id, emb.request.input, emb.request.params) == (
        5, "x", PoolingParams(pooling="cls", truncate=True))
    stop = make_row(5, {"id": "s", "prompt": "x", "stop": ["\n"]})
    assert stop.request.params.stop == ("\n",)
    many = make_row(6, {"id": "n", "prompt": "x", "n": 2})
    assert many.request is None and "unknown field 'n'" in many.error
    assert "one row per sample" in many.error


# -- against the engine ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    from hetero_jax import Engine, EngineConfig

    return Engine.from_preset("tiny", config=EngineConfig(  # two step variants to compile
        token_budget=64, chunk_size=16, max_num_seqs=8, max_chunk_seqs=1, max_model_len=256,
        token_buckets=(64,), page_buckets=(16,)))


def run_rows(path, out, front, seed=0):
    journal, errors = OutputJournal.open(str(out)), ErrorLog(str(out) + ".errors.jsonl")
    try:
        return run_job(read_rows(path, seed), front, journal, errors)
    finally:
        journal.close()
        errors.close()


def test_rows_equal_the_engine_generate_and_embed(engine, tmp_path):
    rows = mixed_rows(24)
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    tally = run_rows(inp, tmp_path / "out.jsonl", EngineFront(engine, max_in_flight=5))
    got = by_id(read_jsonl(tmp_path / "out.jsonl"))
    gens = [r for r in rows if "prompt" in r]
    embeds = [r for r in rows if "embed" in r]
    assert (tally.gens, tally.embeds, tally.errors, len(got)) == (len(gens), len(embeds), 0, 24)
    want = engine.generate([r["prompt"] for r in gens], [SamplingParams(**{
        "seed": row_seed(r["id"]), **{k: v for k, v in r.items() if k not in ("id", "prompt")}})
        for r in gens], use_tqdm=False)
    for r, w in zip(gens, want):
        assert (got[r["id"]]["token_ids"], got[r["id"]]["text"]) == (w.token_ids, w.text)
        assert got[r["id"]]["finish_reason"] == w.finish_reason
    vecs = engine.embed([r["embed"] for r in embeds], [PoolingParams(
        pooling=r["pooling"], normalize=r["normalize"]) for r in embeds], use_tqdm=False)
    np.testing.assert_allclose([got[r["id"]]["embedding"] for r in embeds], vecs, rtol=1e-5,
                               atol=1e-6)  # fp32; the batches differ
    assert tally.gen_tokens == sum(len(w.token_ids) for w in want)


def test_bad_rows_go_to_the_errors_file_with_their_lines(engine, tmp_path):
    lines = ['{"id": "ok1", "embed": "fine"}', "not json", "", "[1, 2]", '{"embed": "no id"}',
             '{"id": true, "embed": "x"}', '{"id": "ok1", "embed": "again"}',
             '{"id": "both", "embed": "x", "prompt": "y"}', '{"id": "neither"}',
             '{"id": "unk", "prompt": "x", "stops": ["."]}',
             '{"id": "neg", "prompt": "x", "temperature": -1}',
             '{"id": "vocab", "embed": [1, 9999]}', '{"id": "empty", "prompt": ""}',
             '{"id": "long", "prompt": "' + "x" * 300 + '"}',
             '{"id": "ok2", "prompt": "fine", "max_tokens": 3}']
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    tally = run_rows(inp, tmp_path / "out.jsonl", EngineFront(engine, max_in_flight=3))
    assert sorted(by_id(read_jsonl(tmp_path / "out.jsonl"))) == ["ok1", "ok2"]
    errors = {e["line"]: e for e in read_jsonl(tmp_path / "out.jsonl.errors.jsonl")}
    want = {2: ("input", None, "not JSON"), 4: ("input", None, "JSON array"),
            5: ("input", None, "no 'id'"), 6: ("input", None, "id=True must be"),
            7: ("input", "ok1", "duplicate id 'ok1': line 1 has it already"),
            8: ("input", "both", "has both 'embed' and 'prompt'"),
            9: ("input", "neither", "has neither"),
            10: ("input", "unk", "unknown field 'stops'"),
            11: ("input", "neg", "temperature=-1.0 must be >= 0"),
            12: ("engine", "vocab", "the input: token id 9999 outside [0, 512)"),
            13: ("engine", "empty", "the prompt is empty"),
            14: ("engine", "long", "the prompt has 301 tokens; max_model_len=256")}
    assert sorted(errors) == sorted(want), errors
    for line, (stage, row_id, message) in want.items():
        e = errors[line]
        assert (e["stage"], e["id"]) == (stage, row_id) and message in e["error"], e
    assert (tally.bad_rows, tally.refused, tally.failed) == (9, 3, 0)


def test_rerun_skips_written_ids_and_cuts_a_torn_last_line(engine, tmp_path, monkeypatch):
    rows = mixed_rows(12, seed=1)
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    run_rows(inp, tmp_path / "ref.jsonl", EngineFront(engine, max_in_flight=4))
    ref = read_jsonl(tmp_path / "ref.jsonl")
    with open(tmp_path / "ref.jsonl", "rb") as f:
        raw = f.read().splitlines(keepends=True)
    (tmp_path / "out.jsonl").write_bytes(b"".join(raw[:5]) + raw[5][:40])  # a torn 6th row
    journal = OutputJournal.open(str(tmp_path / "out.jsonl"))
    assert journal.dropped_bytes == 40 and journal.done == {r["id"] for r in ref[:5]}
    journal.close()
    served, prepare = [], engine.prepare
    monkeypatch.setattr(engine, "prepare", lambda reqs: served.extend(reqs) or prepare(reqs))
    tally = run_rows(inp, tmp_path / "out.jsonl", EngineFront(engine, max_in_flight=4))
    assert (tally.skipped, tally.written, len(served)) == (5, 7, 7)
    got, want = by_id(read_jsonl(tmp_path / "out.jsonl")), by_id(ref)
    assert sorted(got, key=str) == sorted(want, key=str)
    for row_id, w in want.items():
        if "token_ids" in w:
            assert got[row_id]["token_ids"] == w["token_ids"]
        else:
            np.testing.assert_allclose(got[row_id]["embedding"], w["embedding"], rtol=1e-5,
                                       atol=1e-6)


# -- run-time failures and kills (the fake front) --------------------------------------------

def test_failed_requests_are_error_rows_and_a_rerun_retries_them(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", mixed_rows(20))
    tally = run_rows(inp, tmp_path / "out.jsonl", FakeFront(fail={"e1", 6}))
    errors = read_jsonl(tmp_path / "out.jsonl.errors.jsonl")
    assert sorted((e["line"], e["id"], e["stage"], e["error"]) for e in errors) == [
        (2, "e1", "run", "boom"), (7, 6, "run", "boom")]
    assert (tally.failed, tally.written) == (2, 18)
    again = FakeFront()
    tally = run_rows(inp, tmp_path / "out.jsonl", again)
    assert sorted(again.served, key=str) == [6, "e1"] and tally.skipped == 18
    assert read_jsonl(tmp_path / "out.jsonl.errors.jsonl") == []  # the new run's: none
    assert len(by_id(read_jsonl(tmp_path / "out.jsonl"))) == 20


def test_a_run_whose_every_row_failed_exits_1_and_says_so(tmp_path, monkeypatch, capsys):
    """The corpus file itself is no batch input (rows without 'embed' or 'prompt'): a run of
    it wrote nothing, and must not look like success. One good row makes it a success."""
    monkeypatch.setattr(batch_cli, "make_front", fake_front)
    rows = [{"id": "a", "text": "a passage"}, {"id": "b", "text": "another"}]
    out, errors = tmp_path / "out.jsonl", tmp_path / "out.jsonl.errors.jsonl"
    inp = write_jsonl(tmp_path / "corpus.jsonl", rows)
    assert batch_cli.batch_main([inp, "--output", str(out), "--no-progress"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"hetero-jax batch: every row failed: 2 rows went to {errors}, none to {out}")
    inp = write_jsonl(tmp_path / "mixed.jsonl", rows + [{"id": "c", "embed": "x"}])
    assert batch_cli.batch_main([inp, "--output", str(out), "--no-progress"]) == 0
    assert "every row failed" not in capsys.readouterr().err


KILL_SCRIPT = ("import sys\nfrom hetero_jax.offline import cli\nimport tests.test_batch_job as t\n"
               "cli.make_front = t.fake_front\nsys.exit(cli.batch_main(sys.argv[1:]))\n")


def batch_process(args, script=KILL_SCRIPT):
    return subprocess.Popen([sys.executable, "-c", script, *args] if script else
                            [sys.executable, "-m", "hetero_jax.cli", "batch", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_when_written(proc, path, nbytes: int, timeout: float) -> bool:
    """SIGKILL `proc` once `path` holds `nbytes`; False if it ended first."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if os.path.exists(path) and os.path.getsize(path) >= nbytes:
            proc.kill()
            proc.wait()
            return True
        time.sleep(0.002)
    assert proc.poll() is not None, f"{proc.args} still running after {timeout} s"
    return False


def killed_then_finished(args, out, total_bytes: int, kills: int, seed: int, script,
                         timeout: float) -> int:
    """Run, SIGKILL at `kills` random points (by bytes written), then run to the end; returns
    how many kills landed."""
    rng, landed = random.Random(seed), 0
    for _ in range(kills):
        landed += kill_when_written(batch_process(args, script), out,
                                    rng.randint(1, total_bytes - 1), timeout)
    proc = batch_process(args, script)
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return landed


def test_sigkilled_runs_resume_to_the_uninterrupted_result(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", mixed_rows(300))
    ref, out = str(tmp_path / "ref.jsonl"), str(tmp_path / "out.jsonl")
    flags = ["--compile-cache", "none", "--no-progress"]
    proc = batch_process([inp, "--output", ref, *flags])
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    landed = killed_then_finished([inp, "--output", out, *flags], out, os.path.getsize(ref),
                                  kills=3, seed=0, script=KILL_SCRIPT, timeout=60)
    assert landed >= 2
    assert by_id(read_jsonl(out)) == by_id(read_jsonl(ref))  # every id once, the same rows


@pytest.mark.slow  # about 1-2 minutes: four engine processes of the tiny preset
def test_sigkilled_engine_runs_resume_to_the_uninterrupted_result(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", mixed_rows(90, seed=2))
    ref, out = str(tmp_path / "ref.jsonl"), str(tmp_path / "out.jsonl")
    flags = ["--compile-cache", str(tmp_path / "xla"), "--no-progress", "--max-in-flight", "16"]
    proc = batch_process([inp, "--output", ref, *flags], script=None)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    landed = killed_then_finished([inp, "--output", out, *flags], out, os.path.getsize(ref),
                                  kills=3, seed=1, script=None, timeout=300)
    assert landed >= 2
    got, want = by_id(read_jsonl(out)), by_id(read_jsonl(ref))
    assert sorted(got, key=str) == sorted(want, key=str)
    for row_id, w in want.items():
        g = got[row_id]
        if "embedding" in w:
            np.testing.assert_allclose(g["embedding"], w["embedding"], rtol=1e-5, atol=1e-6)
        else:
            assert (g["token_ids"], g["text"]) == (w["token_ids"], w["text"]), row_id


# -- the command line ------------------------------------------------------------------------

@pytest.fixture
def no_engine(monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("the engine was built before the command line was checked")
    monkeypatch.setattr(batch_cli, "make_front", no_work)


def error_line(e, capsys) -> str:
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "error: " in err[-1], err
    return err[-1]


def bad_command_lines(tmp_path) -> list:
    """(argv after `batch`, what the error line says)"""
    good = write_jsonl(tmp_path / "good.jsonl", [{"id": 1, "embed": "x"}])
    a_file = write_jsonl(tmp_path / "a_file", ["x"])
    csv = write_jsonl(tmp_path / "rows.csv", ["id,embed", "1,hello"])
    (tmp_path / "bin.jsonl").write_bytes(b"\x00\xff\xfe\x00binary\n")
    (tmp_path / "fake.parquet").write_bytes(b"PAR1 not really parquet")
    foreign = write_jsonl(tmp_path / "foreign.jsonl", ['{"id": 1}', "plain text", ""])
    out = str(tmp_path / "out.jsonl")
    return [
        ([str(tmp_path / "nope.jsonl"), "--output", out],
         f"argument INPUT: cannot read '{tmp_path}/nope.jsonl': no such file"),
        ([str(tmp_path), "--output", out], f"cannot read '{tmp_path}': it is a directory"),
        ([csv, "--output", out], f"argument INPUT: '{csv}' is not JSONL (one JSON object a "
         "line): no line holds a JSON object; line 1: not JSON (Expecting value at column 1)"),
        ([str(tmp_path / "bin.jsonl"), "--output", out], "line 1: not UTF-8 text"),
        ([str(tmp_path / "fake.parquet"), "--output", out], "Parquet"),
        ([good, "--output", f"{a_file}/out.jsonl"],
         f"argument --output: cannot write '{a_file}/out.jsonl'"),
        ([good, "--output", str(tmp_path)], f"argument --output: cannot write '{tmp_path}': "
         "it is a directory"),
        ([good, "--output", good], f"argument --output: {good!r} is INPUT too"),
        ([good, "--output", out, "--errors", out], f"argument --errors: {out!r} is --output too"),
        ([good, "--output", foreign], f"argument --output: {foreign!r} line 2 is not JSON"),
        ([good, "--output", out, "--preset", "huge"], "argument --preset: invalid choice"),
        ([good, "--output", out, "--model", "/no/such/dir"],
         "argument --model: '/no/such/dir' is not a directory"),
        ([good, "--output", out, "--scheduler", "vllm"], "argument --scheduler: invalid choice"),
        ([good, "--output", out, "--max-num-seqs", "0"], "argument --max-num-seqs: 0 is outside"),
        ([good, "--output", out, "--max-in-flight", "x"],
         "argument --max-in-flight: 'x' is not an integer"),
        ([good], "the following arguments are required: --output"),
    ]


def test_bad_command_lines_are_argparse_errors_before_any_engine(tmp_path, no_engine, capsys):
    for argv, message in bad_command_lines(tmp_path):
        with pytest.raises(SystemExit) as e:
            cli.main(["batch", *argv])
        line = error_line(e, capsys)
        assert line.startswith("hetero-jax batch: error: ") and message in line, (argv, line)
    assert not os.path.exists(tmp_path / "out.jsonl")


def test_parquet_without_pyarrow_says_so(tmp_path, monkeypatch, no_engine, capsys):
    (tmp_path / "in.parquet").write_bytes(b"PAR1 whatever")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(SystemExit) as e:
        cli.main(["batch", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "o")])
    assert "reading Parquet needs pyarrow, which is not installed (pip install pyarrow)" in \
        error_line(e, capsys)


def test_parquet_rows_run_like_jsonl_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"id": "a", "embed": "x", "prompt": None, "max_tokens": None},
            {"id": "b", "embed": None, "prompt": "y", "max_tokens": 3}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    write_jsonl(tmp_path / "in.jsonl", [{k: v for k, v in r.items() if v is not None}
                                        for r in rows])
    for name in ("in.parquet", "in.jsonl"):
        run_rows(str(tmp_path / name), tmp_path / f"{name}.out", FakeFront())
    assert read_jsonl(tmp_path / "in.parquet.out") == read_jsonl(tmp_path / "in.jsonl.out")


def test_an_output_another_job_writes_is_refused(tmp_path, no_engine, capsys):
    good = write_jsonl(tmp_path / "good.jsonl", [{"id": 1, "embed": "x"}])
    out = tmp_path / "out.jsonl"
    with open(out, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(OutputError, match="is being written by another batch job"):
            OutputJournal.open(str(out))
        with pytest.raises(SystemExit) as e:
            cli.main(["batch", good, "--output", str(out)])
        assert "argument --output:" in error_line(e, capsys)


def test_a_bad_input_fails_before_jax_is_imported(tmp_path):
    code = ("import sys\nfrom hetero_jax.cli import main\ntry:\n"
            f"    status = main(['batch', {str(tmp_path / 'nope')!r}, '--output', "
            f"{str(tmp_path / 'o')!r}])\n"
            "except SystemExit as e:\n    status = e.code\nprint(status, 'jax' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.stdout.split() == ["2", "False"], (proc.stdout, proc.stderr[-2000:])
