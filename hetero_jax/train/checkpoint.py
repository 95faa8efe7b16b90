"""Checkpoints of a training run (orbax) and the PEFT adapter it ends with.

`Checkpoints(dir, every)` wraps an `ocp.CheckpointManager`: `save(step, state)` keeps the last
two train states (a `TrainState` pytree: step, LoRA weights, optax state) every `every` steps
and at the end; `restore(template)` returns the latest one, or None when the directory holds
none, so a killed run started again with the same command resumes where its last checkpoint
left it. Batches are a function of (seed, step) (`fit.batch_indices`), so the resumed run
takes the same steps an uninterrupted one would. `export_adapter` writes the PEFT directory
that `Engine.from_pretrained(dir, embed_adapter=...)` loads, plus `training.json` (the pooler
the adapter was trained for and the recall it reached).
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from hetero_jax.models.formats.peft import save_adapter


class Checkpoints:
    def __init__(self, directory: str, every: int):
        assert every >= 1, f"{every=} must be >= 1"
        options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=every)
        self._manager = ocp.CheckpointManager(os.path.abspath(directory), options=options)

    def save(self, step: int, state, force: bool = False) -> None:
        self._manager.save(step, args=ocp.args.StandardSave(state), force=force)

    def restore(self, template):
        """The latest saved state shaped like `template`, or None when there is none."""
        step = self._manager.latest_step()
        if step is None:
            return None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def export_adapter(adapter_dir: str, lora: dict, num_layers: int, info: dict,
                   base_model: str = "") -> None:
    """The PEFT directory of `lora` ({w: (a [L, in, r], b [L, r, out])}, scale 1) and its
    `training.json` (`info`)."""
    weights = {w: (np.asarray(a), np.asarray(b)) for w, (a, b) in lora.items()}
    rank = next(iter(weights.values()))[0].shape[-1]
    save_adapter(adapter_dir, weights, rank, num_layers, base_model)
    with open(os.path.join(adapter_dir, "training.json"), "w") as f:
        json.dump(info, f, indent=1)
