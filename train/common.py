"""Pieces shared by the SFT and GRPO trainers.

* `token_logprobs`: teacher-forced log-likelihood of every token under the adapted model, through
  `preft_jax.generation.sequence_hidden` - the same per-token adapter masking as prefill + decode
  (prefill mode: prompt positions adapted, response positions on base weights attending to the
  adapted prompt's keys/values). The vocab projection is chunked over the sequence and
  rematerialized, so [B, T, V] float32 logits never exist at once.
* `TrainState` (adapter params + optimizer state + step) and `ShardedSetup`: the mesh, the
  base-model state placed with `preft_jax.sharding`, and the NamedSharding trees that the jitted
  steps use as in/out shardings. Batches are placed with `train.distributed.put_batch` (each
  process contributes its rows of the global batch).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from preft_jax import sharding as shd
from preft_jax.adapters.trainable import adapter_bank, init_adapter
from preft_jax.config import ModelConfig
from preft_jax.generation import sequence_hidden


# ------------------------------------------------------------------------------------- logprobs
def _target_logprobs(model, h, targets, temperature):
    logits = model.logits(h)                                        # [B, c, V] float32
    if temperature != 1.0:
        logits = logits / temperature
    tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return tgt - jax.nn.logsumexp(logits, axis=-1)


def token_logprobs(graphdef, state, tokens, prompt_lengths, bank=None, adapter_ids=None,
                   temperature: float = 1.0, chunk: int | None = 64, start: int = 0, adapter_starts=None,
                   remat: bool | str = False):
    """[B, T] float32: entry t = log p(tokens[:, t] | tokens[:, :t]) (entry 0 = 0).

    `chunk`: sequence positions per vocab-projection chunk (None: all at once). Each chunk is
    rematerialized in the backward pass, so peak memory is O(B * chunk * V).
    `start` (static): the vocab projection runs only for entries t > start; entries 1..start are 0.
    Callers that score responses only pass start <= min(prompt_lengths) - 1 (every skipped entry is
    a prompt token), which skips most of the vocab work for short responses after long prompts.
    `adapter_starts` int32 [B]: activated (aLoRA) rows' activation starts (`policy.activation_starts`).
    `remat`: the decoder layers are rematerialized in the backward pass (`sequence_hidden`)."""
    T = tokens.shape[1]
    if not 0 <= start < T - 1:
        raise ValueError(f"start must be in [0, {T - 1}), got {start}")
    h = sequence_hidden(graphdef, state, tokens, prompt_lengths, bank, adapter_ids, adapter_starts,
                        remat)[:, start:-1]
    targets = tokens[:, start + 1:]
    model = nnx.merge(graphdef, state)
    B, T1, d = h.shape
    if chunk is None or T1 <= chunk:
        lp = _target_logprobs(model, h, targets, temperature)
    else:
        n = -(-T1 // chunk)
        pad = n * chunk - T1
        hc = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, d).swapaxes(0, 1)
        tc = jnp.pad(targets, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)
        fn = jax.checkpoint(lambda x: _target_logprobs(model, x[0], x[1], temperature))
        lp = jax.lax.map(fn, (hc, tc)).swapaxes(0, 1).reshape(B, n * chunk)[:, :T1]
    return jnp.pad(lp, ((0, 0), (start + 1, 0)))


def adapted_logprobs(model_cfg: ModelConfig, adapter_config, graphdef, state, params, tokens, prompt_lengths,
                     adapter_id: int = 1, temperature: float = 1.0, chunk: int | None = 64, start: int = 0,
                     adapter_starts=None, remat: bool | str = False):
    """token_logprobs with the trainable adapter's 2-slot bank; adapter_id 1 = adapted, 0 = base."""
    bank = adapter_bank(model_cfg, adapter_config, params)
    ids = jnp.full((tokens.shape[0],), adapter_id, jnp.int32)
    return token_logprobs(graphdef, state, tokens, prompt_lengths, bank, ids, temperature, chunk, start,
                          adapter_starts, remat)


# ------------------------------------------------------------------------------------ the state
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: dict
    opt_state: optax.OptState
    step: jax.Array


def init_train_state(model_cfg: ModelConfig, adapter_config, tx, key, dtype=jnp.float32) -> TrainState:
    params = init_adapter(model_cfg, adapter_config, key, dtype)
    return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))


def is_abstract(tree) -> bool:
    """Whether every array of `tree` is a `jax.ShapeDtypeStruct` (shapes only: nothing allocated)."""
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def place(tree, shardings):
    """`tree` placed by `shardings`: arrays are device_put; an abstract tree (ShapeDtypeStructs, see
    `is_abstract`) gets the shardings attached instead, for lowering and compiling without allocating
    (benchmarks.memory_plan)."""
    if is_abstract(tree):
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)
    return jax.device_put(tree, shardings)


class ShardedSetup:
    """A mesh, the base model state on it, and the shardings of TrainState / batches.

    `base_state` may be abstract (ShapeDtypeStructs of a model from `nnx.eval_shape`): the jitted
    steps then lower and compile from shapes alone (`Trainer.step_function(batch).lower(...)`)."""

    def __init__(self, model_cfg: ModelConfig, graphdef, base_state, adapter_config, tx,
                 mesh: jax.sharding.Mesh | None = None):
        self.model_cfg, self.graphdef, self.adapter_config, self.tx = model_cfg, graphdef, adapter_config, tx
        self.mesh = shd.make_mesh() if mesh is None else mesh
        self.base_shardings = shd.model_state_shardings(base_state, self.mesh, model_cfg)
        self.base_state = place(base_state, self.base_shardings)
        abstract = jax.eval_shape(lambda k: init_train_state(model_cfg, adapter_config, tx, k), jax.random.key(0))
        p_sh = shd.adapter_shardings(abstract.params, self.mesh, model_cfg)
        o_sh = shd.optimizer_shardings(tx, abstract.opt_state, p_sh, self.mesh)
        self.state_shardings = TrainState(p_sh, o_sh, shd.replicated(self.mesh))
        self.abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                           abstract, self.state_shardings)
        self._init = jax.jit(lambda k: init_train_state(model_cfg, adapter_config, tx, k),
                             out_shardings=self.state_shardings)

    def init_state(self, key) -> TrainState:
        return self._init(key)

    def batch_shardings(self, batch: dict):
        return shd.batch_shardings(batch, self.mesh)

    def put_batch(self, batch: dict, global_batch_size: int | None = None) -> dict:
        """Global arrays split on the batch dim: `batch` is the global batch (None) or this process's rows."""
        from train.distributed import put_batch
        return put_batch(batch, self.mesh, global_batch_size)

    def jit_step(self, fn: Callable, batch_example: dict, donate: bool = True):
        """jit `fn(train_state, base_state, batch) -> (train_state, metrics)` with NamedShardings."""
        return jax.jit(fn, in_shardings=(self.state_shardings, self.base_shardings,
                                         self.batch_shardings(batch_example)),
                       out_shardings=(self.state_shardings, shd.replicated(self.mesh)),
                       donate_argnums=(0,) if donate else ())


def to_host(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def scalars(metrics: dict) -> dict:
    return {k: float(np.asarray(v)) for k, v in metrics.items()}
