"""Serving: the engine loop, its input and output processors, the one asyncio front over a
core per kind of engine, engines in other processes (dedicated mode, replicas, Ray) as
siblings over `processes`, the one synchronous drive, checkpoints and the `make_engine`
factory (docs/DESIGN.md has the module map)."""
