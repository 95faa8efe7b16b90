"""Argument types shared by every `hetero-jax` command, and the JSON writer.

In: a flag's text. Out: its value, or `argparse.ArgumentTypeError` naming the value and the
limit (argparse turns it into a `parser.error`, exit status 2). Paths are checked before any
work (`output_file`, `output_dir`). `DefaultsHelpFormatter` shows every flag's default in
`--help`. Imports no jax, so `sim`, `generate` and `bench` check
their flags before jax loads, and the bench and the simulator parse lists the same way.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import tempfile


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that ends each flag's text with its default, unless the text already says it
    (a default that depends on other flags) or the flag is a switch (off unless given)."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.nargs == 0 or "default" in text
                or action.default is argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def int_range(lo: int, hi: int):
    """An argparse type: an integer in [lo, hi]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is outside [{lo}, {hi}]")
        return value
    return parse


def real_range(lo: float, hi: float = math.inf, open_lo: bool = False):
    """An argparse type: a number in [lo, hi] ((lo, hi] with `open_lo`; hi=inf: open), not nan."""
    shown = f"{'(' if open_lo else '['}{lo:g}, {hi:g}{')' if math.isinf(hi) else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        inside = (lo < value if open_lo else lo <= value) and (
            value < hi if math.isinf(hi) else value <= hi)
        if not inside:  # nan is never inside
            raise argparse.ArgumentTypeError(f"{value} is outside {shown}")
        return value
    return parse


def output_problem(path: str, directory: bool = False) -> str | None:
    """Why `path` (a file, or with `directory` a directory) could not be written, or None.
    Missing directories on the way are fine when the nearest existing one can be written (the
    writer creates them). Leaves nothing behind: an existing file is opened to append and
    closed unchanged; a directory is probed with a nameless temporary file."""
    full = os.path.abspath(path)
    if os.path.exists(full):
        if os.path.isdir(full) != directory:
            return f"it is {'not ' if directory else ''}a directory"
        return _write_problem(full, directory, "it")
    parent = os.path.dirname(full)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent!r} is not a directory"
    return _write_problem(parent, True, repr(parent))


def _write_problem(path: str, directory: bool, name: str) -> str | None:
    if not (directory or os.path.isfile(path)):  # a device or a pipe: opening it may block
        return None if os.access(path, os.W_OK) else f"{name} is not writable"
    try:
        if directory:
            with tempfile.TemporaryFile(dir=path):
                pass
        else:
            with open(path, "ab"):
                pass
    except OSError as e:
        return f"{name} is not writable ({e.strerror or e})"
    return None


def output_file(text: str) -> str:
    """An argparse type: a file path that can be written (checked before any work)."""
    problem = output_problem(text) if text else None
    if problem:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {problem}")
    return text


def output_dir(text: str) -> str:
    """An argparse type: a directory that exists or can be created, and can be written."""
    problem = output_problem(text, directory=True)
    if problem:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {problem}")
    return text


def compile_cache_dir(text: str) -> str | None:
    """An argparse type for `--compile-cache`: 'auto' (the default directory, see
    `EngineConfig.compile_cache`), 'none' (None: off), or a directory that exists or can be
    created, and can be written."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    return output_dir(text)


def write_json(path: str, data, **kwargs) -> None:
    """`data` as JSON at `path`, creating the directories on the way."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, **kwargs)


def on_off(text: str) -> tuple:
    """An argparse type: on, off or on,off -> (True,), (False,) or (True, False)."""
    values = {"on": True, "off": False}
    parts = text.split(",")
    bad = next((p for i, p in enumerate(parts) if p not in values or p in parts[:i]), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(f"bad value {text!r}: {bad!r} is not on or off, or "
                                         "comes twice; expected on, off or on,off")
    return tuple(values[p] for p in parts)


def name_list(names, what: str):
    """An argparse type: a comma-separated subset of `names` (repeats dropped, order kept),
    or an error naming the first unknown one as `what`."""
    def parse(text: str) -> list:
        parts = [s for s in text.split(",") if s]
        bad = [s for s in parts if s not in names]
        if bad or not parts:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {bad[0] if bad else text!r}; expected a comma-separated "
                f"subset of {','.join(names)}")
        return list(dict.fromkeys(parts))
    return parse


def add_dtype_flag(p) -> None:
    """--dtype as every engine command takes it (auto: bfloat16 on GPUs, float32 on CPUs)."""
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="weights and KV cache; auto: bfloat16 on GPUs, float32 on CPUs "
                        "(default: %(default)s)")


def add_step_flags(p, ints: dict) -> None:
    """The engine step's shape flags every engine command shares (`ints`: the command's
    int_range checks by name), and --dtype."""
    p.add_argument("--token-budget", type=ints["token_budget"], default=256,
                   help="tokens per engine step")
    p.add_argument("--chunk-size", type=ints["chunk_size"], default=64,
                   help="prompt tokens per chunk")
    p.add_argument("--max-num-seqs", type=ints["max_num_seqs"], default=32,
                   help="sequences per engine step")
    add_dtype_flag(p)
