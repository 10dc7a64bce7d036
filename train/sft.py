"""Supervised fine-tuning of one adapter, prefill-only (PreFT) or all-token.

The loss is the token-mean cross-entropy of the response tokens (prompt and padding masked out),
with teacher-forced log-likelihoods from `preft_jax.generation.sequence_hidden`: the adapter
bank is rebuilt from the trainable params every step and masked per token by its PositionPolicy.
In prefill mode the prompt tokens (the last one included) run adapted and the response tokens run
on base weights attending to the adapted prompt keys/values - exactly the serving computation.
Only adapter params are trained; the base model state is a constant (sharded) argument.

    python -m train.sft --adapter lora --rank 8 --mode prefill --steps 50 --out runs/sft
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from preft_jax.config import ModelConfig
from train.common import (ALL_TARGETS, ShardedSetup, TrainState, adapted_logprobs, make_adapter_config,
                          make_optimizer, mask_layer_grads, scalars)
from train.data import Batch, BatchIterator, Tokenized, eval_batches

log = logging.getLogger("train.sft")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    adapter: str = "lora"                 # "lora" | "reft"
    rank: int = 8
    mode: str = "prefill"                 # "prefill" (PreFT) | "all" (all-token baseline)
    alpha: float | None = None            # LoRA alpha (default 2 * rank)
    targets: tuple[str, ...] = ALL_TARGETS
    layers: tuple[int, ...] | None = None
    reft_kind: str = "loreft"
    steps: int = 100
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 0                   # 0: eval only at the end
    eval_batch_size: int = 16
    log_every: int = 1
    checkpoint_every: int = 0             # 0: no checkpoints
    logit_chunk: int | None = 64
    pad_multiple: int = 16
    seq_len: int | None = None            # fixed padded length (None: bucket per batch)
    mesh: tuple[int, int, int] = (1, 1, 1)   # (data, fsdp, tensor)

    def adapter_config(self, model_cfg: ModelConfig):
        return make_adapter_config(self.adapter, self.rank, self.mode, self.alpha, self.targets, self.layers,
                                   self.reft_kind, model_cfg.n_layers)

    def to_json(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_json(cls, d: dict) -> "TrainConfig":
        d = dict(d)
        for k in ("targets", "layers", "mesh"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        return cls(**d)


def batch_arrays(batch: Batch | dict) -> dict:
    """The arrays a step consumes: tokens, prompt_lengths, loss_mask."""
    d = batch.arrays() if isinstance(batch, Batch) else batch
    return {"tokens": np.asarray(d["tokens"], np.int32), "prompt_lengths": np.asarray(d["prompt_lengths"], np.int32),
            "loss_mask": np.asarray(d["loss_mask"], np.float32)}


def sft_loss_terms(model_cfg, adapter_config, graphdef, base_state, params, batch, chunk=64):
    """(sum of response-token NLL, number of response tokens)."""
    lp = adapted_logprobs(model_cfg, adapter_config, graphdef, base_state, params, batch["tokens"],
                          batch["prompt_lengths"], 1, 1.0, chunk)
    mask = batch["loss_mask"].astype(jnp.float32)
    return -(lp * mask).sum(), mask.sum()


def sft_loss(model_cfg, adapter_config, graphdef, base_state, params, batch, chunk=64):
    """Token-mean cross-entropy over the response tokens of the batch."""
    nll, n = sft_loss_terms(model_cfg, adapter_config, graphdef, base_state, params, batch, chunk)
    return nll / jnp.maximum(n, 1.0)


class SFTTrainer:
    """Jitted, sharded SFT steps for one adapter on a frozen base model.

    `graphdef, base_state` are a split `Llama` (e.g. `ModelRunner(model).graphdef/.state`)."""

    def __init__(self, model_cfg: ModelConfig, graphdef, base_state, config: TrainConfig,
                 mesh: jax.sharding.Mesh | None = None):
        from preft_jax import sharding as shd
        self.config = config
        self.model_cfg = model_cfg
        self.adapter_config = config.adapter_config(model_cfg)
        self.tx, self.schedule = make_optimizer(config.lr, config.steps, config.warmup_steps,
                                                config.weight_decay, config.grad_clip)
        mesh = shd.make_mesh(*config.mesh) if mesh is None else mesh
        self.setup = ShardedSetup(model_cfg, graphdef, base_state, self.adapter_config, self.tx, mesh)
        self.graphdef = graphdef
        self._steps: dict = {}
        self._evals: dict = {}

    @property
    def mesh(self):
        return self.setup.mesh

    @property
    def base_state(self):
        return self.setup.base_state

    def init_state(self, key=None) -> TrainState:
        return self.setup.init_state(jax.random.key(self.config.seed) if key is None else key)

    # ---- the step
    def _step_fn(self, ts: TrainState, base_state, batch):
        cfg, acfg, gd, chunk = self.model_cfg, self.adapter_config, self.graphdef, self.config.logit_chunk

        def loss_fn(params):
            return sft_loss(cfg, acfg, gd, base_state, params, batch, chunk)

        loss, grads = jax.value_and_grad(loss_fn)(ts.params)
        grads = mask_layer_grads(grads, acfg, cfg.n_layers)
        updates, opt_state = self.tx.update(grads, ts.opt_state, ts.params)
        params = optax.apply_updates(ts.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": self.schedule(ts.step),
                   "tokens": batch["loss_mask"].sum()}
        return TrainState(params, opt_state, ts.step + 1), metrics

    def _compiled(self, arrays: dict):
        key = tuple((k, v.shape) for k, v in sorted(arrays.items()))
        if key not in self._steps:
            self._steps[key] = self.setup.jit_step(self._step_fn, arrays)
        return self._steps[key]

    def step(self, ts: TrainState, batch: Batch | dict) -> tuple[TrainState, dict]:
        """One optimizer step (the input state is donated)."""
        arrays = batch_arrays(batch)
        return self._compiled(arrays)(ts, self.base_state, self.setup.put_batch(arrays))

    # ---- eval
    def _eval_fn(self, params, base_state, batch):
        return sft_loss_terms(self.model_cfg, self.adapter_config, self.graphdef, base_state, params, batch,
                              self.config.logit_chunk)

    def eval_loss(self, params, batches) -> float:
        """Token-mean response cross-entropy over all batches."""
        from preft_jax import sharding as shd
        nll, n = 0.0, 0.0
        for b in batches:
            arrays = batch_arrays(b)
            key = tuple((k, v.shape) for k, v in sorted(arrays.items()))
            if key not in self._evals:
                self._evals[key] = jax.jit(
                    self._eval_fn, in_shardings=(self.setup.state_shardings.params, self.setup.base_shardings,
                                                 self.setup.batch_shardings(arrays)),
                    out_shardings=shd.replicated(self.mesh))
            s, c = self._evals[key](params, self.base_state, self.setup.put_batch(arrays))
            nll += float(s)
            n += float(c)
        return nll / max(n, 1.0)

    # ---- the loop
    def fit(self, train_data: Tokenized, eval_data: Tokenized | None = None, pad_id: int = 0,
            checkpoint_dir: str | os.PathLike | None = None, state: TrainState | None = None,
            metrics_path: str | os.PathLike | None = None, callback=None,
            until: int | None = None) -> tuple[TrainState, list[dict]]:
        """Trains to step `until` (default `config.steps`), resuming from the latest checkpoint in
        checkpoint_dir if there is one; a checkpoint is always written at the last step trained.

        Returns (final state, history of per-step metric dicts; eval rows carry "eval_loss")."""
        c = self.config
        until = c.steps if until is None else min(until, c.steps)
        ckpt = None
        position = 0
        if checkpoint_dir is not None:
            from train.checkpoint import Checkpointer
            ckpt = Checkpointer(checkpoint_dir, save_every=c.checkpoint_every or c.steps)
            if ckpt.latest_step() is not None:
                state, meta = ckpt.restore(self.setup.abstract_state)
                position = int(meta["data_position"])
                log.info("resumed from step %d (data position %d)", int(state.step), position)
        if state is None:
            state = self.init_state()
        it = BatchIterator(train_data, c.batch_size, c.seed, position, pad_id, c.seq_len, c.pad_multiple)
        evals = None if eval_data is None else eval_batches(eval_data, c.eval_batch_size, pad_id, c.seq_len,
                                                            c.pad_multiple)
        history = []
        out = open(metrics_path, "a", encoding="utf-8") if metrics_path else None
        t0 = time.time()
        try:
            while int(state.step) < until:
                state, m = self.step(state, next(it))
                step = int(state.step)
                row = {"step": step, **scalars(m), "time": time.time() - t0}
                if evals is not None and ((c.eval_every and step % c.eval_every == 0) or step == c.steps):
                    row["eval_loss"] = self.eval_loss(state.params, evals)
                history.append(row)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                if c.log_every and (step % c.log_every == 0 or "eval_loss" in row):
                    log.info("step %d loss %.4f%s", step, row["loss"],
                             f" eval_loss {row['eval_loss']:.4f}" if "eval_loss" in row else "")
                if ckpt is not None:
                    ckpt.save(step, state, it.position, c.to_json(), force=step == until)
                if callback is not None:
                    callback(row, state)
        finally:
            if out:
                out.close()
            if ckpt is not None:
                ckpt.close()
        return state, history


# ------------------------------------------------------------------------------------------ CLI
def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--adapter", choices=("lora", "reft"), default="lora")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--mode", choices=("prefill", "all"), default="prefill")
    p.add_argument("--alpha", type=float, default=None)
    p.add_argument("--targets", default=",".join(ALL_TARGETS))
    p.add_argument("--reft-kind", default="loreft", choices=("loreft", "direft"))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--mesh", default="1,1,1", help="data,fsdp,tensor")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded SmolLM2-135M)")
    p.add_argument("--data", default="runs/data", help="dataset folder (generated if missing)")
    p.add_argument("--n-train", type=int, default=512)
    p.add_argument("--n-eval", type=int, default=64)
    p.add_argument("--out", default="runs/sft", help="checkpoints, metrics.jsonl and the exported adapter")
    return p.parse_args(argv)


def main(argv=None):
    from preft_jax.generation import ModelRunner
    from preft_jax.loading import load_model
    from preft_jax.model import Llama
    from train.checkpoint import export_adapter
    from train.data import load_split, tokenize_dataset, write_dataset

    a = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    tc = TrainConfig(adapter=a.adapter, rank=a.rank, mode=a.mode, alpha=a.alpha,
                     targets=tuple(t for t in a.targets.split(",") if t), reft_kind=a.reft_kind, steps=a.steps,
                     batch_size=a.batch_size, lr=a.lr, warmup_steps=a.warmup_steps, weight_decay=a.weight_decay,
                     grad_clip=a.grad_clip, seed=a.seed, eval_every=a.eval_every,
                     checkpoint_every=a.checkpoint_every, mesh=tuple(int(x) for x in a.mesh.split(",")))
    if not (pathlib.Path(a.data) / "train.jsonl").is_file():
        write_dataset(a.data, a.n_train, a.n_eval, a.seed)
    cfg, params, tok = load_model(a.model)
    runner = ModelRunner(Llama.from_params(cfg, params))
    train_rows, eval_rows = load_split(a.data, "train"), load_split(a.data, "eval")
    train_data, eval_data = tokenize_dataset(tok, train_rows), tokenize_dataset(tok, eval_rows)
    trainer = SFTTrainer(cfg, runner.graphdef, runner.state, tc)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    state, hist = trainer.fit(train_data, eval_data, tok.pad_token_id,
                              checkpoint_dir=out / "checkpoints" if a.checkpoint_every else None,
                              metrics_path=out / "metrics.jsonl")
    export_adapter(out / "adapter", cfg, trainer.adapter_config, state.params)
    print(json.dumps({"final_loss": hist[-1]["loss"], "eval_loss": hist[-1].get("eval_loss"),
                      "adapter": str(out / "adapter")}))


if __name__ == "__main__":
    main()
