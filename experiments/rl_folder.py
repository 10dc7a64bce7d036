"""The RL parity study's config and its output folder: what `experiments.rl_study` writes and
`experiments.rl_report` reads (both import this module; neither imports the other's internals).

    <out>/study.json                  the study config, its hash, the host
    <out>/base_eval.json              the base model's held-out greedy accuracy
    <out>/units/<arm>-s<seed>/        one (arm, seed) unit: ckpt/, metrics.jsonl, evals.jsonl, status.json

Rerunning in a folder with a config that differs refuses to start and names the differing fields.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import platform
import time

import jax

from train.config import AdapterSpec, CheckpointConfig, JsonConfig, OptimizerConfig
from train.grpo import GRPOConfig

class StudyConfigError(ValueError):
    """An output folder holds a study with another config."""


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
def read_jsonl(path: pathlib.Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def truncate_jsonl(path: pathlib.Path, position: int) -> None:
    rows = read_jsonl(path)
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
