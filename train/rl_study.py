"""The RL parity study (issue 14): GRPO of several adapter arms x seeds on one verifiable task.

    python -m train.experiment --rl-study --out runs/rl_study [--steps 150 --seeds 2 --chunk 25]
    python -m train.experiment --rl-study --out runs/rl_study --report --doc-dir docs/rl_study

Every (arm, seed) is a resumable unit in `<out>/units/<arm>-s<seed>/`: an Orbax checkpoint (the
shared `Trainer` loop resumes from it, refusing another model or adapter), `metrics.jsonl` (one row
per GRPO step: reward, KL to base, response length, loss, timings), `evals.jsonl` (held-out greedy
accuracy every `eval_every` steps and at the end) and `status.json`. Units advance round-robin,
`chunk` steps at a time, so a run cut off at any point leaves every arm with comparable progress.

`<out>/study.json` holds the study config and its hash; rerunning with a config that differs
refuses to start and names the differing fields (results of two configs never mix). The chunk
size is a schedule, not part of the config: training is deterministic in the step index (data
order and rollout keys depend on (seed, step) only), so any chunking gives the same run.

A unit whose loss, gradient norm, KL or reward turns non-finite stops there and is recorded as
"diverged at step k"; the report lists it, it is not dropped.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import pathlib
import platform
import time
from typing import Callable, Sequence

import jax
import numpy as np

from train.config import AdapterSpec, CheckpointConfig, JsonConfig, OptimizerConfig
from train.grpo import GRPOConfig, GRPOTrainer

log = logging.getLogger("train.rl_study")


class StudyConfigError(ValueError):
    """An output folder holds a study with another config."""


class Diverged(RuntimeError):
    def __init__(self, step: int, what: str):
        super().__init__(f"diverged at step {step} ({what} is not finite)")
        self.step, self.what = step, what


@dataclasses.dataclass(frozen=True)
class Arm(JsonConfig):
    name: str
    kind: str = "lora"               # lora | reft
    rank: int = 8
    mode: str = "prefill"            # prefill | all
    lr: float = 1e-3
    reft_kind: str = "direft"

    def __post_init__(self):
        if not self.name or any(c in self.name for c in "/\\ "):
            raise ValueError(f"arm name must be a non-empty word usable as a folder name, got {self.name!r}")
        AdapterSpec(kind=self.kind, rank=self.rank, mode=self.mode, reft_kind=self.reft_kind)   # validates
        OptimizerConfig(lr=self.lr)

    def adapter(self) -> AdapterSpec:
        return AdapterSpec(kind=self.kind, rank=self.rank, mode=self.mode, reft_kind=self.reft_kind)


ARMS = (Arm("all-lora-r8", mode="all"),
        Arm("prefill-lora-r8"),
        Arm("prefill-lora-r32", rank=32),
        Arm("prefill-lora-r8-lr3e-3", lr=3e-3),
        Arm("prefill-direft-r8", kind="reft", lr=2e-3))


@dataclasses.dataclass(frozen=True)
class StudyConfig(JsonConfig):
    """What the study trains and measures (everything that changes results; see module doc)."""
    arms: tuple[Arm, ...] = ARMS
    seeds: tuple[int, ...] = (0, 1)
    steps: int = 150
    eval_every: int = 50
    n_train: int = 256
    n_eval: int = 96
    max_ops: int = 1                  # arithmetic with 1..max_ops operations
    data_seed: int = 1
    grpo: GRPOConfig = GRPOConfig(prompts_per_step=2, group_size=4, max_new_tokens=20, temperature=0.7,
                                  kl_coef=0.04, clip_eps=0.2, log_every=25,
                                  optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0))

    def __post_init__(self):
        if not self.arms or not self.seeds:
            raise ValueError("a study needs at least one arm and one seed")
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names):
            raise ValueError(f"arm names must be unique, got {names}")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be unique, got {self.seeds}")
        for k in ("steps", "eval_every", "n_train", "n_eval", "max_ops"):
            if getattr(self, k) < 1:
                raise ValueError(f"StudyConfig.{k} must be >= 1, got {getattr(self, k)}")

    def unit_config(self, arm: Arm, seed: int) -> GRPOConfig:
        return dataclasses.replace(self.grpo, adapter=arm.adapter(), steps=self.steps, seed=seed,
                                   optimizer=dataclasses.replace(self.grpo.optimizer, lr=arm.lr),
                                   checkpoint=CheckpointConfig(every=0, max_to_keep=1))

    def units(self) -> list[tuple[Arm, int]]:
        return [(a, s) for a in self.arms for s in self.seeds]

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]


def unit_name(arm: Arm, seed: int) -> str:
    return f"{arm.name}-s{seed}"


def _flat(d, prefix=""):
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
    elif isinstance(d, list) and d and all(isinstance(x, dict) for x in d):
        for i, v in enumerate(d):
            out.update(_flat(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = d
    return out


def config_diff(old: dict, new: dict) -> list[str]:
    """'field: old -> new' for every differing (flattened) field."""
    a, b = _flat(old), _flat(new)
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in sorted(set(a) | set(b))
            if a.get(k, "<absent>") != b.get(k, "<absent>")]


def claim_folder(out: pathlib.Path, sc: StudyConfig) -> None:
    """Writes `<out>/study.json` or checks that the one there has this config."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "study.json"
    if path.is_file():
        old = json.loads(path.read_text())
        if old.get("config_hash") != sc.hash():
            diff = config_diff(old.get("config", {}), sc.to_json())
            raise StudyConfigError(
                f"{out} holds a study with another config (hash {old.get('config_hash')} vs {sc.hash()}); "
                f"differing fields: {'; '.join(diff) or '(none: the stored hash is stale)'}. Results of different "
                f"configs are not mixed: use another --out, or rerun with the stored config's flags.")
        return
    path.write_text(json.dumps({"config": sc.to_json(), "config_hash": sc.hash(), "created": time.time(),
                                "host": {"platform": platform.platform(), "jax": jax.__version__,
                                         "devices": [str(d) for d in jax.devices()]}}, indent=1))


def load_study(out: pathlib.Path) -> tuple[StudyConfig, dict]:
    meta = json.loads((out / "study.json").read_text())
    return StudyConfig.from_json(meta["config"]), meta


# ----------------------------------------------------------------------------------- unit files
def _read_jsonl(path: pathlib.Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _truncate_jsonl(path: pathlib.Path, position: int) -> None:
    rows = _read_jsonl(path)
    keep = [r for r in rows if r["step"] <= position]
    if len(keep) != len(rows):
        path.write_text("".join(json.dumps(r) + "\n" for r in keep))


def read_status(folder: pathlib.Path) -> dict:
    p = folder / "status.json"
    return json.loads(p.read_text()) if p.is_file() else {"state": "pending", "steps_done": 0, "seconds": 0.0}


def write_status(folder: pathlib.Path, status: dict) -> None:
    tmp = folder / "status.json.tmp"
    tmp.write_text(json.dumps(status, indent=1))
    tmp.replace(folder / "status.json")


_FINITE_KEYS = ("loss", "grad_norm", "kl", "reward_mean")


def nan_guard(row: dict, state) -> None:
    """Trainer callback: stop a unit at the first step with a non-finite metric."""
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
    _truncate_jsonl(evals, status["steps_done"])          # evals of steps a crashed pass did not checkpoint
    try:
        state, hist = tr.fit(data.prompts, data.answers, checkpoint_dir=folder / "ckpt",
                             metrics_path=folder / "metrics.jsonl", until=target, callbacks=(nan_guard,))
    except Diverged as e:
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


def main_study(a) -> None:
    """`python -m train.experiment --rl-study ...` (see train.experiment)."""
    from train.rl_report import write_report
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
