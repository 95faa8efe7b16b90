"""The chunked hash chain: one digest per full KV page, each covering every token before it.

`h_i = blake2b-128(h_{i-1} || token ids of page i as little-endian int32 bytes)`, with `h_{-1}`
the chain's seed: a digest of what makes two caches' K/V differ (the model and dtype, the
page size, a LoRA adapter's name and weight digest, a request's `cache_salt`). Two requests
share `h_i` exactly when they share their first `i + 1` pages of tokens under the same seed,
so a prefix is found by dictionary lookups, without a radix tree. The KV page pool, the
pooler's page sidecars, the router's prefix affinity and (Feather) the batching index all key
on these digests. Plain Python and numpy; no pickle: raw bytes only.
"""
from __future__ import annotations

import hashlib

import numpy as np

DIGEST_SIZE = 16  # bytes: 128 bits


def chain_seed(*parts) -> bytes:
    """The chain's `h_{-1}` from identity parts (str, bytes, int or None), each length-prefixed
    so that ("ab", "c") and ("a", "bc") differ."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"hetero-jax-kv")
    for part in parts:
        if part is None:
            raw = b"\x00none"
        elif isinstance(part, bytes):
            raw = b"b" + part
        elif isinstance(part, str):
            raw = b"s" + part.encode()
        elif isinstance(part, int):
            raw = b"i" + str(part).encode()
        else:
            raise TypeError(f"chain_seed part {part!r} must be str, bytes, int or None")
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.digest()


def extend_hashes(hashes: list, token_ids, page_size: int, seed: bytes) -> list:
    """Append the digests of the full pages of `token_ids` not yet in `hashes` (a prefix of
    the chain over these tokens, possibly empty); returns `hashes` (appended in place).

    Incremental: a request calls this as its tokens grow, hashing only new full pages.
    """
    start = len(hashes)
    full = len(token_ids) // page_size
    if full <= start:
        return hashes
    raw = np.asarray(token_ids[start * page_size:full * page_size], dtype="<i4").tobytes()
    stride = 4 * page_size
    prev = hashes[-1] if hashes else seed
    for i in range(full - start):
        h = hashlib.blake2b(prev, digest_size=DIGEST_SIZE)
        h.update(raw[i * stride:(i + 1) * stride])
        prev = h.digest()
        hashes.append(prev)
    return hashes


def page_hashes(token_ids, page_size: int, seed: bytes) -> list:
    """The digests of every full page of `token_ids`: `[h_0, ..., h_{n // page_size - 1}]`."""
    return extend_hashes([], token_ids, page_size, seed)
