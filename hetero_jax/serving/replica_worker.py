"""A replica's process (`worker`) and the parent's thread that reads it (`reader`).

The protocol is `serving.replicas`': the worker builds a whole `Engine` pinned to one core and
runs the one `drive.Drive` loop (`serve`) on it: it reads every command waiting on its pipe
(blocking only when the engine is idle), runs one step, and, when some requests finished,
sends `("done", ([(tag, RequestResult)], stats, (its StepTimes, running by kind)))` for them.
Commands: `("add", [(tag, request)])` prepares and queues each request (one its checks
refuse comes back at once, its `RequestError` naming it as index 0); `("stream", [(tag,
request)])` does the same and, after each step that gave one of those generations tokens and
did not end it, sends `("deltas", [(tag, GenerateDelta)])` before that step's `"done"`
(`Drive.step_with_deltas`; an "add"ed request sends nothing until it ends, so the batch path
costs what it did); `("abort", [tag])`, `("warmup", None) -> ("warmed", compiles)`,
`("close", None)`. A step that raises with no request to blame (the engine already failed any
culprit alone) sends `("failed", (tags, reason))` for every request of this replica,
aborted, and the worker keeps serving.
The parent's `reader` thread moves each message onto one queue shared by all replicas, and
`("dead", exit code)` once the pipe closes. Imports no jax (the engine does, in the worker).
"""
from __future__ import annotations

import os
import queue

from hetero_jax.config import EngineConfig
from hetero_jax.serving.client import StepTimes
from hetero_jax.serving.drive import Drive
from hetero_jax.serving.processes import ModelSource, described_error


def engine_info(engine) -> dict:
    """What the parent needs to route, tokenize and count like the engine."""
    inputs = engine.inputs
    return dict(config=engine.config, model_cfg=engine.model_cfg,
                embedding_dim=engine.embedding_dim, encoder=engine.encoder is not None,
                cache_identity=inputs.cache_identity, adapter_ids=dict(inputs.adapter_ids),
                adapter_digests=dict(inputs.adapter_digests))


def worker(index: int, core: int, source: ModelSource, config: EngineConfig, conn) -> None:
    """Replica process: pin to `core`, build a whole engine, serve the pipe (module doc)."""
    from hetero_jax.serving.engine import Engine  # imports jax: only inside the worker

    os.sched_setaffinity(0, {core})  # XLA_FLAGS came from the parent (`child_env`)
    try:
        engine = Engine.from_source(source, config)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", described_error(e)))
        return
    conn.send(("ready", engine_info(engine)))
    drive, steps = Drive(engine), StepTimes()

    def take(wait: bool):
        return conn.recv() if wait or conn.poll(0) else None

    def handle(command) -> bool:
        cmd, arg = command
        if cmd == "close":
            return False
        reply = _handle(drive, cmd, arg)
        if reply is not None:
            conn.send(reply)
        return True

    def report(deltas, results, failure) -> None:
        if failure is None:
            steps.observe(drive.step_s)
        else:
            tags, e = failure
            conn.send(("failed", (tags, f"replica {index} failed a step: "
                                        f"{type(e).__name__}: {e}")))
        if deltas:
            conn.send(("deltas", deltas))
        if results:
            conn.send(("done", (results, engine.stats, (steps, engine.queue_counts()[1]))))

    drive.serve(take, handle, report)


def _handle(drive: Drive, cmd: str, arg):
    """One command between steps -> the reply to send, or None."""
    if cmd in ("add", "stream"):
        refused = drive.admit(arg, stream=cmd == "stream")
        return ("done", (refused, drive.engine.stats, None)) if refused else None
    if cmd == "abort":
        drive.abort(arg)
        return None
    if cmd == "warmup":
        return "warmed", drive.engine.warmup()
    raise ValueError(f"unknown command {cmd!r}")


def reader(index: int, conn, proc, events: queue.Queue) -> None:
    """Reader thread: a replica's messages onto the shared queue, then ("dead", exit code)."""
    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            proc.join(timeout=5)
            events.put((index, "dead", proc.exitcode))
            return
        events.put((index, kind, payload))
