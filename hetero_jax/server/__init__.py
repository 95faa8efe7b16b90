"""`hetero-jax serve`: an OpenAI-compatible HTTP server over any `serving.client.EngineClient`.

`protocol` holds the request bodies, `errors` the one mapping from typed errors to statuses
and OpenAI error bodies, `chat` the sandboxed chat template, `openai_format` the response
bodies, `generation` the per-choice streams (stop strings travel to the engine), `render`
the chunks of a stream (or its whole body), `sse` the event stream as ASGI messages and the
disconnect watch, `metrics` the Prometheus text, `app` the FastAPI routes and `cli` the
command line (its `--help` imports no jax).
"""
