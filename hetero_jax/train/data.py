"""Training data for the embedding adapter: (query, passage) pairs and their padded batches.

In: a JSONL file of pairs (`{"query": str, "passage": str}` a line), or a corpus
(`{"title": str, "text": str}` a line, as `data/corpus.jsonl`) from which `corpus_pairs` makes
one pair per query template and passage. Out: `Pairs` split by passage into train and
held-out (`split`, deterministic in the seed), and `encode` turns texts into padded token
arrays `[B, S]` with lengths `[B]` (numpy; the engine's tokenizer, so the ids are the ones the
engine embeds). Imports no jax.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np

# question templates over a passage's title; the first is the one data/batch_example.jsonl asks
QUERY_TEMPLATES = ("What is {title} known for?", "Tell me about {title}.", "{title}")


@dataclasses.dataclass(frozen=True)
class Pairs:
    queries: tuple  # str, one per pair
    passages: tuple  # str, one per pair; pairs may share a passage

    def __len__(self) -> int:
        return len(self.queries)

    def select(self, index) -> "Pairs":
        return Pairs(tuple(self.queries[i] for i in index), tuple(self.passages[i] for i in index))


def read_jsonl(path: str) -> list:
    """The JSON objects of a JSONL file; a line that is not one is a ValueError naming it."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: a {type(row).__name__}; expected a JSON object")
            rows.append(row)
    return rows


def _field(path: str, n: int, row: dict, key: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{path}:{n}: {key!r} is {value!r}; expected a non-empty string")
    return value


def read_pairs(path: str) -> Pairs:
    """A pairs file ({query, passage} rows) or a corpus ({title, text} rows)."""
    rows = read_jsonl(path)
    if not rows:
        raise ValueError(f"{path}: no rows")
    if "query" in rows[0]:
        return Pairs(tuple(_field(path, n, r, "query") for n, r in enumerate(rows, 1)),
                     tuple(_field(path, n, r, "passage") for n, r in enumerate(rows, 1)))
    return corpus_pairs([(_field(path, n, r, "title"), _field(path, n, r, "text"))
                         for n, r in enumerate(rows, 1)])


def corpus_pairs(docs: list, templates: tuple = QUERY_TEMPLATES) -> Pairs:
    """(title, text) documents -> one pair per template and document, document-major."""
    queries, passages = [], []
    for title, text in docs:
        for t in templates:
            queries.append(t.format(title=title))
            passages.append(text)
    return Pairs(tuple(queries), tuple(passages))


def split(pairs: Pairs, held_out: float, seed: int) -> tuple[Pairs, Pairs]:
    """(train, held-out): a `held_out` fraction of the distinct passages, with all their
    pairs, goes to held-out, so no held-out passage is seen in training."""
    assert 0 <= held_out < 1, f"{held_out=} must be in [0, 1)"
    distinct = sorted(set(pairs.passages))
    order = np.random.default_rng(seed).permutation(len(distinct))
    out = {distinct[i] for i in order[:round(held_out * len(distinct))]}
    train = [i for i, p in enumerate(pairs.passages) if p not in out]
    test = [i for i, p in enumerate(pairs.passages) if p in out]
    return pairs.select(train), pairs.select(test)


def encode(texts, tokenizer, max_len: int, pad_to: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """texts -> (tokens [B, S] int32, lengths [B] int32): the tokenizer's ids, the first
    `max_len` kept, padded with 0 to S = the longest rounded up to `pad_to` (fewer shapes to
    compile)."""
    ids = [tokenizer.encode(t)[:max_len] for t in texts]
    s = min(-(-max(len(x) for x in ids) // pad_to) * pad_to, max(max_len, 1))
    tokens = np.zeros((len(ids), s), np.int32)
    for row, x in enumerate(ids):
        tokens[row, :len(x)] = x
    return tokens, np.array([len(x) for x in ids], np.int32)
