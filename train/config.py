"""Frozen, validated configuration shared by the SFT and GRPO trainers (and `experiments.prefill_vs_all`).

    TrainerConfig                      the loop: steps, seed, logging/eval cadence, logit chunking
    +- adapter:    AdapterSpec         lora | reft, rank, mode (prefill | all | activated), alpha, targets,
                                       layers, invocation (activated: the invocation token ids)
    +- optimizer:  OptimizerConfig     AdamW, warmup + cosine decay, global-norm clipping
    +- mesh:       MeshConfig          (data, fsdp, tensor) device mesh
    +- checkpoint: CheckpointConfig    Orbax cadence and retention
    SFTConfig(TrainerConfig)           + batch_size, eval_batch_size, seq_len
    GRPOConfig(TrainerConfig)          + prompts_per_step, group_size, sampling, clip/KL (train.grpo)

`ModelOptions` (dtype of the frozen base, adapter backend) and `train.distributed.DistributedConfig`
describe how a run is launched, not what it trains; they are not part of a checkpoint's identity.
Every config round-trips through JSON (`to_json` / `from_json`), nested groups included.
"""
from __future__ import annotations

import dataclasses
import json
import math
import types
import typing

from preft_jax.adapters.config import LORA_TARGETS, REFT_KINDS, LoraConfig, ReftConfig
from preft_jax.adapters.policy import MODES, PositionPolicy
from preft_jax.chunk_attention import CHOICES as CHUNK_ATTENTION
from preft_jax.config import QUANT_MODES, ModelConfig, remat_policy

ADAPTERS = ("lora", "reft")
DTYPES = ("float32", "bfloat16")
BACKENDS = ("auto", "jnp", "xla", "pallas")


# ------------------------------------------------------------------------------------ JSON helpers
class JsonConfig:
    """Mixin: `to_json()` -> plain dict (nested dataclasses as dicts, tuples as lists); `from_json(d)`."""

    def to_json(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_json(cls, d: dict):
        hints = typing.get_type_hints(cls)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**{k: _from_json(hints[k], v) for k, v in d.items()})


def _from_json(tp, v):
    if v is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _from_json(args[0], v) if len(args) == 1 else v
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp.from_json(v) if issubclass(tp, JsonConfig) else tp(**v)
    if origin is tuple or tp is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_json(args[0], x) for x in v)
        if args:
            return tuple(_from_json(a, x) for a, x in zip(args, v))
        return tuple(v)
    return v


def check_finite(owner: str, value, name: str, low: float, low_ok: bool) -> None:
    """ValueError unless `value` is a finite number > low (>= low with low_ok): NaN and inf pass
    comparisons such as `not x > 0` or `x < 0`, and train an adapter of NaN."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not (value >= low if low_ok else value > low):
        raise ValueError(f"{owner}.{name} must be a finite number {'>=' if low_ok else '>'} {low:g}, got {value!r}")


def _positive(owner: str, **values):
    for k, v in values.items():
        if v is not None and v < 1:
            raise ValueError(f"{owner}.{k} must be >= 1, got {v}")


# ------------------------------------------------------------------------------------------ groups
@dataclasses.dataclass(frozen=True)
class AdapterSpec(JsonConfig):
    """What to train. `build(model_cfg)` gives the preft_jax LoraConfig / ReftConfig."""
    kind: str = "lora"                    # "lora" | "reft"
    rank: int = 8
    mode: str = "prefill"                 # "prefill" (PreFT) | "all" (all-token baseline) | "activated" (aLoRA)
    alpha: float | None = None            # LoRA alpha (default 2 * rank)
    targets: tuple[str, ...] = LORA_TARGETS
    layers: tuple[int, ...] | None = None   # None: every layer
    reft_kind: str = "loreft"             # "loreft" | "direft"
    invocation: tuple[int, ...] | None = None   # mode "activated": the invocation sequence (token ids)

    def __post_init__(self):
        if self.kind not in ADAPTERS:
            raise ValueError(f"adapter kind must be one of {ADAPTERS}, got {self.kind!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        _positive("AdapterSpec", rank=self.rank)
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad or not self.targets:
            raise ValueError(f"LoRA targets must be a non-empty subset of {LORA_TARGETS}, got {self.targets}")
        if self.reft_kind not in REFT_KINDS:
            raise ValueError(f"reft_kind must be one of {REFT_KINDS}, got {self.reft_kind!r}")
        if self.alpha is not None:
            if self.kind != "lora":
                raise ValueError(f"alpha is a LoRA setting; a {self.kind} adapter has none (got alpha={self.alpha})")
            check_finite("AdapterSpec", self.alpha, "alpha", 0, False)
        if self.kind != "lora" and tuple(self.targets) != LORA_TARGETS:
            raise ValueError(f"targets choose LoRA's projections; a {self.kind} adapter acts on the residual stream "
                             f"of its layers (choose them with layers), got targets={tuple(self.targets)}")
        if self.layers is not None and (not self.layers or min(self.layers) < 0):
            raise ValueError(f"layers must be None (all) or non-empty non-negative indices, got {self.layers}")
        if self.mode == "activated" and not self.invocation:
            raise ValueError("mode 'activated' needs an invocation sequence (--invocation TEXT or ids)")
        if self.mode != "activated" and self.invocation is not None:
            raise ValueError(f"an invocation sequence belongs to mode 'activated', not {self.mode!r}")
        self.policy()                     # validates the invocation ids

    def policy(self) -> PositionPolicy:
        return PositionPolicy(mode=self.mode, invocation_tokens=self.invocation)

    def build(self, model_cfg: ModelConfig) -> LoraConfig | ReftConfig:
        policy = self.policy()
        if policy.invocation_tokens and max(policy.invocation_tokens) >= model_cfg.vocab_size:
            raise ValueError(f"invocation token {max(policy.invocation_tokens)} is outside the model's vocabulary "
                             f"(0..{model_cfg.vocab_size - 1})")
        if self.layers is not None and max(self.layers) >= model_cfg.n_layers:
            raise ValueError(f"adapter layer {max(self.layers)} out of range for a model with "
                             f"{model_cfg.n_layers} layers")
        if self.kind == "lora":
            return LoraConfig(rank=self.rank, alpha=float(2 * self.rank if self.alpha is None else self.alpha),
                              targets=tuple(self.targets), layers=self.layers, policy=policy)
        layers = tuple(range(model_cfg.n_layers)) if self.layers is None else tuple(self.layers)
        return ReftConfig(rank=self.rank, layers=layers, kind=self.reft_kind, policy=policy)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(JsonConfig):
    """clip_by_global_norm(grad_clip) -> AdamW with linear warmup + cosine decay to lr * end_lr_ratio."""
    lr: float = 1e-3
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0         # None / 0: no clipping
    end_lr_ratio: float = 0.1

    def __post_init__(self):
        check_finite("OptimizerConfig", self.lr, "lr", 0, False)
        check_finite("OptimizerConfig", self.weight_decay, "weight_decay", 0, True)
        if self.grad_clip is not None:
            check_finite("OptimizerConfig", self.grad_clip, "grad_clip", 0, True)
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.end_lr_ratio <= 1:
            raise ValueError(f"end_lr_ratio must be in [0, 1], got {self.end_lr_ratio}")

    def build(self, total_steps: int):
        """(optax transform, schedule) for `total_steps` optimizer steps. Its state is float32."""
        import optax
        warmup = max(0, min(self.warmup_steps, total_steps - 1))
        schedule = optax.warmup_cosine_decay_schedule(
            init_value=0.0 if warmup else self.lr, peak_value=self.lr, warmup_steps=warmup,
            decay_steps=max(total_steps, warmup + 1), end_value=self.lr * self.end_lr_ratio)
        parts = [] if not self.grad_clip else [optax.clip_by_global_norm(self.grad_clip)]
        parts.append(optax.adamw(schedule, weight_decay=self.weight_decay))
        return optax.chain(*parts), schedule


@dataclasses.dataclass(frozen=True)
class MeshConfig(JsonConfig):
    """Device mesh ("data", "fsdp", "tensor"); see preft_jax.sharding and train.distributed.build_mesh."""
    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        _positive("MeshConfig", data=self.data, fsdp=self.fsdp, tensor=self.tensor)

    @property
    def size(self) -> int:
        return self.data * self.fsdp * self.tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data, self.fsdp, self.tensor)

    @classmethod
    def parse(cls, text: str) -> "MeshConfig":
        """"data,fsdp,tensor", e.g. "2,1,4"."""
        try:
            parts = [int(x) for x in str(text).split(",")]
        except ValueError:
            parts = []
        if len(parts) != 3:
            raise ValueError(f"mesh must be 'data,fsdp,tensor' (three integers), got {text!r}")
        return cls(*parts)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(JsonConfig):
    """Orbax checkpoints every `every` steps (0: only at the end of a run) keeping the newest `max_to_keep`."""
    every: int = 0
    max_to_keep: int | None = 3

    def __post_init__(self):
        if self.every < 0:
            raise ValueError(f"checkpoint every must be >= 0, got {self.every}")
        _positive("CheckpointConfig", max_to_keep=self.max_to_keep)


@dataclasses.dataclass(frozen=True)
class ModelOptions(JsonConfig):
    """How the frozen base model is built: its dtype, its weight quantization (QLoRA) and the adapter
    backend (validated by the model).

    The trainable adapter and the optimizer state stay float32 whatever the base dtype."""
    path: str | None = None               # GGUF file or HF folder (None: the embedded SmolLM2-135M)
    dtype: str = "float32"
    backend: str = "jnp"
    quantize: str | None = None           # "int8" | "int4": the base weights (preft_jax.quantize)
    # the training forward's causal attention (preft_jax.chunk_attention: auto | xla | flash | flash:gpu |
    # flash:tpu; None: $PREFT_JAX_CHUNK_ATTENTION, else auto), validated by the model
    attention: str | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantize is not None and self.quantize not in QUANT_MODES:
            raise ValueError(f"quantize must be one of {QUANT_MODES} or None, got {self.quantize!r}")
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"backend must be a name (one of {BACKENDS}), got {self.backend!r}")
        if self.attention is not None and self.attention not in CHUNK_ATTENTION:
            raise ValueError(f"attention must be one of {CHUNK_ATTENTION} or None, got {self.attention!r}")

    @property
    def jnp_dtype(self):
        import jax.numpy as jnp
        return jnp.dtype(self.dtype)


# ------------------------------------------------------------------------------------- the loop
@dataclasses.dataclass(frozen=True)
class TrainerConfig(JsonConfig):
    """Everything the shared `train.trainer.Trainer` loop reads. `steps` counts batches (an SFT step,
    a GRPO rollout batch of `inner_steps` optimizer steps)."""
    adapter: AdapterSpec = AdapterSpec()
    optimizer: OptimizerConfig = OptimizerConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    steps: int = 100
    seed: int = 0
    log_every: int = 1                    # 0: no per-step log lines
    eval_every: int = 0                   # 0: evaluate only at the end (when there is an eval set)
    logit_chunk: int | None = 64          # sequence positions per vocab-projection chunk
    pad_multiple: int = 16
    # recompute each layer in the backward pass: True (= "full": activations O(1 layer)), False, or a
    # policy keeping some projections' outputs ("save_qkvo", "save_projections": preft_jax.config.REMAT_POLICIES)
    remat: bool | str = True

    def __post_init__(self):
        for name, tp in (("adapter", AdapterSpec), ("optimizer", OptimizerConfig), ("mesh", MeshConfig),
                         ("checkpoint", CheckpointConfig)):
            if not isinstance(getattr(self, name), tp):
                raise TypeError(f"{type(self).__name__}.{name} must be a {tp.__name__}, "
                                f"got {type(getattr(self, name)).__name__}")
        _positive(type(self).__name__, steps=self.steps, logit_chunk=self.logit_chunk,
                  pad_multiple=self.pad_multiple)
        if self.log_every < 0 or self.eval_every < 0:
            raise ValueError("log_every and eval_every must be >= 0")
        try:
            remat_policy(self.remat)
        except ValueError as e:
            raise ValueError(f"{type(self).__name__}.{e}") from None
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 31:
            raise ValueError(f"{type(self).__name__}.seed must be an integer in [0, 2**31), got {self.seed!r}")

    def adapter_config(self, model_cfg: ModelConfig):
        return self.adapter.build(model_cfg)
