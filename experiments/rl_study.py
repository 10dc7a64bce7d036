"""The RL parity study (issue 14): GRPO of several adapter arms x seeds on one verifiable task.

    python -m experiments.rl_study --out runs/rl_study [--steps 150 --seeds 2 --chunk 25]
    python -m experiments.rl_study --out runs/rl_study --report --doc-dir docs/rl_study

Every (arm, seed) is a resumable unit in `<out>/units/<arm>-s<seed>/`: an Orbax checkpoint (the
shared `Trainer` loop resumes from it, refusing another model or adapter), `metrics.jsonl` (one row
per GRPO step: reward, KL to base, response length, loss, timings), `evals.jsonl` (held-out greedy
accuracy every `eval_every` steps and at the end) and `status.json`. Units advance round-robin,
`chunk` steps at a time, so a run cut off at any point leaves every arm with comparable progress.

`<out>/study.json` holds the study config and its hash; rerunning with a config that differs
refuses to start and names the differing fields (results of two configs never mix). The chunk
size is a schedule, not part of the config: training is deterministic in the step index (data
order and rollout keys depend on (seed, step) only), so any chunking gives the same run.

A unit whose loss, gradient norm or KL turns non-finite stops there and is recorded as
"diverged at step k"; the report lists it, it is not dropped. (A reward function that returns a
non-finite value is an error of the reward, `train.grpo.RewardError`, not a divergence.)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import pathlib
import time
from typing import Callable, Sequence

import numpy as np

from experiments.rl_folder import (Arm, StudyConfig, StudyConfigError, claim_folder, read_status, truncate_jsonl,
                                   unit_name, write_status)
from experiments.rl_report import write_report
from preft_jax.progress import set_quiet
from train.grpo import GRPOTrainer
from train.trainer import NonFiniteLossError

log = logging.getLogger("experiments.rl_study")


class Diverged(RuntimeError):
    def __init__(self, step: int, what: str):
        super().__init__(f"diverged at step {step} ({what} is not finite)")
        self.step, self.what = step, what


_FINITE_KEYS = ("kl",)    # the trainer stops at a non-finite loss or gradient norm itself (NonFiniteLossError,
                          # before the callbacks) and GRPO refuses a non-finite reward (RewardError)


def nan_guard(row: dict, state) -> None:
    """Trainer callback: stop a unit at the first step whose KL is not finite (with kl_coef 0 it is
    not in the loss, so the trainer's own check does not see it)."""
    for k in _FINITE_KEYS:
        if k in row and not math.isfinite(row[k]):
            raise Diverged(row["step"], k)


# ------------------------------------------------------------------------------------ the data
@dataclasses.dataclass
class StudyData:
    """Prompts and the verifier. reward_fn(completion_ids, answer) -> float scores rollouts and the
    held-out greedy completions alike."""
    prompts: list[list[int]]
    answers: list
    eval_prompts: list[list[int]]
    eval_answers: list
    reward_fn: Callable[[Sequence[int], object], float]
    stop_token_ids: tuple[int, ...]
    pad_id: int = 0


def arithmetic_data(sc: StudyConfig, tok) -> StudyData:
    """Generated arithmetic (train.tasks), chat-templated; the eval split uses another seed."""
    from train.data import encode_prompt
    from train.grpo import text_reward_fn
    from train.tasks import generate_examples
    tr = generate_examples(sc.n_train, sc.data_seed, tasks=("arithmetic",), max_ops=sc.max_ops)
    seen = {e.question for e in tr}
    ev = [e for e in generate_examples(4 * sc.n_eval, sc.data_seed + 1000, tasks=("arithmetic",),
                                       max_ops=sc.max_ops) if e.question not in seen][:sc.n_eval]
    if len(ev) < sc.n_eval:
        raise ValueError(f"only {len(ev)} held-out questions differ from the train set; lower n_eval")
    return StudyData([encode_prompt(tok, e.question) for e in tr], [e.answer for e in tr],
                     [encode_prompt(tok, e.question) for e in ev], [e.answer for e in ev],
                     text_reward_fn(tok), tuple(tok.eos_token_ids), tok.pad_token_id)


def greedy_eval(runner, bank, data: StudyData, max_new_tokens: int) -> dict:
    """Held-out greedy accuracy and mean completion length (bank None: the base model)."""
    from preft_jax.sampling import SamplingParams
    ids = None if bank is None else [1] * len(data.eval_prompts)
    gens = runner.generate(data.eval_prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                                                             stop_token_ids=data.stop_token_ids), bank, ids)
    rewards = [data.reward_fn(g.tokens, a) for g, a in zip(gens, data.eval_answers)]
    return {"greedy_acc": float(np.mean(rewards)), "greedy_len": float(np.mean([len(g.tokens) for g in gens])),
            "greedy_finite": bool(np.all(np.isfinite(rewards)))}


# ------------------------------------------------------------------------------------- the run
class _Units:
    """One trainer per unit, all sharing one placed copy of the base model (compiled once each)."""

    def __init__(self, model_cfg, runner, sc: StudyConfig, data: StudyData):
        self.model_cfg, self.sc, self.data = model_cfg, sc, data
        self.runner, self.mesh, self._trainers = runner, None, {}

    def trainer(self, arm: Arm, seed: int) -> GRPOTrainer:
        key = unit_name(arm, seed)
        if key not in self._trainers:
            tr = GRPOTrainer(self.model_cfg, self.runner, self.sc.unit_config(arm, seed), self.data.reward_fn,
                             self.data.stop_token_ids, self.data.pad_id, mesh=self.mesh)
            if self.mesh is None:                     # later trainers reuse the placed base state
                self.mesh, self.runner = tr.mesh, tr.runner
            tr.bind_data(self.data.prompts, self.data.answers)
            self._trainers[key] = tr
        return self._trainers[key]


def _eval_unit(tr: GRPOTrainer, state, data: StudyData, sc: StudyConfig) -> dict:
    from preft_jax.adapters.trainable import adapter_bank
    bank = adapter_bank(tr.model_cfg, tr.adapter_config, state.params)
    return greedy_eval(tr.runner, bank, data, sc.grpo.max_new_tokens)


def run_study(out: str | pathlib.Path, sc: StudyConfig, model_cfg, runner, data: StudyData, chunk: int = 25,
              stop_after: float | None = None) -> dict:
    """Trains every unit to `sc.steps` in round-robin passes of `chunk` steps; resumable.
    `stop_after` (seconds): no new chunk starts after this much wall time. Returns {unit: status}."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    out = pathlib.Path(out)
    claim_folder(out, sc)
    t_start = time.time()
    base_path = out / "base_eval.json"
    if not base_path.is_file():
        t0 = time.time()
        base = greedy_eval(runner, None, data, sc.grpo.max_new_tokens)
        base["seconds"] = time.time() - t0
        base_path.write_text(json.dumps(base))
        log.info("base model: held-out greedy accuracy %.3f, mean length %.1f", base["greedy_acc"], base["greedy_len"])
    units = _Units(model_cfg, runner, sc, data)
    for target in list(range(chunk, sc.steps, chunk)) + [sc.steps]:
        for arm, seed in sc.units():
            if stop_after is not None and time.time() - t_start > stop_after:
                log.info("stop_after reached; rerun the same command to continue")
                return _statuses(out, sc)
            _advance(out, units, arm, seed, target, sc, data)
    return _statuses(out, sc)


def _statuses(out: pathlib.Path, sc: StudyConfig) -> dict:
    return {unit_name(a, s): read_status(out / "units" / unit_name(a, s)) for a, s in sc.units()}


def _advance(out: pathlib.Path, units: _Units, arm: Arm, seed: int, target: int, sc: StudyConfig,
             data: StudyData) -> None:
    folder = out / "units" / unit_name(arm, seed)
    folder.mkdir(parents=True, exist_ok=True)
    status = read_status(folder)
    if status["state"] in ("done", "diverged") or status["steps_done"] >= target:
        return
    tr = units.trainer(arm, seed)
    t0 = time.time()
    evals = folder / "evals.jsonl"
    truncate_jsonl(evals, status["steps_done"])          # evals of steps a crashed pass did not checkpoint
    try:
        state, hist = tr.fit(data.prompts, data.answers, checkpoint_dir=folder / "ckpt",
                             metrics_path=folder / "metrics.jsonl", until=target, callbacks=(nan_guard,))
    except (Diverged, NonFiniteLossError) as e:        # the trainer stops at a NaN loss before saving it
        status.update(state="diverged", diverged_at=e.step, diverged_metric=e.what, steps_done=e.step,
                      seconds=status["seconds"] + time.time() - t0)
        write_status(folder, status)
        log.warning("%s: %s", folder.name, e)
        return
    done = int(state.step) // tr.inner_steps
    if done % sc.eval_every == 0 or done == sc.steps:
        t1 = time.time()
        ev = {"step": done, **_eval_unit(tr, state, data, sc)}
        ev["seconds"] = time.time() - t1
        with open(evals, "a") as f:
            f.write(json.dumps(ev) + "\n")
    status.update(state="done" if done >= sc.steps else "running", steps_done=done,
                  seconds=status["seconds"] + time.time() - t0)
    write_status(folder, status)
    r = [h["reward_mean"] for h in hist]
    log.info("%s: step %d/%d, reward over this pass %.3f (%.0f s)", folder.name, done, sc.steps,
             float(np.mean(r)) if r else float("nan"), time.time() - t0)


def study_config_from_args(a) -> StudyConfig:
    d = StudyConfig()
    return dataclasses.replace(d, steps=a.steps if a.steps else d.steps,
                               seeds=tuple(range(a.seeds)) if a.seeds else d.seeds)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/rl_study", help="the study folder (created, or resumed)")
    p.add_argument("--report", action="store_true", help="only render the report of --out")
    p.add_argument("--doc-dir", default=None, help="with --report: folder for results.md + PNGs "
                   "(default <out>/report)")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per unit (default 150)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per arm (default 2)")
    p.add_argument("--chunk", type=int, default=25, help="steps per unit per round-robin pass")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    set_quiet(a.quiet)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = pathlib.Path(a.out)
    if a.report:
        write_report(out, pathlib.Path(a.doc_dir) if a.doc_dir else out / "report")
        return
    sc = study_config_from_args(a)
    try:
        claim_folder(out, sc)       # refuse a changed config before loading anything
    except StudyConfigError as e:
        raise SystemExit(f"error: {e}") from None
    from preft_jax.cache.compilation import enable_compilation_cache
    from preft_jax.generation import ModelRunner
    from preft_jax.loading import load_model
    from preft_jax.model import Llama
    enable_compilation_cache()
    cfg, params, tok = load_model()
    runner = ModelRunner(Llama.from_params(cfg, params))
    statuses = run_study(out, sc, cfg, runner, arithmetic_data(sc, tok), chunk=a.chunk)
    for k, s in statuses.items():
        log.info("%s: %s", k, s)
    write_report(out, out / "report")


if __name__ == "__main__":
    main()
