"""Serving: the engine loop, its input and output processors, the asyncio front, the dedicated
(two-engine) mode, checkpoints and the `make_engine` factory."""
