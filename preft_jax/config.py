"""Model configuration: one frozen dataclass for every Llama-family decoder."""
from __future__ import annotations

import dataclasses

# Rematerialization of the layer body in the backward pass (training; MaxText's remat policies): what
# each layer keeps for the backward beyond its input - the outputs of the projections named here
# (`jax.ad_checkpoint.checkpoint_name`, bias and LoRA delta included) - everything else is recomputed.
# "full": nothing (one layer's activations alive at a time; a second forward of every layer);
# "save_qkvo": q, k, v, o (the MLP, the norms and the attention recomputed); "save_projections": all
# seven (only the norms, RoPE, the attention and the SwiGLU product recomputed).
REMAT_POLICIES = {"full": (), "save_qkvo": ("qkvo",), "save_projections": ("qkvo", "mlp")}
REMAT_WORDS = ("full", "off") + tuple(p for p in REMAT_POLICIES if p != "full")    # the CLIs' --remat


def remat_policy(remat) -> str | None:
    """A trainer's `remat` (True = "full", False / None = off, or a REMAT_POLICIES name) -> the
    policy name, or None for no rematerialization; anything else is an error naming the choices."""
    if remat is None or remat is False:
        return None
    if remat is True:
        return "full"
    if isinstance(remat, str) and remat in REMAT_POLICIES:
        return remat
    raise ValueError(f"remat must be true, false or one of {tuple(REMAT_POLICIES)}, got {remat!r}")


def remat_from_word(word: str) -> bool | str:
    """A command line's --remat word (REMAT_WORDS) -> the trainers' `remat`: "full" -> True, "off" ->
    False, a policy name as it is; another word is an error naming the choices."""
    if word not in REMAT_WORDS:
        raise ValueError(f"choose from {', '.join(REMAT_WORDS)}, got {word!r}")
    return {"full": True, "off": False}.get(word, word)

# Logical axis names of every LoRA-targetable projection's (input, output) dimension, keyed like
# `ModelConfig.projection_dims`. Model weights, adapter banks and trainable adapters declare their
# shardings from this table (see preft_jax.sharding for the logical -> mesh rules).
PROJECTION_AXES: dict[str, tuple[str, str]] = {
    "q": ("embed", "q_heads"), "k": ("embed", "kv_heads"), "v": ("embed", "kv_heads"),
    "o": ("q_heads", "embed"), "gate": ("embed", "mlp"), "up": ("embed", "mlp"), "down": ("mlp", "embed"),
}

# Weight-only quantization of the frozen base (preft_jax.quantize): int8 per output channel, int4 grouped.
QUANT_MODES = ("int8", "int4")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x "llama3" frequency scaling (HF `rope_scaling` with rope_type=llama3)."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    max_seq_len: int = 8192
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qkv_bias: bool = False          # q/k/v projections have biases (Qwen2)

    def to_dict(self) -> dict:
        """JSON-compatible dict (inverse of `from_dict`)."""
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s): {sorted(unknown)}")
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        if "eos_token_ids" in d:
            d["eos_token_ids"] = tuple(int(i) for i in d["eos_token_ids"])
        return cls(**d)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def projection_dims(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of every LoRA-targetable projection, keyed by short name."""
        d, f = self.d_model, self.ffn_dim
        return {
            "q": (d, self.q_dim), "k": (d, self.kv_dim), "v": (d, self.kv_dim),
            "o": (self.q_dim, d), "gate": (d, f), "up": (d, f), "down": (f, d),
        }


def tiny_config(**overrides) -> ModelConfig:
    """A small random-weight config for fast tests (same shape family as SmolLM2)."""
    base = dict(vocab_size=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16,
                ffn_dim=128, rope_theta=10000.0, rms_eps=1e-5, tie_embeddings=True, max_seq_len=128,
                bos_token_id=1, eos_token_ids=(2,))
    base.update(overrides)
    return ModelConfig(**base)


# Published shapes of the models the docs and tools plan for (HF config.json values). One place:
# benchmarks.memory_plan, scripts/cost_model.py and scripts/device_check.py read them from here.
_LLAMA31 = dict(vocab_size=128256, n_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_eps=1e-5,
                tie_embeddings=False, max_seq_len=131072, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
                bos_token_id=128000, eos_token_ids=(128001, 128008, 128009))
MODEL_PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                                ffn_dim=1536, rope_theta=100000.0, rms_eps=1e-5, tie_embeddings=True,
                                max_seq_len=8192, bos_token_id=1, eos_token_ids=(2,)),
    "qwen2.5-0.5b": ModelConfig(vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64,
                                ffn_dim=4864, rope_theta=1000000.0, rms_eps=1e-6, tie_embeddings=True,
                                max_seq_len=32768, bos_token_id=None, eos_token_ids=(151643,), qkv_bias=True),
    "llama-3.1-8b": ModelConfig(d_model=4096, n_layers=32, n_heads=32, ffn_dim=14336, **_LLAMA31),
    "llama-3.1-70b": ModelConfig(d_model=8192, n_layers=80, n_heads=64, ffn_dim=28672, **_LLAMA31),
}


def model_preset(name: str, **overrides) -> ModelConfig:
    """The ModelConfig of a known model by name (`MODEL_PRESETS`), fields replaced by `overrides`."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(MODEL_PRESETS)}")
    return dataclasses.replace(MODEL_PRESETS[name], **overrides)
