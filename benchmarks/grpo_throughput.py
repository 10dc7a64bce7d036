"""GRPO steps per minute before and after the issue-14 rollout/scoring changes, timed round-robin.

    JAX_PLATFORMS=cpu python -m benchmarks.grpo_throughput --rounds 6

Variants (same model, same prompts, same rollout key per round, each step from the same identity-
initialized adapter so every variant does the same work):

* before: the pre-issue-14 step - the group's prompts repeated G times through `generate` (each
  copy prefilled), a separate "old policy" teacher-forcing pass even with one optimizer step per
  batch, teacher forcing padded to max prompt + max_new_tokens + 1, the vocab projection over
  every position (two remat chunks of 64).
* after: `train.grpo.GRPOTrainer` as it is: one prefill per prompt (`generate(group=G)`), old =
  stop_gradient(logp) in the loss, teacher forcing to the step's longest sequence, vocab
  projection over response positions only.

Rollout sampling was already the shared `preft_jax.sampling.sample` in both (temperature, top_p 1:
inverse-CDF draw, no vocabulary sort). A step = rollouts + rewards + scoring + one optimizer step.
Each variant runs `--warmup` untimed steps first (compiles); the table gives the median, min and
max seconds per step over the timed rounds and the ratio of medians.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from train.config import AdapterSpec, OptimizerConfig
from train.data import bucket
from train.grpo import GRPOConfig, GRPOTrainer, Rollouts, text_reward_fn


class BeforeGRPOTrainer(GRPOTrainer):
    """The GRPO step as it was before issue 14 (kept here only to measure against)."""

    def bind_data(self, prompts, answers):
        super().bind_data(prompts, answers)
        self.logit_start = 0
        self._fns.clear()
        self._static_length = bucket(max(len(p) for p in prompts) + self.config.max_new_tokens + 1,
                                     self.config.pad_multiple)

    def rollout(self, params, prompts, answers, key) -> Rollouts:
        from preft_jax.adapters.trainable import adapter_bank
        G = self.config.group_size
        rep = [list(p) for p in prompts for _ in range(G)]
        bank = adapter_bank(self.model_cfg, self.adapter_config, params)
        gens = self.runner.generate(rep, self.sampling(), bank, [1] * len(rep), key)
        completions = [g.tokens for g in gens]
        responses = [g.tokens + ([self.stop[0]] if g.finish_reason == "stop" else []) for g in gens]
        rewards = np.array([self.reward_fn(c, answers[i // G]) for i, c in enumerate(completions)],
                           np.float32).reshape(len(prompts), G)
        return Rollouts(rep, completions, responses, rewards, [])

    def rollout_batch(self, ro, length=None):
        return super().rollout_batch(ro, self._static_length)

    def prepare(self, state, dev):
        old, ref = self._score_device(state.params, dev)
        return dict(dev, old_logp=old, ref_logp=ref)


def study_data(tok, n: int, seed: int, max_ops: int):
    from train.data import encode_prompt
    from train.tasks import generate_examples
    ex = generate_examples(n, seed, tasks=("arithmetic",), max_ops=max_ops)
    return [encode_prompt(tok, e.question) for e in ex], [e.answer for e in ex]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--mode", choices=("prefill", "all"), default="prefill")
    a = p.parse_args(argv)
    from preft_jax.generation import ModelRunner
    from preft_jax.loading import load_model
    from preft_jax.model import Llama
    cfg, params, tok = load_model()
    runner = ModelRunner(Llama.from_params(cfg, params))
    prompts, answers = study_data(tok, 64, 1, 1)
    gc = GRPOConfig(adapter=AdapterSpec(kind="lora", rank=8, mode=a.mode), steps=1000,
                    prompts_per_step=a.prompts_per_step, group_size=a.group_size, max_new_tokens=a.max_new_tokens,
                    temperature=0.7, optimizer=OptimizerConfig(lr=1e-3), log_every=0)
    variants = {}
    for name, cls in (("before", BeforeGRPOTrainer), ("after", GRPOTrainer)):
        tr = cls(cfg, runner, gc, text_reward_fn(tok), tok.eos_token_ids, tok.pad_token_id)
        tr.bind_data(prompts, answers)
        variants[name] = tr
    init = variants["after"].init_state()

    def one_step(tr, position):
        state = jax.tree.map(lambda x: x.copy(), init)           # update() donates its input
        t0 = time.perf_counter()
        batch, _, info = tr.next_batch(state, position)
        state, m = tr.update(state, batch)
        jax.block_until_ready((state, m))
        return time.perf_counter() - t0, info["response_len"]

    times = {k: [] for k in variants}
    lens = {k: [] for k in variants}
    for r in range(a.warmup + a.rounds):
        order = list(variants) if r % 2 == 0 else list(variants)[::-1]
        for k in order:
            dt, rl = one_step(variants[k], r)
            if r >= a.warmup:
                times[k].append(dt)
                lens[k].append(rl)
            print(f"round {r} {k}: {dt:.2f} s (mean response {rl:.1f} tokens)", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nSmolLM2-135M float32, {a.mode} LoRA r8, {a.prompts_per_step} prompts x {a.group_size} rollouts, "
          f"max_new_tokens {a.max_new_tokens}, {a.rounds} timed rounds (round-robin, order alternating), "
          f"{jax.device_count()} {jax.devices()[0].platform} device(s)\n")
    print("| variant | median s/step | min | max | steps/min (median) | mean response tokens | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for k, v in times.items():
        print(f"| {k} | {med[k]:.2f} | {min(v):.2f} | {max(v):.2f} | {60 / med[k]:.2f} | {np.mean(lens[k]):.1f} | "
              f"{med['before'] / med[k]:.2f}x |")


if __name__ == "__main__":
    from benchmarks.common import run as _run_main
    raise SystemExit(_run_main(main))
