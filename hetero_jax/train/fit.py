"""The adapter's training loop and its evaluation.

In: the frozen base params and model config, the tokenizer, train pairs (`data.Pairs`), an
`AdapterConfig` and `FitOptions`. `fit_adapter` tokenizes every pair once (queries and
passages each padded to one length, so the step compiles once), restores the latest
checkpoint when `checkpoint_dir` holds one, and runs `step.train_step` on the batch
`batch_indices(seed, step)` until `ac.steps`, saving every `checkpoint_every` steps and at the
end; `on_step(step, loss)` reports each step (the command's progress bar). Out: the final
`TrainState`. `recall` is recall@k of held-out queries against a pool of passages, through
the adapter or on the base weights.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from hetero_jax.models.config import ModelConfig
from hetero_jax.train.checkpoint import Checkpoints
from hetero_jax.train.data import Pairs, encode
from hetero_jax.offline.recall import recall_at_k
from hetero_jax.train.step import AdapterConfig, TrainState, embed_texts, init_state, train_step


@dataclasses.dataclass(frozen=True)
class FitOptions:
    batch_size: int = 32
    max_len: int = 128  # tokens kept of each query and passage
    seed: int = 0  # the adapter's initial weights and the order of the batches
    checkpoint_dir: str | None = None
    checkpoint_every: int = 50
    stop_after: int | None = None  # end this run after so many steps (a kill, for tests)


def batch_indices(num_pairs: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """The pairs of step `step`: a function of (seed, step) alone, so a resumed run takes the
    batches an uninterrupted one would."""
    rng = np.random.default_rng([seed, step])
    return rng.choice(num_pairs, min(batch_size, num_pairs), replace=False)


def encode_pairs(pairs: Pairs, tokenizer, max_len: int) -> dict:
    """-> {q [N, Sq], q_len [N], p [N, Sp], p_len [N], pid [N]}, Sq / Sp = the longest query /
    passage rounded up to 16, at most max_len (one shape each: one compile; short queries are
    not padded to the passages' length); pid: the passage's index among the distinct ones
    (pairs with the same pid are not each other's negatives)."""
    q, q_len = encode(pairs.queries, tokenizer, max_len)
    p, p_len = encode(pairs.passages, tokenizer, max_len)
    ids = {text: i for i, text in enumerate(dict.fromkeys(pairs.passages))}
    return dict(q=q, q_len=q_len, p=p, p_len=p_len,
                pid=np.array([ids[t] for t in pairs.passages], np.int32))


def fit_adapter(params, cfg: ModelConfig, tokenizer, train: Pairs, ac: AdapterConfig,
                opts: FitOptions, on_step: Callable[[int, float], None] | None = None
                ) -> TrainState:
    assert len(train) >= 2, f"{len(train)} train pairs: in-batch negatives need at least 2"
    data = encode_pairs(train, tokenizer, opts.max_len)
    state = init_state(cfg, ac, opts.seed)
    ckpt = Checkpoints(opts.checkpoint_dir, opts.checkpoint_every) if opts.checkpoint_dir \
        else None
    try:
        restored = ckpt.restore(state) if ckpt else None
        state = state if restored is None else restored
        first = int(state.step)
        last = ac.steps if opts.stop_after is None else min(ac.steps, first + opts.stop_after)
        for k in range(first, last):
            idx = batch_indices(len(train), opts.batch_size, opts.seed, k)
            state, loss = train_step(state, params, {n: x[idx] for n, x in data.items()},
                                     cfg=cfg, ac=ac)
            if ckpt:
                ckpt.save(k + 1, state, force=k + 1 == last)
            if on_step:
                on_step(k + 1, float(loss))
    finally:
        if ckpt:
            ckpt.close()
    return state


def recall(params, cfg: ModelConfig, tokenizer, queries: Pairs, pool: list, pooling: str,
           lora: dict | None, k: int, max_len: int) -> float:
    """recall@k of `queries` (their passages must be in `pool`) against the passages `pool`,
    through `lora` (`step.init_lora`'s untrained one is exactly the base model) or, None, on
    the base params."""
    where = {text: i for i, text in enumerate(pool)}
    relevant = np.array([where[p] for p in queries.passages])
    emb = lambda texts: embed_texts(  # noqa: E731
        params, cfg, *encode(texts, tokenizer, max_len, pad_to=max_len), pooling, lora)
    return recall_at_k(emb(list(queries.queries)), emb(list(pool)), relevant, k)
