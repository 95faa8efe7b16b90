"""Retrieval recall of a finished batch job, for its summary (no jax).

In: OUTPUT (JSONL rows written by the job). An embedding row whose id is `query/<key>` is a
retrieval query whose relevant passage is the embedding row `passage/<key>` (the convention
of data/batch_example.jsonl); every `passage/...` row is the pool it is ranked in by cosine.
Out: `Recall` (recall@k, the queries counted), or None when OUTPUT holds no such query.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np

QUERY, PASSAGE = "query/", "passage/"


@dataclasses.dataclass(frozen=True)
class Recall:
    k: int
    value: float
    queries: int
    passages: int


def _unit(rows: dict) -> tuple[list, np.ndarray]:
    ids = list(rows)
    vecs = np.array([rows[i] for i in ids], np.float64)  # [N, d]
    return ids, vecs / np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)


def recall_at_k(queries: np.ndarray, pool: np.ndarray, relevant: np.ndarray, k: int) -> float:
    """queries [Q, d], pool [N, d] (both L2-normalised), relevant [Q] (index into pool) ->
    the share of queries whose relevant row is among their k highest cosines."""
    assert len(queries) == len(relevant), f"{len(queries)=} != {len(relevant)=}"
    if not len(queries):
        return float("nan")
    scores = queries @ pool.T  # [Q, N]
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return float(np.mean([r in row for r, row in zip(relevant, top)]))


def retrieval_recall(output_path: str, k: int = 5) -> Recall | None:
    queries, passages = {}, {}
    with open(output_path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            rid, emb = row.get("id"), row.get("embedding")
            if isinstance(rid, str) and emb is not None:
                if rid.startswith(QUERY):
                    queries[rid[len(QUERY):]] = emb
                elif rid.startswith(PASSAGE):
                    passages[rid[len(PASSAGE):]] = emb
    queries = {key: v for key, v in queries.items() if key in passages}
    if not queries:
        return None
    pool_ids, pool = _unit(passages)
    query_ids, q = _unit(queries)
    where = {key: i for i, key in enumerate(pool_ids)}
    relevant = np.array([where[key] for key in query_ids])
    return Recall(k, recall_at_k(q, pool, relevant, k), len(query_ids), len(pool_ids))
