"""A replica's process (`worker`) and the parent's thread that reads it (`reader`).

The protocol is `serving.replicas`': the worker builds a whole `Engine` pinned to one core,
then loops: it reads every command waiting on its pipe (blocking only when the engine is
idle), runs one `Engine.step`, and, when some requests finished, sends `("done", ([(tag,
output, None)], stats))` for them. Commands: `("add", [(tag, request)])` prepares and
queues each request (one its checks refuse comes back at once as `(tag, None, (error type,
message))`), `("abort", [tag])`, `("warmup", None) -> ("warmed", compiles)`, `("close",
None)`. A step that raises with no request to blame (the engine already failed any culprit
alone) fails every request of this replica with a RuntimeError naming it, and the worker
keeps serving. The
parent's `reader` thread moves each message onto one queue shared by all replicas, and
`("dead", exit code)` once the pipe closes. Imports no jax (the engine does, in the worker).
"""
from __future__ import annotations

import os
import queue

from hetero_jax.config import EngineConfig
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
    tags: dict = {}  # engine request id -> the parent's tag, for the requests in flight
    while True:
        while conn.poll(0) or not engine.has_work():
            cmd, arg = conn.recv()
            if cmd == "close":
                return
            reply = _handle(engine, tags, cmd, arg)
            if reply is not None:
                conn.send(reply)
        try:
            finished = engine.step().finished
        except Exception as e:  # noqa: BLE001 - no request to blame: fail this replica's own
            why = ("RuntimeError", f"replica {index} failed a step: {type(e).__name__}: {e}")
            results = [(tag, None, why) for tag in tags.values()]
            for request_id in tags:
                engine.abort(request_id)
            tags.clear()
        else:
            results = [(tags.pop(r.request_id), engine.output(r), None) for r in finished
                       if r.request_id in tags]
        if results:
            conn.send(("done", (results, engine.stats)))


def admit(engine, items) -> tuple:
    """[(tag, request)] -> ({request id: tag} of those enqueued, [(tag, error)] of those the
    engine's checks refused (a ValueError or TypeError, raised by `prepare`))."""
    tags, refused, fresh = {}, [], []
    for tag, request in items:
        try:
            (req,) = engine.prepare([request])
        except (ValueError, TypeError) as e:
            refused.append((tag, e))
            continue
        tags[req.request_id] = tag
        fresh.append(req)
    engine.enqueue(fresh)
    return tags, refused


def _handle(engine, tags: dict, cmd: str, arg):
    """One command between steps -> the reply to send, or None."""
    if cmd == "add":
        added, refused = admit(engine, arg)
        tags.update(added)
        refused = [(tag, None, (type(e).__name__, str(e))) for tag, e in refused]
        return ("done", (refused, engine.stats)) if refused else None
    if cmd == "abort":
        drop = set(arg)
        for request_id in [rid for rid, tag in tags.items() if tag in drop]:
            engine.abort(request_id)
            del tags[request_id]
        return None
    if cmd == "warmup":
        return "warmed", engine.warmup()
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
