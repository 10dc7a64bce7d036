"""Supervised fine-tuning of one adapter: prefill-only (PreFT), all-token, or activated (aLoRA).

The loss is the token-mean cross-entropy of the response tokens (prompt and padding masked out),
with teacher-forced log-likelihoods from `preft_jax.generation.sequence_hidden`: the adapter
bank is rebuilt from the trainable params every step and masked per token by its PositionPolicy.
In prefill mode the prompt tokens (the last one included) run adapted and the response tokens run
on base weights attending to the adapted prompt keys/values - exactly the serving computation.
In activated mode (`--mode activated --invocation TEXT|IDS`) the invocation ids end every prompt
(appended when absent) and the adapter acts from their last occurrence in the prompt on, response
included, as HF PEFT's aLoRA does; the exported folder is a PEFT aLoRA adapter.
Only adapter params are trained; the base model state is a constant (sharded) argument.
`SFTTrainer` is the shared `train.trainer.Trainer` loop with this loss and a resumable, seeded batch
source; in a multi-process run each process pads and feeds only its rows of every global batch.

    python -m train.sft --adapter lora --rank 8 --mode prefill --steps 50 --out runs/sft
    python -m train.sft --mode activated --invocation "<|im_start|>check" --steps 50 --out runs/alora
    (or `preft-train sft ...`; see `--help` and docs/training.md for multi-host, dtype and backend flags)

The dataset is generated into <out>/data unless --data names a folder; an existing one is reused
only when the generation flags given (--n-train, --n-eval, --seed) match its meta.json
(train.data.prepare_dataset), else the run stops with an error naming the difference.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from preft_jax import sharding as shd
from preft_jax.adapters.policy import PositionPolicy, activation_start
from train import distributed as dist
from train.common import TrainState, adapted_logprobs
from train.config import OptimizerConfig, TrainerConfig
from train.data import Batch, BatchIterator, Tokenized, bucket, pad_batch
from train.trainer import Callback, Trainer

log = logging.getLogger("train.sft")


@dataclasses.dataclass(frozen=True)
class SFTConfig(TrainerConfig):
    """TrainerConfig + the SFT batch shape. `steps` = optimizer steps = batches."""
    optimizer: OptimizerConfig = OptimizerConfig(lr=1e-3, warmup_steps=10)
    batch_size: int = 8
    eval_batch_size: int = 16
    seq_len: int | None = None            # fixed padded length (None: bucket per batch)

    def __post_init__(self):
        super().__post_init__()
        if self.batch_size < 1 or self.eval_batch_size < 1 or (self.seq_len is not None and self.seq_len < 2):
            raise ValueError("batch_size and eval_batch_size must be >= 1, seq_len None or >= 2")


def batch_arrays(batch: Batch | dict, policy: PositionPolicy | None = None) -> dict:
    """The arrays a step consumes: tokens, prompt_lengths, loss_mask; for an activated `policy` also
    adapter_starts (each row's activation start: the last occurrence of the invocation in its prompt)."""
    d = batch.arrays() if isinstance(batch, Batch) else batch
    out = {"tokens": np.asarray(d["tokens"], np.int32), "prompt_lengths": np.asarray(d["prompt_lengths"], np.int32),
           "loss_mask": np.asarray(d["loss_mask"], np.float32)}
    if policy is not None and policy.mode == "activated":
        starts = d.get("adapter_starts")
        if starts is None:
            starts = [activation_start(policy, row[:n].tolist(), f"being trained (batch row {b})")
                      for b, (row, n) in enumerate(zip(out["tokens"], out["prompt_lengths"]))]
        out["adapter_starts"] = np.asarray(starts, np.int32)
    return out


def sft_loss_terms(model_cfg, adapter_config, graphdef, base_state, params, batch, chunk=64, remat=False):
    """(sum of response-token NLL, number of response tokens). remat: see `train.common.token_logprobs`."""
    lp = adapted_logprobs(model_cfg, adapter_config, graphdef, base_state, params, batch["tokens"],
                          batch["prompt_lengths"], 1, 1.0, chunk, adapter_starts=batch.get("adapter_starts"),
                          remat=remat)
    mask = batch["loss_mask"].astype(jnp.float32)
    return -(lp * mask).sum(), mask.sum()


def sft_loss(model_cfg, adapter_config, graphdef, base_state, params, batch, chunk=64):
    """Token-mean cross-entropy over the response tokens of the batch (reference; the trainer's loss)."""
    nll, n = sft_loss_terms(model_cfg, adapter_config, graphdef, base_state, params, batch, chunk)
    return nll / jnp.maximum(n, 1.0)


class SFTTrainer(Trainer):
    """SFT of one adapter: `fit(train_data, eval_data)` runs the shared loop on seeded, resumable batches.

    `graphdef, base_state` are a split `Llama` (e.g. `ModelRunner(model).graphdef/.state`)."""

    name = "sft"

    def __init__(self, model_cfg, graphdef, base_state, config: SFTConfig, mesh: jax.sharding.Mesh | None = None):
        if not isinstance(config, SFTConfig):
            raise TypeError(f"SFTTrainer needs an SFTConfig, got {type(config).__name__}")
        super().__init__(model_cfg, graphdef, base_state, config, mesh)
        self._data = self._iter = self._eval = None
        self.pad_id = 0

    # ---- the loss
    def loss(self, params, base_state, batch):
        nll, n = sft_loss_terms(self.model_cfg, self.adapter_config, self.graphdef, base_state, params, batch,
                                self.config.logit_chunk, self.config.remat)
        return nll / jnp.maximum(n, 1.0), {"tokens": n}

    def step(self, ts: TrainState, batch: Batch | dict, global_batch_size: int | None = None):
        """One optimizer step (the input state is donated)."""
        if not isinstance(batch, dict) or not all(isinstance(v, jax.Array) for v in batch.values()):
            batch = batch_arrays(batch, self.adapter_config.policy)
        return super().step(ts, batch, global_batch_size)

    # ---- the batch source: this process's rows of each global batch
    def _pad_rows(self, data: Tokenized, idx, n_real: int, split: str = "train") -> tuple[dict, int]:
        """(arrays of this process's rows of the global batch `idx`, global batch size); rows at
        global positions >= n_real are filler (masked out)."""
        c = self.config
        rows = self.local_rows(len(idx))
        mine = [int(i) for i in idx[rows]]
        sizes = [len(data.prompts[i]) + len(data.responses[i]) for i in mine]
        longest = max(sizes)
        overall = dist.global_max(longest)          # every process decides alike (no one left in a collective)
        limit, flag = (c.seq_len, "--seq-len") if c.seq_len else (self.model_cfg.max_seq_len, "the model's context")
        if overall > limit:
            fix = "shorten or drop that row" + (", or raise --seq-len" if c.seq_len else "")
            if longest < overall:
                raise ValueError(f"a row of the {split} split read by another process is {overall} tokens; {flag} "
                                 f"is {limit} tokens: {fix}")
            at = mine[sizes.index(longest)]
            raise ValueError(f"row {at + 1} of the {split} split is {longest} tokens (prompt {len(data.prompts[at])} + "
                             f"response {len(data.responses[at])}, end of turn included); {flag} is {limit} tokens: "
                             f"{fix}")
        length = c.seq_len or bucket(overall, c.pad_multiple, self.model_cfg.max_seq_len)
        b = pad_batch([data.prompts[i] for i in mine], [data.responses[i] for i in mine], self.pad_id, length)
        real = np.arange(rows.start, rows.stop) < n_real
        b.loss_mask[~real] = 0.0
        return batch_arrays(b, self.adapter_config.policy), len(idx)

    def next_batch(self, state, position):
        idx = self._iter.indices(position)
        arrays, size = self._pad_rows(self._data, idx, len(idx))
        return arrays, size, {}

    # ---- eval
    def _eval_fn(self, params, base_state, batch):
        return sft_loss_terms(self.model_cfg, self.adapter_config, self.graphdef, base_state, params, batch,
                              self.config.logit_chunk)

    def eval_loss(self, params, batches, global_batch_size: int | None = None) -> float:
        """Token-mean response cross-entropy over all batches (global batches, or this process's rows
        of global batches of `global_batch_size`)."""
        nll, n = 0.0, 0.0
        for b in batches:
            arrays = batch_arrays(b, self.adapter_config.policy)
            dev = self.put_batch(arrays, global_batch_size)
            fn = self.compiled("eval", dev, lambda: jax.jit(
                self._eval_fn, in_shardings=(self.setup.state_shardings.params, self.setup.base_shardings,
                                             self.setup.batch_shardings(dev)),
                out_shardings=shd.replicated(self.mesh)))
            s, c = fn(params, self.base_state, dev)
            nll += float(s)
            n += float(c)
        return nll / max(n, 1.0)

    def _eval_batches(self, data: Tokenized) -> list[dict]:
        """Every row once, in order; the last batch is filled with copies of row 0, masked out."""
        bs, out = self.config.eval_batch_size, []
        for s in range(0, len(data), bs):
            n_real = min(bs, len(data) - s)
            idx = np.asarray(list(range(s, s + n_real)) + [0] * (bs - n_real))
            out.append(self._pad_rows(data, idx, n_real, "eval")[0])
        return out

    def evaluate(self, state):
        if self._eval is None:
            return {}
        return {"eval_loss": self.eval_loss(state.params, self._eval, self.config.eval_batch_size)}

    # ---- the loop
    def fit(self, train_data: Tokenized, eval_data: Tokenized | None = None, pad_id: int = 0,
            checkpoint_dir: str | os.PathLike | None = None, state: TrainState | None = None,
            metrics_path: str | os.PathLike | None = None, callback: Callback | None = None,
            until: int | None = None, callbacks: tuple[Callback, ...] = ()) -> tuple[TrainState, list[dict]]:
        """Trains to step `until` (default `config.steps`), resuming from the latest checkpoint in
        checkpoint_dir if there is one; a checkpoint is always written at the last step trained.

        Returns (final state, history of per-step metric dicts; eval rows carry "eval_loss")."""
        c = self.config
        self.pad_id, self._data = pad_id, train_data
        self._iter = BatchIterator(train_data, c.batch_size, c.seed, 0, pad_id, c.seq_len, c.pad_multiple)
        self._eval = None if eval_data is None else self._eval_batches(eval_data)
        cbs = tuple(callbacks) + (() if callback is None else (callback,))
        return self.train(checkpoint_dir, metrics_path, cbs, until, state)


# ------------------------------------------------------------------------------------------ CLI
DATA_FLAGS = ("n_train", "n_eval", "seed")       # what a generated dataset depends on


def build_parser(prog: str = "python -m train.sft"):
    from train import cli
    d = SFTConfig()
    p = cli.make_parser(prog, __doc__.split("\n")[0])
    cli.add_trainer_args(p, d, out="runs/sft")
    g = p.add_argument_group("data")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch (all processes)")
    g.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size, help="rows per evaluation batch")
    g.add_argument("--seq-len", type=int, default=d.seq_len, help="fixed padded length (default: bucketed)")
    g.add_argument("--data", default=None, help="dataset folder (default: <out>/data); generated when it holds "
                   "none, reused when its meta.json matches the generation flags given, else an error")
    g.add_argument("--n-train", type=int, default=512, help="training rows to generate")
    g.add_argument("--n-eval", type=int, default=64, help="held-out rows to generate")
    return p


def _parse(argv=None, prog: str = "python -m train.sft"):
    from train import cli
    return cli.parse_noting(build_parser(prog), argv, DATA_FLAGS)


def config_from_args(a, tokenizer=None) -> SFTConfig:
    """The config of parsed flags; a text --invocation is tokenized by `tokenizer` (without one, a
    placeholder id stands in, so the other flags can be validated before the model loads)."""
    from train import cli
    return SFTConfig(**cli.trainer_fields(a, tokenizer), batch_size=a.batch_size, eval_batch_size=a.eval_batch_size,
                     seq_len=a.seq_len)


def run(argv=None, prog: str = "python -m train.sft") -> dict | None:
    """The CLI: returns the summary on process 0 (None elsewhere)."""
    from train import cli
    from train.checkpoint import export_adapter
    from train.data import LazyTokenized, generation_params, load_split

    a = _parse(argv, prog)
    tc = config_from_args(a)                 # validates flags before anything starts
    opts = cli.model_options(a)
    cli.start(a)
    mesh = dist.build_mesh(tc.mesh)   # the mesh must fit the devices
    data = cli.prepare_data(a, generation_params(a.n_train, a.n_eval, a.seed), a.given)
    rows = {split: load_split(data, split, fields=("question", "response"))      # a bad file fails before the
            for split in ("train", "eval")}                                       # model loads
    cfg, runner, tok = cli.load_base(opts, mesh)                    # weights streamed into the mesh
    tc = config_from_args(a, tok)            # a text --invocation becomes the tokenizer's ids
    invocation = tc.adapter.invocation
    train_data = LazyTokenized(tok, rows["train"], invocation=invocation)   # tokenizes only the
    eval_data = LazyTokenized(tok, rows["eval"], invocation=invocation)     # rows it reads
    trainer = SFTTrainer(cfg, runner.graphdef, runner.state, tc, mesh)
    out = pathlib.Path(a.out)
    state, hist = trainer.fit(train_data, eval_data if len(eval_data) else None, tok.pad_token_id,
                              checkpoint_dir=out / "checkpoints", metrics_path=out / "metrics.jsonl",
                              callbacks=cli.callbacks(a))
    params = dist.gather_to_host(state.params)
    if not dist.is_primary():
        return None
    export_adapter(out / "adapter", cfg, trainer.adapter_config, params)
    last = hist[-1] if hist else {}
    summary = {"steps": tc.steps, "final_loss": last.get("loss"), "eval_loss": last.get("eval_loss"),
               "adapter": str(out / "adapter"), "checkpoints": str(out / "checkpoints")}
    print(json.dumps(summary), flush=True)
    return summary


def main(argv=None, prog: str = "python -m train.sft") -> int:
    from train import cli
    return cli.main_guard(lambda args: run(args, prog), argv, exiting=True)


if __name__ == "__main__":
    raise SystemExit(main())
