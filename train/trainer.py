"""The one training loop: SFT (`train.sft`) and GRPO (`train.grpo`) subclass `Trainer` and contribute
their loss and their batch source.

    Trainer(model_cfg, graphdef, base_state, config: TrainerConfig, mesh=None)
      subclass hooks   loss(params, base_state, batch) -> (loss, aux metrics)      [traced, jitted]
                       next_batch(state, position) -> (host batch, global batch size | None, info)
                       prepare(state, device_batch) -> device_batch   (GRPO: old / reference log-probs)
                       evaluate(state) -> dict                          (SFT: eval_loss)
                       inner_steps                                      (optimizer steps per batch)
      the loop         train(checkpoint_dir, metrics_path, callbacks, until, state)

`train` restores the latest checkpoint of `checkpoint_dir` (refusing one of another model, adapter
or process count before reading its state) or initializes; then per batch: the batch source,
`update` (the jitted, sharded step, compiled once per batch shape, `inner_steps` times), eval at
`eval_every` and at the last step, one metrics row (jsonl sink and log line on process 0 only),
a checkpoint every `checkpoint.every` batches and at the last one (every process takes part), and
the callbacks `fn(row, state)`. A SIGTERM (a scheduler's preemption notice) ends the loop at a step
every process agrees on, saved, with `train.preemption.Preempted`. `position` (batches consumed) is
what a checkpoint stores, so a resumed run sees the batches an uninterrupted run would.
"""
from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import time
from typing import Callable, Iterable

import jax
import optax

from preft_jax.adapters.orbax_io import check_identity, checkpoint_identity
from preft_jax.progress import progress
from train import distributed as dist
from train.common import ShardedSetup, TrainState, scalars
from train.config import TrainerConfig

log = logging.getLogger("train")

Callback = Callable[[dict, TrainState], None]


class ResumeError(ValueError):
    """A checkpoint cannot be resumed by this run (other model, adapter or process count)."""


class RunError(ValueError):
    """A run stopped for a reason its message states in full (the CLIs print it alone)."""


class NonFiniteLossError(RunError):
    """A step's loss or gradient norm is NaN or infinite: the run stops before that state is saved.
    `step`: the step; `what`: the first metric that is not finite ("loss" or "grad_norm")."""

    def __init__(self, message: str, step: int, what: str):
        super().__init__(message)
        self.step, self.what = step, what


class MetricsSink:
    """Appends one JSON row per step to a jsonl file (process 0 only). On resume at `position`, rows
    of later steps (written after the checkpoint a crashed run resumes from) are dropped first, and so
    are lines that are not JSON objects (a row torn by the crash), with one warning naming the file."""

    def __init__(self, path: str | os.PathLike | None, position: int = 0):
        self.f = None
        if path is None or not dist.is_primary():
            return
        path = pathlib.Path(path)
        if path.is_file():
            rows = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
            keep, torn = [], 0
            for ln in rows:
                try:
                    row = json.loads(ln)
                except ValueError:
                    row = None
                if not isinstance(row, dict):
                    torn += 1
                elif not isinstance(row.get("step", 0), (int, float)) or row.get("step", 0) <= position:
                    keep.append(ln)
            if torn:
                log.warning("%s: dropped %d line(s) that are not JSON rows (torn by an interrupted run?)", path, torn)
            if len(keep) != len(rows):
                path.write_text("".join(ln + "\n" for ln in keep), encoding="utf-8")
        self.f = open(path, "a", encoding="utf-8")

    def write(self, row: dict):
        if self.f is not None:
            self.f.write(json.dumps(row) + "\n")
            self.f.flush()

    def close(self):
        if self.f is not None:
            self.f.close()
            self.f = None


class Trainer:
    """Jitted, sharded training of one adapter on a frozen base model (graphdef + state of a Llama)."""

    name = "trainer"
    inner_steps = 1

    def __init__(self, model_cfg, graphdef, base_state, config: TrainerConfig, mesh: jax.sharding.Mesh | None = None):
        if not isinstance(config, TrainerConfig):
            raise TypeError(f"config must be a TrainerConfig (SFTConfig, GRPOConfig), got {type(config).__name__}")
        self.config, self.model_cfg, self.graphdef = config, model_cfg, graphdef
        self.adapter_config = config.adapter.build(model_cfg)
        self.tx, self.schedule = config.optimizer.build(config.steps * self.inner_steps)
        mesh = dist.build_mesh(config.mesh) if mesh is None else mesh
        self.setup = ShardedSetup(model_cfg, graphdef, base_state, self.adapter_config, self.tx, mesh)
        self._fns: dict = {}

    @property
    def mesh(self):
        return self.setup.mesh

    @property
    def base_state(self):
        return self.setup.base_state

    def init_state(self, key=None) -> TrainState:
        return self.setup.init_state(jax.random.key(self.config.seed) if key is None else key)

    # ---- subclass hooks ----------------------------------------------------------------------
    def loss(self, params, base_state, batch):
        """(scalar loss, dict of scalar aux metrics); traced inside the jitted step."""
        raise NotImplementedError

    def next_batch(self, state: TrainState, position: int) -> tuple[dict, int | None, dict]:
        """(host arrays, global batch size, info row). Arrays hold the global batch (size None) or only
        this process's `local_rows` of a global batch of the given size."""
        raise NotImplementedError

    def prepare(self, state: TrainState, batch: dict) -> dict:
        """Device batch -> device batch fed to every inner step."""
        return batch

    def evaluate(self, state: TrainState) -> dict:
        return {}

    def on_restore(self, meta: dict) -> None:
        """Called with the meta of the checkpoint a run resumes from."""

    def checkpoint_extra(self) -> dict:
        return {}

    # ---- jitted pieces ------------------------------------------------------------------------
    def _step_fn(self, ts: TrainState, base_state, batch):
        (loss, aux), grads = jax.value_and_grad(self.loss, has_aux=True)(ts.params, base_state, batch)
        updates, opt_state = self.tx.update(grads, ts.opt_state, ts.params)
        params = optax.apply_updates(ts.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": self.schedule(ts.step), **aux}
        return TrainState(params, opt_state, ts.step + 1), metrics

    def compiled(self, name: str, batch: dict, build: Callable[[], Callable]):
        """The function `build()` makes, cached per (name, batch shapes): compiled once per shape."""
        key = (name,) + tuple((k, tuple(v.shape)) for k, v in sorted(batch.items()))
        if key not in self._fns:
            self._fns[key] = build()
        return self._fns[key]

    def local_rows(self, batch_size: int) -> slice:
        return dist.local_rows(self.mesh, batch_size)

    def put_batch(self, batch: dict, global_batch_size: int | None = None) -> dict:
        return self.setup.put_batch(batch, global_batch_size)

    def step_function(self, batch: dict) -> Callable:
        """The jitted, sharded optimizer step `(TrainState, base_state, batch) -> (TrainState, metrics)`
        for batches shaped like `batch` (device arrays or ShapeDtypeStructs), the input state donated;
        built once per batch shape. `step` calls it; benchmarks.memory_plan lowers and compiles it from
        abstract shapes."""
        return self.compiled("step", batch, lambda: self.setup.jit_step(self._step_fn, batch))

    def step(self, ts: TrainState, batch: dict, global_batch_size: int | None = None) -> tuple[TrainState, dict]:
        """One optimizer step on a host batch (the input state is donated)."""
        dev = batch if _on_device(batch) else self.put_batch(batch, global_batch_size)
        return self.step_function(dev)(ts, self.base_state, dev)

    def update(self, ts: TrainState, batch: dict, global_batch_size: int | None = None) -> tuple[TrainState, dict]:
        """`prepare`, then `inner_steps` optimizer steps on one batch."""
        dev = self.prepare(ts, self.put_batch(batch, global_batch_size))
        metrics = None
        for _ in range(self.inner_steps):
            ts, metrics = self.step(ts, dev)
        return ts, metrics

    # ---- checkpoints --------------------------------------------------------------------------
    def checkpoint_meta(self) -> dict:
        return {**checkpoint_identity(self.model_cfg, self.adapter_config), "trainer": self.name,
                "topology": {"num_processes": jax.process_count(), "devices": jax.device_count(),
                             "mesh": list(self.config.mesh.shape)}, **self.checkpoint_extra()}

    def check_resumable(self, meta: dict, where: str = "checkpoint") -> None:
        """Raises ResumeError naming what differs between a checkpoint and this run."""
        try:
            check_identity(meta, self.model_cfg, self.adapter_config, where)
        except ValueError as e:
            raise ResumeError(f"cannot resume: {e}. Use another output folder, or the flags it was trained "
                              f"with.") from None
        if meta.get("trainer", self.name) != self.name:
            raise ResumeError(f"cannot resume: {where} was written by the {meta['trainer']} trainer, this is "
                              f"{self.name}")
        procs = meta.get("topology", {}).get("num_processes")
        if procs is not None and procs != jax.process_count():
            raise ResumeError(f"cannot resume: {where} was written by {procs} process(es), this run has "
                              f"{jax.process_count()}; restart with --num-processes {procs}")

    # ---- the loop -----------------------------------------------------------------------------
    def train(self, checkpoint_dir: str | os.PathLike | None = None, metrics_path: str | os.PathLike | None = None,
              callbacks: Iterable[Callback] = (), until: int | None = None,
              state: TrainState | None = None) -> tuple[TrainState, list[dict]]:
        """Trains to batch `until` (default `config.steps`), resuming from the latest checkpoint in
        checkpoint_dir if there is one; a checkpoint is always written at the last batch trained.

        Returns (final state, the metric rows of this call)."""
        c = self.config
        until = c.steps if until is None else min(until, c.steps)
        ckpt, position = None, 0 if state is None else int(state.step) // self.inner_steps
        if checkpoint_dir is not None:
            from train.checkpoint import Checkpointer
            ckpt = Checkpointer(checkpoint_dir, save_every=c.checkpoint.every or c.steps,
                                max_to_keep=c.checkpoint.max_to_keep)
            try:
                if ckpt.latest_step() is not None:
                    where = f"checkpoint {ckpt.directory / str(ckpt.latest_step())}"
                    state, meta = ckpt.restore(self.setup.abstract_state,
                                               expect=lambda m: self.check_resumable(m, where))
                    position = int(meta["data_position"])
                    if position > c.steps:
                        raise ResumeError(f"cannot resume: {where} is at step {position}, past this run's "
                                          f"--steps {c.steps}; give --steps {position} or more to go on from it, or "
                                          f"another output folder")
                    self.on_restore(meta)
                    if dist.is_primary():
                        log.info("resumed from %s (batch %d)", where, position)
            except BaseException:
                ckpt.close()
                raise
        if state is None:
            state = self.init_state()
        from train.preemption import Preempted, Preemption
        notice = Preemption(install=ckpt is not None)          # a SIGTERM: stop at an agreed step, saved
        sink = MetricsSink(metrics_path, position)
        history, t_start, start = [], time.time(), position
        bar = progress(None, self.name, total=until, initial=position, unit="step",
                       quiet=None if dist.is_primary() else True)
        try:
            while position < until:
                t0 = time.time()
                batch, global_size, info = self.next_batch(state, position)
                t1 = time.time()
                state, m = self.update(state, batch, global_size)
                position += 1
                row = {"step": position, **info, **scalars(m)}
                row.update(batch_s=t1 - t0, update_s=time.time() - t1, time=time.time() - t_start)
                if (c.eval_every and position % c.eval_every == 0) or position == c.steps:
                    row.update(self.evaluate(state))
                history.append(row)
                sink.write(row)
                self._check_finite(row, position, ckpt)
                bar.update(1)
                bar.set_postfix({k: f"{row[k]:.4f}" for k in ("loss", *self.log_keys()) if k in row}, refresh=False)
                self._log(row, position, until, start, t_start)
                preempted = notice.reached(position) and position < until
                if ckpt is not None:
                    ckpt.save(position, state, position, c.to_json(), extra=self.checkpoint_meta(),
                              force=position == until or preempted)
                if preempted:
                    raise Preempted(position, until, None if ckpt is None else ckpt.directory)
                for cb in callbacks:
                    cb(row, state)
        finally:
            notice.close()
            bar.close()
            sink.close()
            if ckpt is not None:
                ckpt.close()
        return state, history

    def _check_finite(self, row: dict, position: int, ckpt) -> None:
        """NonFiniteLossError when the step's loss or gradient norm is not finite: its update made
        the adapter NaN (or will), so it is neither checkpointed nor exported. The metrics row is
        written first (what the step saw)."""
        bad = [k for k in ("loss", "grad_norm") if k in row and not math.isfinite(row[k])]
        if not bad:
            return
        last = None if ckpt is None else ckpt.latest_step()
        raise NonFiniteLossError(
            f"step {position}: {' and '.join(f'{k} {row[k]}' for k in bad)}; the run stopped before saving this "
            f"step (last checkpoint: {'none' if last is None else f'step {last}'}). Lower --lr or --grad-clip, or "
            f"check the data (and the reward function)", position, bad[0])

    def _log(self, row: dict, position: int, until: int, start: int, t_start: float):
        c = self.config
        if not dist.is_primary() or not c.log_every:
            return
        evals = {k: v for k, v in row.items() if k.startswith("eval_")}
        if position % c.log_every and not evals and position != until:
            return
        per = (time.time() - t_start) / max(1, position - start)
        extra = "".join(f" {k} {row[k]:.4f}" for k in self.log_keys() if k in row)
        extra += "".join(f" {k} {v:.4f}" for k, v in evals.items())
        log.info("%s step %d/%d loss %.4f%s (%.2f s/step, eta %.0f s)", self.name, position, c.steps,
                 row["loss"], extra, per, per * (until - position))

    def log_keys(self) -> tuple[str, ...]:
        return ()


def _on_device(batch: dict) -> bool:
    return all(isinstance(v, jax.Array) for v in batch.values())
