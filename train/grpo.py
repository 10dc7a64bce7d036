"""GRPO (group relative policy optimization) of one adapter with verifiable rewards.

Per step:

1. rollouts: each of `prompts_per_step` prompts is sampled `group_size` times with
   `ModelRunner.generate` - the serving prefill/decode core. In prefill mode the adapter builds the
   prompt KV cache (and samples the first token); every later token is decoded on base weights.
   In all-token mode decode uses the adapter too.
2. rewards from the verifier (`train.tasks.reward`), group-normalized advantages
   A = (r - mean_group) / (std_group + eps).
3. the rollout ("old") policy log-probs and the reference (base model: adapter slot 0) log-probs
   are recomputed by teacher forcing with the same per-token adapter masking as the rollouts.
4. `inner_steps` optimizer steps on the clipped surrogate with a k3 KL penalty to the base model:
       ratio_t = exp(logp_t - old_t);  s_t = min(ratio_t A, clip(ratio_t, 1 - eps, 1 + eps) A)
       kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1
       loss = mean_seq[ sum_t m_t (-s_t + beta kl_t) / sum_t m_t ]     (response tokens only)

Log-probs use logits / temperature (the distribution the rollouts were sampled from, top_p = 1).
In prefill mode the response tokens run on base weights, but their logits depend on the adapter
through attention to the adapted prompt keys/values, so the gradient reaches the adapter.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from preft_jax import sharding as shd
from preft_jax.adapters.trainable import adapter_bank
from preft_jax.config import ModelConfig
from preft_jax.generation import ModelRunner
from preft_jax.sampling import SamplingParams
from train.common import (ALL_TARGETS, ShardedSetup, TrainState, adapted_logprobs, make_adapter_config,
                          make_optimizer, mask_layer_grads, scalars)
from train.data import bucket, pad_batch

log = logging.getLogger("train.grpo")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    adapter: str = "lora"
    rank: int = 8
    mode: str = "prefill"
    alpha: float | None = None
    targets: tuple[str, ...] = ALL_TARGETS
    layers: tuple[int, ...] | None = None
    reft_kind: str = "loreft"
    steps: int = 20
    prompts_per_step: int = 4
    group_size: int = 8
    max_new_tokens: int = 32
    temperature: float = 1.0
    lr: float = 1e-4
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 0.04
    adv_eps: float = 1e-4
    inner_steps: int = 1
    seed: int = 0
    logit_chunk: int | None = 64
    pad_multiple: int = 16
    checkpoint_every: int = 0
    mesh: tuple[int, int, int] = (1, 1, 1)

    def adapter_config(self, model_cfg: ModelConfig):
        return make_adapter_config(self.adapter, self.rank, self.mode, self.alpha, self.targets, self.layers,
                                   self.reft_kind, model_cfg.n_layers)

    def to_json(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))


# ------------------------------------------------------------------------------- the objective
def group_advantages(rewards, eps: float = 1e-4):
    """rewards [P, G] -> (r - mean over the group) / (population std over the group + eps)."""
    r = jnp.asarray(rewards, jnp.float32)
    return (r - r.mean(-1, keepdims=True)) / (r.std(-1, keepdims=True) + eps)


def k3_kl(logp, ref_logp):
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    d = ref_logp - logp
    return jnp.exp(d) - d - 1.0


def grpo_objective(logp, old_logp, ref_logp, advantages, mask, clip_eps: float = 0.2, kl_coef: float = 0.04):
    """All [B, T] but advantages [B]. Returns (loss, metrics) over the masked (response) tokens."""
    mask = mask.astype(jnp.float32)
    ratio = jnp.exp(logp - old_logp)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    surrogate = jnp.minimum(unclipped, clipped)
    kl = k3_kl(logp, ref_logp)
    per_token = -surrogate + kl_coef * kl
    n_tok = mask.sum(-1)
    has = (n_tok > 0).astype(jnp.float32)
    per_seq = (per_token * mask).sum(-1) / jnp.maximum(n_tok, 1.0)
    loss = (per_seq * has).sum() / jnp.maximum(has.sum(), 1.0)
    total = jnp.maximum(mask.sum(), 1.0)
    metrics = {"kl": (kl * mask).sum() / total,
               "clip_frac": ((jnp.abs(ratio - 1.0) > clip_eps) * mask).sum() / total,
               "ratio": (ratio * mask).sum() / total}
    return loss, metrics


# ---------------------------------------------------------------------------------- rollouts
@dataclasses.dataclass
class Rollouts:
    prompts: list[list[int]]          # B = P * G (each prompt repeated G times, group-major)
    completions: list[list[int]]      # generated ids (stop token excluded)
    responses: list[list[int]]        # scored ids: completion + stop token when it stopped
    rewards: np.ndarray               # [P, G]
    texts: list[str]


class GRPOTrainer:
    """GRPO on a frozen base model. `runner` is a `ModelRunner` of the base model (not modified).

    reward_fn(completion_ids, answer) -> float. `decode` (ids -> text) is used for `texts`.
    """

    def __init__(self, model_cfg: ModelConfig, runner: ModelRunner, config: GRPOConfig,
                 reward_fn: Callable[[Sequence[int], object], float], stop_token_ids: Sequence[int] = (),
                 pad_id: int = 0, mesh: jax.sharding.Mesh | None = None,
                 decode: Callable[[Sequence[int]], str] | None = None):
        self.config, self.model_cfg = config, model_cfg
        self.adapter_config = config.adapter_config(model_cfg)
        self.tx, self.schedule = make_optimizer(config.lr, config.steps * config.inner_steps,
                                                config.warmup_steps, config.weight_decay, config.grad_clip)
        mesh = shd.make_mesh(*config.mesh) if mesh is None else mesh
        self.setup = ShardedSetup(model_cfg, runner.graphdef, runner.state, self.adapter_config, self.tx, mesh)
        self.graphdef = runner.graphdef
        self.runner = copy.copy(runner)
        self.runner.state = self.setup.base_state
        self.reward_fn, self.decode = reward_fn, decode
        self.stop = tuple(stop_token_ids) or tuple(model_cfg.eos_token_ids)
        self.pad_id = pad_id
        self._fns: dict = {}

    @property
    def base_state(self):
        return self.setup.base_state

    def init_state(self, key=None) -> TrainState:
        return self.setup.init_state(jax.random.key(self.config.seed) if key is None else key)

    # ---- rollouts
    def sampling(self) -> SamplingParams:
        c = self.config
        return SamplingParams(temperature=c.temperature, top_p=1.0, max_new_tokens=c.max_new_tokens,
                              stop_token_ids=self.stop)

    def rollout(self, params, prompts: Sequence[Sequence[int]], answers: Sequence, key) -> Rollouts:
        """G samples per prompt via ModelRunner.generate with the adapter in slot 1 (serving path)."""
        G = self.config.group_size
        rep = [list(p) for p in prompts for _ in range(G)]
        bank = adapter_bank(self.model_cfg, self.adapter_config, params)
        gens = self.runner.generate(rep, self.sampling(), bank, [1] * len(rep), key)
        completions = [g.tokens for g in gens]
        responses = [g.tokens + ([self.stop[0]] if g.finish_reason == "stop" else []) for g in gens]
        rewards = np.array([self.reward_fn(c, answers[i // G]) for i, c in enumerate(completions)],
                           np.float32).reshape(len(prompts), G)
        texts = [self.decode(c) for c in completions] if self.decode else []
        return Rollouts(rep, completions, responses, rewards, texts)

    def rollout_batch(self, ro: Rollouts, length: int | None = None) -> dict:
        """Teacher-forcing arrays of the rollouts + advantages."""
        if length is None:
            length = bucket(max(len(p) for p in ro.prompts) + self.config.max_new_tokens + 1,
                            self.config.pad_multiple)
        b = pad_batch(ro.prompts, ro.responses, self.pad_id, length)
        adv = np.asarray(group_advantages(ro.rewards, self.config.adv_eps)).reshape(-1)
        return {"tokens": b.tokens, "prompt_lengths": b.prompt_lengths, "loss_mask": b.loss_mask,
                "advantages": adv.astype(np.float32)}

    # ---- jitted pieces
    def _logprobs(self, params, base_state, batch, adapter_id):
        return adapted_logprobs(self.model_cfg, self.adapter_config, self.graphdef, base_state, params,
                                batch["tokens"], batch["prompt_lengths"], adapter_id, self.config.temperature,
                                self.config.logit_chunk)

    def _score_fn(self, params, base_state, batch):
        """(old policy log-probs, reference = base model log-probs), both [B, T]."""
        return self._logprobs(params, base_state, batch, 1), self._logprobs(params, base_state, batch, 0)

    def _loss(self, params, base_state, batch):
        c = self.config
        logp = self._logprobs(params, base_state, batch, 1)
        return grpo_objective(logp, batch["old_logp"], batch["ref_logp"], batch["advantages"], batch["loss_mask"],
                              c.clip_eps, c.kl_coef)

    def _step_fn(self, ts: TrainState, base_state, batch):
        (loss, m), grads = jax.value_and_grad(self._loss, has_aux=True)(ts.params, base_state, batch)
        grads = mask_layer_grads(grads, self.adapter_config, self.model_cfg.n_layers)
        updates, opt_state = self.tx.update(grads, ts.opt_state, ts.params)
        params = optax.apply_updates(ts.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": self.schedule(ts.step), **m}
        return TrainState(params, opt_state, ts.step + 1), metrics

    def _jitted(self, name, arrays):
        key = (name,) + tuple((k, v.shape) for k, v in sorted(arrays.items()))
        if key not in self._fns:
            if name == "score":
                out = jax.sharding.NamedSharding(self.setup.mesh, shd.batch_spec(arrays["tokens"].shape,
                                                                                  self.setup.mesh))
                self._fns[key] = jax.jit(self._score_fn, in_shardings=(
                    self.setup.state_shardings.params, self.setup.base_shardings, self.setup.batch_shardings(arrays)),
                    out_shardings=(out, out))
            else:
                self._fns[key] = self.setup.jit_step(self._step_fn, arrays)
        return self._fns[key]

    def score(self, params, batch: dict):
        return self._jitted("score", batch)(params, self.base_state, self.setup.put_batch(batch))

    def update(self, ts: TrainState, batch: dict) -> tuple[TrainState, dict]:
        """inner_steps optimizer steps on one rollout batch (old/ref log-probs computed here)."""
        old, ref = self.score(ts.params, batch)
        full = dict(batch, old_logp=np.asarray(old), ref_logp=np.asarray(ref))
        metrics = None
        for _ in range(self.config.inner_steps):
            ts, metrics = self._jitted("step", full)(ts, self.base_state, self.setup.put_batch(full))
        return ts, metrics

    # ---- the loop
    def fit(self, prompts: Sequence[Sequence[int]], answers: Sequence, state: TrainState | None = None,
            checkpoint_dir: str | os.PathLike | None = None, metrics_path: str | os.PathLike | None = None,
            callback=None) -> tuple[TrainState, list[dict]]:
        """`config.steps` GRPO steps; prompts are taken in a seeded shuffled order (resumable)."""
        c = self.config
        P = c.prompts_per_step
        if P > len(prompts):
            raise ValueError(f"prompts_per_step {P} > {len(prompts)} prompts")
        per_epoch = len(prompts) // P
        length = bucket(max(len(p) for p in prompts) + c.max_new_tokens + 1, c.pad_multiple)
        ckpt, start = None, 0
        if checkpoint_dir is not None:
            from train.checkpoint import Checkpointer
            ckpt = Checkpointer(checkpoint_dir, save_every=c.checkpoint_every or c.steps)
            if ckpt.latest_step() is not None:
                state, meta = ckpt.restore(self.setup.abstract_state)
        if state is None:
            state = self.init_state()
        start = int(state.step) // c.inner_steps
        base_key = jax.random.key(c.seed + 1)
        history = []
        out = open(metrics_path, "a", encoding="utf-8") if metrics_path else None
        try:
            for it in range(start, c.steps):
                t0 = time.time()
                epoch, k = divmod(it, per_epoch)
                order = np.random.default_rng([c.seed, epoch]).permutation(len(prompts))
                idx = order[k * P:(k + 1) * P]
                ro = self.rollout(state.params, [prompts[i] for i in idx], [answers[i] for i in idx],
                                  jax.random.fold_in(base_key, it))
                t_roll = time.time()
                state, m = self.update(state, self.rollout_batch(ro, length))
                row = {"step": it + 1, "reward_mean": float(ro.rewards.mean()),
                       "reward_std": float(ro.rewards.std()),
                       "response_len": float(np.mean([len(r) for r in ro.responses])),
                       **scalars(m), "rollout_s": t_roll - t0, "update_s": time.time() - t_roll}
                history.append(row)
                log.info("step %d reward %.3f loss %.4f kl %.4f", it + 1, row["reward_mean"], row["loss"], row["kl"])
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                if ckpt is not None:
                    ckpt.save(it + 1, state, it + 1, c.to_json(), force=it + 1 == c.steps)
                if callback is not None:
                    callback(row, state, ro)
        finally:
            if out:
                out.close()
            if ckpt is not None:
                ckpt.close()
        return state, history


def text_reward_fn(tokenizer):
    """reward_fn for GRPOTrainer: decode the completion and verify its final number (train.tasks.reward)."""
    from train.tasks import reward

    def fn(completion_ids, answer):
        return reward(tokenizer.decode(completion_ids), answer)
    return fn
