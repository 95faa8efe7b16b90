"""`hetero-jax serve`: the OpenAI-compatible server on a preset or a model directory.

    hetero-jax serve [--preset mini | --model DIR] [--host 127.0.0.1] [--port 8000]
                     [--api-key KEY] [--replicas N] [--scheduler ibs] ...

In: argv. Every flag is checked (argparse, exit status 2) before jax is imported, so `--help`
and a bad flag answer at once. Then `build_client` makes the engine (one `Engine` behind an
`AsyncEngine`, or with `--replicas N` or `--engine-process` a `ReplicaSet` behind an
`AsyncReplicas`), warms it up (every step variant compiled before the first request), and
uvicorn serves `app.build_app` on it until Ctrl-C. `ServerThread` runs the same app on a loopback port in a thread, for the
tests and the online benchmark.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import threading
import time

from hetero_jax.models.presets import PRESETS, preset_dir
from hetero_jax.sched import BATCHING, POLICIES
from hetero_jax.sim.options import DefaultsHelpFormatter, add_step_flags, int_range

LIMITS = dict(port=(0, 65535), replicas=(1, 1024), tensor_parallel=(1, 1024),
              token_budget=(1, 8192), chunk_size=(1, 8192), max_num_seqs=(1, 1024),
              max_model_len=(1, 1 << 20), seed=(0, 2**32 - 1), max_queued=(0, 1 << 20),
              max_body_bytes=(1, 1 << 30))
# uvicorn's settings (loop and parser are its defaults with the `serve` extra: uvloop and
# httptools). An idle keep-alive connection is kept 30 s, longer than clients keep theirs
# (httpx and the openai package: 5 s, uvicorn's own default too): with equal timeouts a client
# may reuse a connection the server is closing that instant, and that request fails with a
# reset (httpx.ReadError). No access log: a line per request costs the event loop.
UVICORN = dict(timeout_keep_alive=30, access_log=False, backlog=2048, log_level="warning")


def _model_dir(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetero-jax serve", formatter_class=DefaultsHelpFormatter,
                                description="An OpenAI-compatible "
                                "server: /v1/completions, /v1/chat/completions, /v1/embeddings, "
                                "/v1/models, /health, /metrics.")
    ints = {name: int_range(*limits) for name, limits in LIMITS.items()}
    p.add_argument("--preset", default="mini", choices=list(PRESETS),
                   help="embedded model, no download (mini: trained; the others: random)")
    p.add_argument("--model", type=_model_dir, default=None, metavar="DIR",
                   help="local Hugging Face directory (overrides --preset)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the `model` clients pass (default: the preset name or directory)")
    p.add_argument("--embed-model", type=_model_dir, default=None, metavar="DIR",
                   help="a separate BERT-family encoder directory that serves every embedding")
    p.add_argument("--embed-adapter", type=_model_dir, default=None, metavar="DIR",
                   help="a PEFT LoRA directory for embeddings on the shared backbone "
                   "(request field `adapter`: 'default')")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=ints["port"], default=8000, help="port (0: any free one)")
    p.add_argument("--api-key", default=os.environ.get("HETERO_JAX_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: the "
                   "HETERO_JAX_API_KEY environment variable; unset: no key)")
    p.add_argument("--max-queued", type=ints["max_queued"], default=1024, metavar="N",
                   help="waiting requests beyond which new ones get 503 with Retry-After")
    p.add_argument("--max-body-bytes", type=ints["max_body_bytes"], default=4 << 20,
                   metavar="N", help="larger request bodies get 413")
    p.add_argument("--replicas", type=ints["replicas"], default=1,
                   help="engines in their own processes, one CPU core each, behind a router")
    p.add_argument("--engine-process", action="store_true",
                   help="step the engine in a process of its own (a replica set of one), "
                   "not in a thread of the server's")
    p.add_argument("--tensor-parallel", type=ints["tensor_parallel"], default=1, metavar="N",
                   help="split the decoder over N devices (per replica)")
    p.add_argument("--scheduler", default="ibs", choices=list(POLICIES),
                   help="which request type a step admits first")
    p.add_argument("--batching", default="fcfs", choices=list(BATCHING),
                   help="which generation requests join a step (feather: prefix-homogeneous)")
    add_step_flags(p, ints)
    p.add_argument("--max-model-len", type=ints["max_model_len"], default=None,
                   help="longest prompt + generation (default: the model's, capped at 2048)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="compute every prompt whole")
    p.add_argument("--seed", type=ints["seed"], default=0, help="preset weights, sampling")
    p.add_argument("--no-warmup", action="store_true",
                   help="compile step variants on first use instead of at start")
    return p


def engine_config(args):
    from hetero_jax.config import EngineConfig

    return EngineConfig(token_budget=args.token_budget, chunk_size=args.chunk_size,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        dtype=args.dtype, scheduler=args.scheduler, batching=args.batching,
                        tensor_parallel=args.tensor_parallel, seed=args.seed,
                        prefix_caching=not args.no_prefix_caching)


def build_client(args):
    """The engine the flags ask for, warmed up, behind its EngineClient."""
    from hetero_jax.serving.async_engine import AsyncEngine
    from hetero_jax.serving.async_replicas import AsyncReplicas
    from hetero_jax.serving.engine import Engine
    from hetero_jax.serving.processes import ModelSource
    from hetero_jax.serving.replicas import ReplicaSet

    cfg = engine_config(args)
    if args.replicas > 1 or args.engine_process:
        replicas = (ReplicaSet.from_pretrained(args.model, args.replicas, cfg, args.embed_model,
                                               args.embed_adapter) if args.model else
                    ReplicaSet(ModelSource(preset=args.preset, seed=args.seed,
                                           embed_model=args.embed_model), args.replicas, cfg))
        client = AsyncReplicas(replicas)
        engine = replicas
    else:
        engine = (Engine.from_pretrained(args.model, cfg, args.embed_model, args.embed_adapter)
                  if args.model else Engine.from_preset(args.preset, args.seed, cfg,
                                                        args.embed_model))
        client = AsyncEngine(engine)
    if not args.no_warmup:
        engine.warmup()
    return client


def server_config(args):
    from hetero_jax.server.app import ServerConfig
    from hetero_jax.server.chat import read_template

    return ServerConfig(model=args.served_model_name or args.model or args.preset,
                        api_key=args.api_key, max_queued=args.max_queued,
                        max_body_bytes=args.max_body_bytes,
                        chat_template=read_template(args.model or preset_dir(args.preset)))


def serve_main(argv) -> int:
    args = build_parser().parse_args(argv)
    import uvicorn

    from hetero_jax.server.app import build_app

    if args.embed_adapter and args.model is None:
        build_parser().error("--embed-adapter needs --model (a preset has no adapters)")
    client = build_client(args)
    uvicorn.run(build_app(client, server_config(args)), host=args.host, port=args.port,
                timeout_graceful_shutdown=5, **UVICORN)
    return 0


@dataclasses.dataclass
class ServerThread:
    """An app served by uvicorn on 127.0.0.1 in a daemon thread (`port` is the bound one)."""

    app: object
    port: int = 0

    def __enter__(self) -> "ServerThread":
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, timeout_graceful_shutdown=2, **UVICORN)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[sock]),
                                       name="hetero-jax-server", daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread ended while starting")
            time.sleep(0.01)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
