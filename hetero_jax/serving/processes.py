"""What every engine in other processes shares: dedicated mode's two workers, `replicas`'
N workers and Ray's actors are siblings over this module (imports no jax, nor any other part
of `serving`).

`ModelSource` is how a child builds its engine, as plain data it can be sent: a preset (name,
seed) or a Hugging Face directory, with an optional separate encoder and LoRA adapters; the
child calls `Engine.from_source(source, config)` and gets the whole engine it names (dedicated
mode's generation worker asks `generation_only()` for one without the embedding parts).
`child_env` sets what a spawned child must see before it imports jax (one XLA thread,
`one_thread_flags`, and extras such as a replica's CUDA_VISIBLE_DEVICES); `stop_workers` ends
workers through their pipes. An error crosses a pipe as (type name, message, traceback):
`described_error` in the child, `remote_error` in the parent, which raises the checks' own
types (`PIPE_ERRORS`) as themselves.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback

ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
PIPE_ERRORS = {"ValueError": ValueError, "TypeError": TypeError,
               "FileNotFoundError": FileNotFoundError}  # errors that cross a pipe as themselves


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """How a worker builds its engine: a preset (name, seed) or a Hugging Face directory."""

    preset: str | None = None
    seed: int = 0
    path: str | None = None
    embed_model: str | None = None  # a separate encoder
    embed_adapter: str | dict | None = None  # LoRA adapters

    def generation_only(self) -> "ModelSource":
        """The same model without a separate encoder or adapters (they only embed)."""
        return dataclasses.replace(self, embed_model=None, embed_adapter=None)


def one_thread_flags(flags: str) -> str:
    """`flags` (XLA_FLAGS) with one XLA thread added, once."""
    return flags if ONE_THREAD in flags else f"{flags} {ONE_THREAD}".strip()


@contextlib.contextmanager
def child_env(**extra: str):
    """XLA_FLAGS (and the `extra` variables, such as a replica's CUDA_VISIBLE_DEVICES) for a
    child started inside (spawn copies the environment at start, so even modules the child
    imports before its target runs see them); restored afterwards."""
    values = dict(extra, XLA_FLAGS=one_thread_flags(os.environ.get("XLA_FLAGS") or ""))
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def stop_workers(procs: list, conns: list) -> None:
    """Ask the workers to end (`("close", None)`), then make sure they did (also runs at
    interpreter exit, through `weakref.finalize`)."""
    for conn in conns:
        try:
            conn.send(("close", None))
        except (OSError, ValueError):
            pass
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)


def described_error(e: Exception) -> tuple:
    """(type name, message, traceback): an error as it crosses a pipe (inside `except`)."""
    return type(e).__name__, str(e), traceback.format_exc()


def remote_error(name: str, message: str, context: str, trace: str = "") -> Exception:
    """The parent's error for a child's (type name, message, traceback): the checks' own
    types as themselves, anything else a RuntimeError that says where (`context`) and what."""
    if name in PIPE_ERRORS:
        return PIPE_ERRORS[name](message)
    return RuntimeError(f"{context}: {name}: {message}" + (f"\n{trace}" if trace else ""))
