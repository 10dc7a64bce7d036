"""GRPO (group relative policy optimization) of one adapter with verifiable rewards.

Per step:

1. rollouts: each of `prompts_per_step` prompts is sampled `group_size` times in one
   `ModelRunner.generate(..., group=G)` call - the fixed-row prefill/decode of preft_jax/generation.py
   (not the paged serving engine) and the sampler serving uses too
   (`preft_jax.sampling.sample`: top_p = 1 draws by inverse CDF, no vocabulary sort); each prompt
   is prefilled once and its cache rows are repeated for the group. In prefill mode the adapter builds the
   prompt KV cache (and samples the first token); every later token is decoded on base weights.
   In all-token mode decode uses the adapter too.
2. rewards from the verifier (`train.tasks.reward`), group-normalized advantages
   A = (r - mean_group) / (std_group + eps).
3. the reference (base model: adapter slot 0) log-probs, and with `inner_steps` > 1 the rollout
   ("old") policy's, are recomputed by teacher forcing with the same per-token adapter masking as
   the rollouts. With one optimizer step per batch the update's parameters are the rollout
   policy's, so old = stop_gradient(logp) inside the loss (ratio 1, the same gradient) and that
   forward pass is skipped. Teacher forcing covers only this step's longest sequence (padded to
   `pad_multiple`), and the vocab projection skips the prompt positions (`token_logprobs(start=)`).
4. `inner_steps` optimizer steps on the clipped surrogate with a k3 KL penalty to the base model:
       ratio_t = exp(logp_t - old_t);  s_t = min(ratio_t A, clip(ratio_t, 1 - eps, 1 + eps) A)
       kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1
       loss = mean_seq[ sum_t m_t (-s_t + beta kl_t) / sum_t m_t ]     (response tokens only)

Log-probs use logits / temperature (the distribution the rollouts were sampled from, top_p = 1).
In prefill mode the response tokens run on base weights, but their logits depend on the adapter
through attention to the adapted prompt keys/values, so the gradient reaches the adapter.

`GRPOTrainer` is the shared `train.trainer.Trainer` loop with this objective and the rollouts as its
batch source. Multi-process: every process generates *all* rollouts of a step with the same key
through the globally sharded model (one SPMD program; the results are replicated, identical in
every process), computes the same rewards, and feeds its rows of the batch to the update.

    python -m train.grpo --adapter lora --rank 8 --mode prefill --steps 20 --out runs/grpo
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import logging
import math
import os
import pathlib
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from preft_jax import sharding as shd
from preft_jax.adapters.trainable import adapter_bank
from preft_jax.config import ModelConfig
from preft_jax.generation import ModelRunner
from preft_jax.sampling import SamplingParams
from train import distributed as dist
from train.common import TrainState, adapted_logprobs
from train.config import OptimizerConfig, TrainerConfig, check_finite
from train.data import DatasetFormatError, bucket, pad_batch, split_path
from train.trainer import Callback, RunError, Trainer

log = logging.getLogger("train.grpo")


@dataclasses.dataclass(frozen=True)
class GRPOConfig(TrainerConfig):
    """TrainerConfig + rollouts and the objective. `steps` = rollout batches (each `inner_steps`
    optimizer steps)."""
    optimizer: OptimizerConfig = OptimizerConfig(lr=1e-4, warmup_steps=0)
    steps: int = 20
    prompts_per_step: int = 4
    group_size: int = 8
    max_new_tokens: int = 32
    temperature: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 0.04
    adv_eps: float = 1e-4
    inner_steps: int = 1

    def __post_init__(self):
        super().__post_init__()
        for k in ("prompts_per_step", "group_size", "max_new_tokens", "inner_steps"):
            if getattr(self, k) < 1:
                raise ValueError(f"GRPOConfig.{k} must be >= 1, got {getattr(self, k)}")
        if self.group_size < 2:
            raise ValueError("GRPOConfig.group_size must be >= 2: a completion's advantage is its reward against "
                             "the others of its group, so a group of 1 has advantage 0 and learns nothing")
        for k, low_ok in (("temperature", False), ("clip_eps", False), ("adv_eps", False), ("kl_coef", True)):
            check_finite("GRPOConfig", getattr(self, k), k, 0, low_ok)     # rollouts are sampled: temperature > 0
        if self.adapter.mode == "activated":
            raise ValueError("GRPO trains prefill or all-token adapters; mode 'activated' (aLoRA) is trained by "
                             "train.sft")


class RewardError(RunError):
    """A reward function returned something that is not a finite number."""


def reward_value(value, fn, prompt: int) -> float:
    """`value` (a reward function's return) as a float; RewardError naming the function when it is
    not a finite real number (NaN / inf / None would make every advantage of its group, and then
    the adapter, NaN)."""
    try:       # a Python / numpy / 0-d array number (a bool counts as 0 / 1); not a string
        f = None if isinstance(value, (str, bytes)) or np.ndim(value) or np.iscomplexobj(value) else float(value)
    except (TypeError, ValueError):
        f = None
    if f is None or not math.isfinite(f):
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        module = getattr(fn, "__module__", None)
        where = f"{module}:{name}" if module else name
        raise RewardError(f"the reward function {where} returned {repr(value)[:100]} for a completion of prompt "
                          f"{prompt} of this step; a reward must be a finite number")
    return f


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


class GRPOTrainer(Trainer):
    """GRPO on a frozen base model. `runner` is a `ModelRunner` of the base model (not modified).

    reward_fn(completion_ids, answer) -> float. `decode` (ids -> text) is used for `texts`.
    """

    name = "grpo"

    def __init__(self, model_cfg: ModelConfig, runner: ModelRunner, config: GRPOConfig,
                 reward_fn: Callable[[Sequence[int], object], float], stop_token_ids: Sequence[int] = (),
                 pad_id: int = 0, mesh: jax.sharding.Mesh | None = None,
                 decode: Callable[[Sequence[int]], str] | None = None):
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"GRPOTrainer needs a GRPOConfig, got {type(config).__name__}")
        self.inner_steps = config.inner_steps
        super().__init__(model_cfg, runner.graphdef, runner.state, config, mesh)
        self.runner = copy.copy(runner)
        self.runner.state = self.setup.base_state        # rollouts run on the sharded base model
        self.reward_fn, self.decode = reward_fn, decode
        self.stop = tuple(stop_token_ids) or tuple(model_cfg.eos_token_ids)
        self.pad_id = pad_id
        self.last_rollouts: Rollouts | None = None
        self._prompts = self._answers = None
        self.logit_start = 0              # fit(): min prompt length - 1 (static; see token_logprobs)

    # ---- rollouts
    def sampling(self) -> SamplingParams:
        c = self.config
        return SamplingParams(temperature=c.temperature, top_p=1.0, max_new_tokens=c.max_new_tokens,
                              stop_token_ids=self.stop)

    def rollout(self, params, prompts: Sequence[Sequence[int]], answers: Sequence, key) -> Rollouts:
        """G samples per prompt via ModelRunner.generate with the adapter in bank slot 1.

        Every process runs the same generation (same key, globally sharded model): identical rollouts."""
        G = self.config.group_size
        rep = [list(p) for p in prompts for _ in range(G)]
        bank = adapter_bank(self.model_cfg, self.adapter_config, params)
        gens = self.runner.generate([list(p) for p in prompts], self.sampling(), bank, [1] * len(prompts), key,
                                    group=G)     # one prefill per prompt, G samples of each
        completions = [g.tokens for g in gens]
        responses = [g.tokens + ([g.stop_token] if g.finish_reason == "stop" else []) for g in gens]
        rewards = np.array([reward_value(self.reward_fn(c, answers[i // G]), self.reward_fn, i // G)
                            for i, c in enumerate(completions)], np.float32).reshape(len(prompts), G)
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

    # ---- the loss and its inputs
    def _logprobs(self, params, base_state, batch, adapter_id):
        return adapted_logprobs(self.model_cfg, self.adapter_config, self.graphdef, base_state, params,
                                batch["tokens"], batch["prompt_lengths"], adapter_id, self.config.temperature,
                                self.config.logit_chunk, self.logit_start, remat=self.config.remat)

    def _score_fn(self, params, base_state, batch):
        """(old policy log-probs, reference = base model log-probs), both [B, T]."""
        return self._logprobs(params, base_state, batch, 1), self._logprobs(params, base_state, batch, 0)

    def _ref_fn(self, params, base_state, batch):
        return (self._logprobs(params, base_state, batch, 0),)

    def loss(self, params, base_state, batch):
        c = self.config
        logp = self._logprobs(params, base_state, batch, 1)
        old = batch["old_logp"] if "old_logp" in batch else jax.lax.stop_gradient(logp)
        return grpo_objective(logp, old, batch["ref_logp"], batch["advantages"], batch["loss_mask"],
                              c.clip_eps, c.kl_coef)

    def score_function(self, batch: dict, with_old: bool = True) -> Callable:
        """The jitted, sharded scoring `(params, base_state, batch) -> (old, ref)` log-probs [B, T] (with_old)
        or `-> (ref,)`, for batches shaped like `batch` (device arrays or ShapeDtypeStructs); built once
        per batch shape. `prepare` calls it; benchmarks.memory_plan compiles it from abstract shapes."""
        fn = self._score_fn if with_old else self._ref_fn
        n_out = 2 if with_old else 1

        def build():
            out = jax.sharding.NamedSharding(self.mesh, shd.batch_spec(batch["tokens"].shape, self.mesh))
            return jax.jit(fn, in_shardings=(self.setup.state_shardings.params, self.setup.base_shardings,
                                             self.setup.batch_shardings(batch)), out_shardings=(out,) * n_out)
        return self.compiled("score" if with_old else "ref", batch, build)

    def _score_device(self, params, dev: dict, with_old: bool = True):
        return self.score_function(dev, with_old)(params, self.base_state, dev)

    def score(self, params, batch: dict):
        """(old, ref) log-probs of a host batch (global arrays)."""
        return self._score_device(params, self.put_batch(batch))

    def prepare(self, state, dev):
        if self.inner_steps == 1:         # old == logp at the update: computed inside the loss
            (ref,) = self._score_device(state.params, dev, with_old=False)
            return dict(dev, ref_logp=ref)
        old, ref = self._score_device(state.params, dev)
        return dict(dev, old_logp=old, ref_logp=ref)

    # ---- the batch source: this step's prompts, rollouts, rewards
    def next_batch(self, state, position):
        c = self.config
        P = c.prompts_per_step
        epoch, k = divmod(position, len(self._prompts) // P)
        order = np.random.default_rng([c.seed, epoch]).permutation(len(self._prompts))
        idx = order[k * P:(k + 1) * P]
        ro = self.rollout(state.params, [self._prompts[i] for i in idx], [self._answers[i] for i in idx],
                          jax.random.fold_in(jax.random.key(c.seed + 1), position))
        self.last_rollouts = ro
        info = {"reward_mean": float(ro.rewards.mean()), "reward_std": float(ro.rewards.std()),
                "response_len": float(np.mean([len(r) for r in ro.responses]))}
        length = bucket(max(len(p) + len(r) for p, r in zip(ro.prompts, ro.responses)), c.pad_multiple)
        return self.rollout_batch(ro, max(length, self.logit_start + 2)), None, info

    def log_keys(self):
        return ("reward_mean", "kl")

    # ---- the loop
    def fit(self, prompts: Sequence[Sequence[int]], answers: Sequence, state: TrainState | None = None,
            checkpoint_dir: str | os.PathLike | None = None, metrics_path: str | os.PathLike | None = None,
            callback: Callback | None = None, until: int | None = None,
            callbacks: tuple[Callback, ...] = ()) -> tuple[TrainState, list[dict]]:
        """`config.steps` GRPO steps; prompts are taken in a seeded shuffled order (resumable).
        `self.last_rollouts` holds the latest step's rollouts (for callbacks)."""
        self.bind_data(prompts, answers)
        cbs = tuple(callbacks) + (() if callback is None else (callback,))
        return self.train(checkpoint_dir, metrics_path, cbs, until, state)

    def bind_data(self, prompts: Sequence[Sequence[int]], answers: Sequence) -> None:
        """The prompt set `next_batch` draws from (fit calls it)."""
        c = self.config
        if c.prompts_per_step > len(prompts):
            raise ValueError(f"prompts_per_step {c.prompts_per_step} > {len(prompts)} prompts")
        if len(answers) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
        self._prompts, self._answers = list(prompts), list(answers)
        start = min(len(p) for p in prompts) - 1
        if start != self.logit_start:      # a static argument of the jitted functions: recompile
            self.logit_start = start
            self._fns.clear()


def text_reward_fn(tokenizer):
    """reward_fn for GRPOTrainer: decode the completion and verify its final number (train.tasks.reward)."""
    from train.tasks import reward

    def fn(completion_ids, answer):
        return reward(tokenizer.decode(completion_ids), answer)
    return fn


# ------------------------------------------------------------------------------------------ CLI
def load_reward(spec: str, tokenizer) -> Callable[[Sequence[int], object], float]:
    """"answer": the verifier of train.tasks on the decoded completion; "module:function": a
    reward_fn(completion_ids, answer) -> float imported from a module."""
    if spec == "answer":
        return text_reward_fn(tokenizer)
    mod, sep, attr = spec.partition(":")
    if not sep or not mod or not attr:
        raise ValueError(f"--reward must be 'answer' or 'module:function', got {spec!r}")
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--reward {spec!r}: cannot import it ({e})") from None
    if not callable(fn):
        raise ValueError(f"--reward {spec!r} is not callable")
    return fn


def check_answers(answers: Sequence, where) -> None:
    """The "answer" reward compares a completion's final number with each row's answer: every answer
    must be a number or a string of one (`train.tasks.answer_number`), else a DatasetFormatError
    naming the row (it would score 0 for every completion, and train nothing, silently)."""
    from train.tasks import answer_number
    for i, ans in enumerate(answers):
        if answer_number(ans) is None:
            raise DatasetFormatError(f"{where}: row {i + 1}: answer {repr(ans)[:80]} is not a number; --reward answer "
                                     f"compares the completion's final number with it (a number, or a string of "
                                     f"one); give another reward with --reward module:function")


DATA_FLAGS = ("n_train", "seed", "tasks", "max_ops")     # what a generated dataset depends on


def build_parser(prog: str = "python -m train.grpo"):
    from train import cli
    d = GRPOConfig()
    p = cli.make_parser(prog, "GRPO of one adapter with verifiable rewards")
    cli.add_trainer_args(p, d, out="runs/grpo")
    g = p.add_argument_group("rollouts and objective")
    g.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step, help="prompts per rollout batch")
    g.add_argument("--group-size", type=int, default=d.group_size, help="samples per prompt (the GRPO group)")
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="most tokens per rollout")
    g.add_argument("--temperature", type=float, default=d.temperature, help="rollout sampling temperature")
    g.add_argument("--clip-eps", type=float, default=d.clip_eps, help="PPO-style ratio clip")
    g.add_argument("--kl-coef", type=float, default=d.kl_coef, help="weight of the k3 KL penalty to the base model")
    g.add_argument("--inner-steps", type=int, default=d.inner_steps, help="optimizer steps per rollout batch")
    g.add_argument("--reward", default="answer", help="'answer' (train.tasks verifier) or module:function")
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None, help="dataset folder (default: <out>/data); generated when it holds "
                   "none, reused when its meta.json matches the generation flags given, else an error")
    g.add_argument("--n-train", type=int, default=64, help="training prompts to generate")
    g.add_argument("--tasks", default="arithmetic", help="comma-separated train.tasks kinds for generation")
    g.add_argument("--max-ops", type=int, default=1, help="most operations per generated arithmetic question")
    return p


def _parse(argv=None, prog: str = "python -m train.grpo"):
    from train import cli
    return cli.parse_noting(build_parser(prog), argv, DATA_FLAGS)


def config_from_args(a) -> GRPOConfig:
    from train import cli
    return GRPOConfig(**cli.trainer_fields(a), prompts_per_step=a.prompts_per_step, group_size=a.group_size,
                      max_new_tokens=a.max_new_tokens, temperature=a.temperature, clip_eps=a.clip_eps,
                      kl_coef=a.kl_coef, inner_steps=a.inner_steps)


def run(argv=None, prog: str = "python -m train.grpo") -> dict | None:
    """The CLI: returns the summary on process 0 (None elsewhere)."""
    from train import cli
    from train.checkpoint import export_adapter
    from train.data import encode_prompt, generation_params, load_split

    a = _parse(argv, prog)
    gc = config_from_args(a)
    opts = cli.model_options(a)
    cli.start(a)
    mesh = dist.build_mesh(gc.mesh)   # the mesh must fit the devices
    data = cli.prepare_data(a, generation_params(a.n_train, 1, a.seed + 1, a.tasks.split(","), a.max_ops), a.given)
    rows = load_split(data, "train", fields=("question", "answer"))   # a bad file fails before the model loads
    answers = [r["answer"] for r in rows]
    if a.reward == "answer":
        check_answers(answers, split_path(data, "train"))
    cfg, runner, tok = cli.load_base(opts, mesh)                    # weights streamed into the mesh
    reward_fn = load_reward(a.reward, tok)
    prompts = [encode_prompt(tok, r["question"]) for r in rows]
    trainer = GRPOTrainer(cfg, runner, gc, reward_fn, tok.eos_token_ids, tok.pad_token_id or 0, mesh=mesh,
                          decode=tok.decode)
    out = pathlib.Path(a.out)
    state, hist = trainer.fit(prompts, answers, checkpoint_dir=out / "checkpoints",
                              metrics_path=out / "metrics.jsonl", callbacks=cli.callbacks(a))
    params = dist.gather_to_host(state.params)
    if not dist.is_primary():
        return None
    export_adapter(out / "adapter", cfg, trainer.adapter_config, params)
    summary = {"steps": gc.steps, "reward": [h["reward_mean"] for h in hist], "adapter": str(out / "adapter"),
               "checkpoints": str(out / "checkpoints")}
    print(json.dumps(summary), flush=True)
    return summary


def main(argv=None, prog: str = "python -m train.grpo") -> int:
    from train import cli
    return cli.main_guard(lambda args: run(args, prog), argv, exiting=True)


if __name__ == "__main__":
    raise SystemExit(main())
