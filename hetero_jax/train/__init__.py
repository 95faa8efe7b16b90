"""Training on the engine's own model: the LoRA embedding adapter (`hetero-jax train-adapter`)
and a preset's language model (`lm`, `scripts/build_default_model.py`), both with optax.

`data` (pairs, padded batches; no jax) -> `forward` (the engine's Flax model on padded
sequences, the poolers) -> `loss` (contrastive, recall@k) -> `step` (one jitted train step
over a `TrainState`) -> `fit` (the loop, resumable through `checkpoint`'s orbax manager) ->
`checkpoint.export_adapter` (a PEFT directory the engine loads). `cli` is the command;
importing this package imports no jax.
"""
