"""Random ragged batches on shuffled KV pages, shared by the attention tests."""
import numpy as np


def random_batch(rng, q_lens, ctx_extra, hq, hkv, d, page_size, pad_tokens=3, pad_seqs=2):
    """Sequences with q_lens new tokens after ctx_extra cached ones, on shuffled pages."""
    kv_lens = [q + c for q, c in zip(q_lens, ctx_extra)]
    pps = max(-(-n // page_size) for n in kv_lens)
    num_pages = 1 + sum(-(-n // page_size) for n in kv_lens)
    perm = rng.permutation(np.arange(1, num_pages))
    page_indices = np.zeros((len(q_lens) + pad_seqs, pps), np.int32)
    used = 0
    for s, n in enumerate(kv_lens):
        k = -(-n // page_size)
        page_indices[s, :k] = perm[used:used + k]
        used += k
    t = sum(q_lens) + pad_tokens
    cu = np.concatenate([[0], np.cumsum(q_lens), np.full(pad_seqs, sum(q_lens))]).astype(np.int32)
    return dict(
        q=rng.standard_normal((t, hq, d)).astype(np.float32),
        k_pages=rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32),
        v_pages=rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32),
        kv_lens=np.array(kv_lens + [0] * pad_seqs, np.int32), page_indices=page_indices,
        cu_q_lens=cu, num_seqs=np.int32(len(q_lens)))


def shared_prefix_batch(rng, groups, hq, hkv, d, page_size, chunks=(), pad_seqs=2):
    """Chunk sequences `chunks` [(q_len, cached)] first, then decode sequences in `groups`
    [(shared pages, [kv_len of each member])] whose page tables start with the same pages (as
    prefix-cache hits leave them), all on shuffled pages. Returns (batch, decode page tables,
    decode kv_lens)."""
    tables, kv_lens, q_lens, used = [], [], [], 1

    def take(n):
        nonlocal used
        used += n
        return list(range(used - n, used))

    for q, cached in chunks:
        tables.append(take(-(-(q + cached) // page_size)))
        kv_lens.append(q + cached)
        q_lens.append(q)
    for shared, lens in groups:
        prefix = take(shared)
        for n in lens:
            assert n > shared * page_size, f"{n=} must pass the {shared} shared pages"
            tables.append(prefix + take(-(-n // page_size) - shared))
            kv_lens.append(n)
            q_lens.append(1)
    perm = np.concatenate([[0], rng.permutation(np.arange(1, used))])
    tables = [[int(perm[p]) for p in t] for t in tables]
    page_indices = np.zeros((len(tables) + pad_seqs, max(map(len, tables))), np.int32)
    for s, t in enumerate(tables):
        page_indices[s, :len(t)] = t
    cu = np.concatenate([[0], np.cumsum(q_lens), np.full(pad_seqs, sum(q_lens))]).astype(np.int32)
    batch = dict(
        q=rng.standard_normal((sum(q_lens) + 3, hq, d)).astype(np.float32),
        k_pages=rng.standard_normal((used, page_size, hkv, d)).astype(np.float32),
        v_pages=rng.standard_normal((used, page_size, hkv, d)).astype(np.float32),
        kv_lens=np.array(kv_lens + [0] * pad_seqs, np.int32), page_indices=page_indices,
        cu_q_lens=cu, num_seqs=np.int32(len(tables)))
    return batch, tables[len(chunks):], kv_lens[len(chunks):]
