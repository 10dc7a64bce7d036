"""Orbax checkpoints of training runs, and export of the trained adapter to its serving format.

A checkpoint (one `ocp.CheckpointManager` step folder) holds two items:

* ``state``: the `TrainState` pytree - adapter params, optimizer state, step counter;
* ``meta``: JSON - the step, the data-iterator position (batches consumed), the trainer's config,
  the identity (`preft_jax.adapters.orbax_io.checkpoint_identity`: adapter config + model
  dimensions, which lets `preft_jax.adapters.reft_io.load_adapter` serve a checkpoint directly),
  the topology (process count, mesh) and any extra fields (e.g. GRPO reward history).

Restoring into the trainer's abstract state (shapes, dtypes and NamedShardings) resumes exactly:
the data iterator continues at the saved position and the jitted step is the same function.
`restore(..., expect=...)` reads the meta first and refuses (naming the mismatch) a checkpoint of
another model, adapter or process count before anything is restored.

In a multi-process run every process calls `save` / `restore` (Orbax coordinates them: each
process writes its shards, process 0 the metadata and the JSON meta).

`export_adapter` writes the trained adapter in the folder format serving loads: an HF PEFT LoRA
folder (`save_peft_lora`) or the ReFT folder (`save_reft`), the PositionPolicy included.
"""
from __future__ import annotations

import logging
import os
import pathlib
from typing import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from preft_jax.adapters.config import LoraConfig, LoraWeights, ReftConfig, ReftWeights
from preft_jax.adapters.orbax_io import META_ITEM, STATE_ITEM
from preft_jax.adapters.peft_io import save_peft_lora
from preft_jax.adapters.reft_io import save_reft
from preft_jax.adapters.trainable import adapter_weights
from preft_jax.config import ModelConfig


class CheckpointReadError(ValueError):
    """A checkpoint step folder that cannot be read (a damaged or half-written save); the message
    names the folder and what to do."""


# Orbax's own sentences for a restore target whose tree differs from the saved one (a damaged file's
# error is TensorStore's, e.g. "DATA_LOSS: ... Error decoding b-tree node")
_MISMATCH = ("tree structures do not match", "Types do not match:", "Sequence lengths do not match:")


class _OrphanedReads(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" records for Orbax's read tasks: after one
    read of a damaged checkpoint fails, its sibling reads fail too and are garbage-collected later,
    each logging TensorStore's whole spec (~100 lines) after the one error line already given."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("never retrieved" in text and "orbax" in text)


_ORPHANED_READS = _OrphanedReads()


def _read_error(directory: pathlib.Path, step: int, e: BaseException) -> CheckpointReadError:
    """One line for an Orbax restore that failed: a tree that does not match this run's state (a
    ValueError naming what differs: the checkpoint was written with other flags) or, for anything
    else, a damaged step folder."""
    logging.getLogger("asyncio").addFilter(_ORPHANED_READS)      # once: a logger keeps one of each filter
    folder = directory / str(step)
    if isinstance(e, ValueError) and any(p in str(e) for p in _MISMATCH):
        text = " / ".join(ln.strip() for ln in str(e).strip().splitlines() if ln.strip())[:400]   # the tree diff
        return CheckpointReadError(
            f"cannot restore checkpoint {folder} into this run's state ({type(e).__name__}: {text}); it was written "
            f"with other flags (the optimizer's --grad-clip / --weight-decay, the adapter's targets or layers): resume "
            f"with the flags it was trained with, or use another output folder")
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = text.split(" See full TensorStore details")[0][:240]          # not the store's whole spec
    return CheckpointReadError(
        f"cannot read checkpoint {folder} ({type(e).__name__}: {text}); it may be damaged (an interrupted save, "
        f"a truncated or edited file): move it away to resume from the step before it, or use another output folder")


class Checkpointer:
    """Saves every `save_every` steps (and when forced), keeps the newest `max_to_keep`."""

    def __init__(self, directory: str | os.PathLike, save_every: int = 1, max_to_keep: int | None = 3):
        self.directory = pathlib.Path(directory).absolute()
        self.save_every = max(1, int(save_every))
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=(STATE_ITEM, META_ITEM))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state, data_position: int, config: dict, extra: dict | None = None,
             force: bool = False) -> bool:
        """Saves when step is a multiple of save_every (or force). Returns whether it saved."""
        if not force and step % self.save_every != 0:
            return False
        if step in self.manager.all_steps():
            return False
        meta = {"step": int(step), "data_position": int(data_position), "config": config, **(extra or {})}
        saved = self.manager.save(step, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardSave(state),
                                                                  META_ITEM: ocp.args.JsonSave(meta)}), force=True)
        self.manager.wait_until_finished()
        return bool(saved)

    def read_meta(self, step: int | None = None) -> dict:
        """The JSON meta of `step` (default: the latest) without restoring the state."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))
            return dict(out[META_ITEM])
        except Exception as e:      # noqa: BLE001 - Orbax and TensorStore raise many types; all mean unreadable
            raise _read_error(self.directory, step, e) from e

    def restore(self, abstract_state, step: int | None = None, expect: Callable[[dict], None] | None = None):
        """(state, meta) of `step` (default: the latest), restored into `abstract_state`'s structure,
        shapes, dtypes and shardings (a pytree of jax.ShapeDtypeStruct, or of arrays).

        `expect(meta)` runs on the meta before the state is read; it raises to refuse the checkpoint."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if expect is not None:
            expect(self.read_meta(step))

        def abstract(x):
            if isinstance(x, jax.ShapeDtypeStruct):
                return x
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

        target = jax.tree.map(abstract, abstract_state)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(target),
                                                                       META_ITEM: ocp.args.JsonRestore()}))
        except Exception as e:      # noqa: BLE001
            raise _read_error(self.directory, step, e) from e
        return out[STATE_ITEM], dict(out[META_ITEM])

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def export_adapter(folder: str | os.PathLike, model_cfg: ModelConfig, adapter_config: LoraConfig | ReftConfig,
                   params: dict, base_model_name_or_path: str = "") -> LoraWeights | ReftWeights:
    """Writes trained adapter params as a PEFT LoRA folder or a ReFT folder; returns the canonical weights."""
    weights = adapter_weights(model_cfg, adapter_config, jax.tree.map(lambda x: np.asarray(jax.device_get(x)),
                                                                        params))   # host arrays (gather_to_host first
                                                                                   # in a multi-process run)
    if isinstance(weights, LoraWeights):
        save_peft_lora(folder, weights, model_cfg, base_model_name_or_path)
    else:
        save_reft(folder, weights)
    return weights
