"""Offline batch jobs: `hetero-jax batch INPUT --output OUTPUT`.

A file of rows (JSONL, or Parquet with pyarrow) -> embeddings and generations on one engine
-> a JSONL file of results, written as rows finish, resumable after any kill. `rows` turns
input rows into requests and outputs into output rows, `journal` owns the output and errors
files (append, fsync, resume), `job` is the loop over a `Front` (`EngineFront`: one `Engine`
step by step), `cli` the command. Everything but `cli.make_front` imports no jax.
"""
