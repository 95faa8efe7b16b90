"""The cases of `scripts/hostile_pass.py` (issue 30), by defect class; none is named by a test.

Each case is `Case(cls, name, fn)` with `fn(ctx) -> (outcome, detail)`; the helpers below
(`batch`, `raises`, `loads`, ...) run one kind of input and say what happened.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import signal
import socket
import threading

import numpy as np

from hetero_jax import EmbedRequest, Engine, EngineConfig, GenerateRequest, PoolingParams, \
    SamplingParams

SMALL = dict(token_budget=32, chunk_size=16, max_num_seqs=4, max_chunk_seqs=1, max_model_len=64,
             token_buckets=(32,), page_buckets=(4,), seq_buckets=(4,), cascade_rows=0)
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@dataclasses.dataclass
class Case:
    cls: str
    name: str
    fn: object


class Ctx:
    """A temporary directory, and the engines and model directories the cases share."""

    def __init__(self, tmp: str):
        self.tmp, self._n, self._cache = tmp, 0, {}
        self.cfg = EngineConfig(**SMALL, compile_cache=os.path.join(tmp, "xla"))

    def path(self, name: str) -> str:
        self._n += 1
        return os.path.join(self.tmp, f"{self._n}-{name}")

    def once(self, key: str, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    @property
    def engine(self) -> Engine:
        return self.once("engine", lambda: Engine.from_preset("tiny", config=self.cfg))

    @property
    def poisoned(self) -> Engine:
        """The tiny preset with token 100's embedding row NaN."""
        def make():
            from hetero_jax.models import llama
            from hetero_jax.models.presets import preset_config
            from hetero_jax.models.tokenizer import ByteTokenizer

            cfg = preset_config("tiny")
            params = llama.init_params(cfg, 0)
            params = dict(params, embed=params["embed"].at[100].set(np.nan))
            return Engine(cfg, params, ByteTokenizer(), self.cfg)
        return self.once("poisoned", make)

    @property
    def model_dir(self) -> str:
        """A one-layer tiny model in Hugging Face layout, with a word-level tokenizer."""
        def make():
            import dataclasses as dc

            from hetero_jax.models import llama
            from hetero_jax.models.formats.hf_llama import export_hf_model
            from hetero_jax.models.presets import preset_config

            cfg = dc.replace(preset_config("tiny"), num_layers=1, bos_token_id=1,
                             eos_token_ids=(2,))
            path = self.path("model")
            export_hf_model(path, cfg, {k: np.asarray(v) if k != "layers" else
                                        {n: np.asarray(a) for n, a in v.items()}
                                        for k, v in llama.init_params(cfg, 0).items()})
            write_tokenizer(path, 8)
            return path
        return self.once("model_dir", make)

    def close(self) -> None:
        for value in self._cache.values():
            if hasattr(value, "close"):
                value.close()


def write_tokenizer(path: str, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(dict(tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>",
                       eos_token="</s>", unk_token="[UNK]"), f)


# -- batch jobs ------------------------------------------------------------------------------

def good(i: int) -> str:
    """A good row: an embedding or a short greedy generation."""
    row = ({"id": f"g{i}", "embed": f"text {i}"} if i % 2 else
           {"id": f"g{i}", "prompt": f"say {i}", "max_tokens": 2, "temperature": 0})
    return json.dumps(row)


def _feed(kind: str, data: bytes, ctx: Ctx) -> tuple:
    """(the INPUT path, a cleanup) for data as a regular file, a FIFO or a pipe."""
    if kind == "file":
        path = ctx.path("in.jsonl")
        with open(path, "wb") as f:
            f.write(data)
        return path, lambda: None
    if kind == "fifo":
        path = ctx.path("fifo")
        os.mkfifo(path)

        def write():
            with open(path, "wb") as f:
                f.write(data)
        threading.Thread(target=write, daemon=True).start()
        return path, lambda: None
    r, w = os.pipe()

    def write_pipe():
        with os.fdopen(w, "wb") as f:
            f.write(data)
    threading.Thread(target=write_pipe, daemon=True).start()
    return f"/dev/fd/{r}", lambda: os.close(r)


def run_batch(ctx: Ctx, argv: list) -> tuple:
    """(exit status, stdout, stderr) of `hetero-jax batch` on the shared tiny engine."""
    from hetero_jax import cli
    from hetero_jax.offline import cli as batch_cli
    from hetero_jax.offline.job import EngineFront

    real = batch_cli.make_front
    batch_cli.make_front = lambda args: (EngineFront(ctx.engine, 16), ctx.engine, "tiny")
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = cli.main(["batch", *argv, "--no-progress"])
            except SystemExit as e:
                status = e.code
    finally:
        batch_cli.make_front = real
    return status, out.getvalue(), err.getvalue()


def batch(lines: list, bad: list, kind: str = "file", argv=(), refused: str | None = None,
          output: str | None = None):
    """A case: INPUT of `lines` (str or bytes) fed as `kind`; the rows at the 1-based lines
    `bad` must be in ERRORS with their lines and every other line's row in OUTPUT; or, with
    `refused`, the command must fail with exit status 2 and that text."""
    def fn(ctx: Ctx):
        data = b"".join((x if isinstance(x, bytes) else x.encode("utf-8", "surrogatepass"))
                        + b"\n" for x in lines)
        path, cleanup = _feed(kind, data, ctx)
        out = output or ctx.path("out.jsonl")
        try:
            status, stdout, stderr = run_batch(ctx, [path, "--output", out, *argv])
        finally:
            cleanup()
        if refused is not None:
            return _refused(status, stderr, refused)
        if status != 0:
            return "crash", f"exit {status}: {stderr[-300:]}"
        rows = ([json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
                if out == "-" else _jsonl(out))
        errors = _jsonl(out + ".errors.jsonl") if out != "-" else [
            json.loads(x) for x in stderr.splitlines() if x.startswith('{"line"')]
        want = {json.loads(x.lstrip("\ufeff"))["id"] for i, x in enumerate(lines, 1)
                if i not in bad and isinstance(x, str) and x.strip()}
        got_bad = sorted(e["line"] for e in errors if e.get("error"))
        if {r["id"] for r in rows} == want and len(rows) == len(want) and got_bad == bad:
            return "clear", ""
        return "silent", f"rows {sorted(r['id'] for r in rows)} want {sorted(want)}; " \
                         f"errors at {got_bad} want {bad}"
    return fn


def _jsonl(path: str) -> list:
    with open(path) as f:
        return [json.loads(x) for x in f]


def _refused(status, stderr: str, needle: str) -> tuple:
    if status == 0:
        return "silent", "accepted"
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if status == 2 and needle in last:
        return "clear", ""
    return "crash", f"exit {status}: {last[:300]}"


# -- API calls, loads, configs -----------------------------------------------------------------

def raises(call, needle: str, engine: str = "engine"):
    """A case: `call(engine)` must raise ValueError/TypeError naming `needle`."""
    def fn(ctx: Ctx):
        eng = getattr(ctx, engine)
        try:
            call(eng)
        except (ValueError, TypeError) as e:
            if eng.has_work():
                return "crash", "requests left in the engine"
            return ("clear", "") if needle in str(e) else ("crash", f"unclear: {e}")
        return "silent", "no error"
    return fn


def outputs(call, check, engine: str = "engine"):
    """A case: `call(engine)` returns outputs that `check(outputs)` accepts."""
    def fn(ctx: Ctx):
        outs = call(getattr(ctx, engine))
        return ("clear", "") if check(outs) else ("silent", f"{outs!r:.300}")
    return fn


def edited_model(ctx: Ctx, config=None, tensors=None, files=None) -> str:
    """A copy of the shared model directory: config.json keys changed, tensors edited (name ->
    fn(array)), files replaced (name -> bytes, "dir" for a directory, None to delete)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    path = ctx.path("edited")
    shutil.copytree(ctx.model_dir, path)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(raw, **(config or {})), f)
    if tensors:
        st = os.path.join(path, "model.safetensors")
        weights = load_file(st)
        for name, edit in tensors.items():
            weights[name] = edit(weights[name].copy())
        save_file(weights, st)
    for name, content in (files or {}).items():
        target = os.path.join(path, name)
        os.remove(target)
        if content == "dir":
            os.mkdir(target)
        elif content is not None:
            with open(target, "wb") as f:
                f.write(content)
    return path


def loads(needle: str, engine=None, **edits):
    """A case: the edited model directory (`edited_model`) must be refused naming `needle`;
    `engine`: EngineConfig fields to change for it."""
    def fn(ctx: Ctx):
        path = edited_model(ctx, **edits)
        try:
            Engine.from_pretrained(path, config=dataclasses.replace(ctx.cfg, **(engine or {})))
        except (ValueError, FileNotFoundError) as e:
            return ("clear", "") if needle in str(e) else ("crash", f"unclear: {e}")
        return "silent", "loaded"
    return fn


def config(needle: str, build: bool = True, **fields):
    """A case: EngineConfig(**fields) (and with `build` an engine of it) must be refused
    naming `needle`, before anything is allocated."""
    def fn(ctx: Ctx):
        try:
            cfg = EngineConfig(**fields)
            if build:
                Engine.from_preset("tiny", config=cfg)
        except (ValueError, TypeError) as e:
            return ("clear", "") if needle in str(e) else ("crash", f"unclear: {e}")
        return "silent", "accepted"
    return fn


def cli_refused(argv: list, needle: str):
    """A case: `hetero-jax ARGV` must exit 2 naming `needle` before any engine is built."""
    def fn(ctx: Ctx):
        import hetero_jax
        from hetero_jax import cli

        real = hetero_jax.Engine

        class Refuse:
            @staticmethod
            def from_preset(*a, **k):
                raise AssertionError("reached the engine")
            from_pretrained = from_preset
        hetero_jax.Engine = Refuse
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    status = (cli.main(argv) if argv[0] != "bench" else _bench(argv[1:]))
                except SystemExit as e:
                    status = e.code
        except AssertionError:
            return "silent", "reached the engine"
        finally:
            hetero_jax.Engine = real
        return _refused(status, err.getvalue(), needle)
    return fn


def _bench(argv: list) -> int:
    from hetero_jax.bench.config import parse_config

    parse_config(argv)
    return 0


def kill_replicas(which: list, expect_down: bool):
    """A case: two replicas, `which` of them killed while idle, then 8 generations: every one
    served by a survivor, or (all killed) a RuntimeError saying every replica is down."""
    def fn(ctx: Ctx):
        from hetero_jax.serving.replicas import ReplicaSet

        with ReplicaSet.from_preset("tiny", 2, config=ctx.cfg) as rs:
            for i in which:
                os.kill(rs._procs[i].pid, signal.SIGKILL)
                rs._procs[i].join(timeout=30)
            try:
                outs = rs.generate([[256, i + 1] for i in range(8)], GREEDY)
            except RuntimeError as e:
                ok = expect_down and "every one of the 2 replicas is down" in str(e)
                return ("clear", "") if ok else ("crash", str(e)[:300])
            ok = not expect_down and all(o.finish_reason == "length" for o in outs)
            return ("clear", "") if ok else ("silent", [o.error for o in outs][:3])
    return fn


def unix_socket(ctx: Ctx) -> str:
    path = ctx.path("sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    ctx.once(path, lambda: s)
    return path


def special_output(make, needle: str, flag: str = "--output"):
    """A case: a batch job whose `flag` is the special file `make(ctx)` must be refused."""
    def fn(ctx: Ctx):
        inp = ctx.path("in.jsonl")
        with open(inp, "w") as f:
            f.write(good(1) + "\n")
        target = make(ctx)
        argv = [inp, "--output", target] if flag == "--output" else \
            [inp, "--output", ctx.path("o.jsonl"), "--errors", target]
        status, _, stderr = run_batch(ctx, argv)
        return _refused(status, stderr, needle)
    return fn


def errors_aliasing_output(ctx: Ctx):
    """A case: --errors a symlink to --output must be refused."""
    inp, out = ctx.path("in.jsonl"), ctx.path("o.jsonl")
    with open(inp, "w") as f:
        f.write(good(1) + "\n")
    link = symlink_to(out)(ctx)
    status, _, stderr = run_batch(ctx, [inp, "--output", out, "--errors", link])
    return _refused(status, stderr, "is --output too")


def locked_errors(ctx: Ctx):
    import fcntl

    path = ctx.path("held.errors.jsonl")
    held = open(path, "w")
    fcntl.flock(held, fcntl.LOCK_EX)
    ctx.once(path, lambda: held)
    return path


def symlink_to(target: str):
    def make(ctx: Ctx) -> str:
        link = ctx.path("link")
        os.symlink(target, link)
        return link
    return make


def help_complete(command: str):
    """A case: every flag of `command` has help text."""
    def fn(ctx: Ctx):
        import argparse

        from hetero_jax import cli
        from hetero_jax.bench.config import build_parser as bench
        from hetero_jax.offline.cli import build_parser as batch
        from hetero_jax.sim.cli import build_parser as sim

        parser = dict(batch=batch, bench=bench, sim=sim)[command]() if command != "generate" \
            else cli.build_parser()._subparsers._group_actions[0].choices["generate"]
        bare = [a.dest for a in parser._actions if a.dest != "help"
                and not isinstance(a, argparse._SubParsersAction) and not (a.help or "").strip()]
        return ("clear", "") if not bare else ("silent", f"no help: {bare}")
    return fn
