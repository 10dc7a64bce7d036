"""Checkpoint tensor names -> canonical parameter names (regex tables, Tunix style) and assembly.

Canonical parameters (numpy arrays, stacked over layers, "x @ W" orientation):

    embed       [V, d]
    lm_head     [d, V]                    only when embeddings are untied
    final_norm  [d]
    attn_norm   [L, d]
    wq          [L, d, n_heads*head_dim]
    wk, wv      [L, d, n_kv_heads*head_dim]
    wo          [L, n_heads*head_dim, d]
    bq          [L, n_heads*head_dim]     only with qkv_bias (Qwen2)
    bk, bv      [L, n_kv_heads*head_dim]  only with qkv_bias
    mlp_norm    [L, d]
    w_gate      [L, d, ffn]
    w_up        [L, d, ffn]
    w_down      [L, ffn, d]

q/k use the HF transformers layout (rotate_half RoPE: within a head, the first head_dim/2 output
features pair with the second half). llama.cpp's converter permutes q/k rows for interleaved RoPE;
the GGUF table undoes that permutation.

Both checkpoint formats store 2-D weights as [out, in] (GGUF tensors, once read by `gguf` as numpy,
have the same row-major shape as the HF tensors), so linear weights are transposed.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable

import numpy as np

from preft_jax.config import ModelConfig

LAYERED = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down", "bq", "bk", "bv")
QKV_BIASES = ("bq", "bk", "bv")
GLOBAL = ("embed", "final_norm", "lm_head")
CANONICAL_NAMES = GLOBAL + LAYERED


class WeightNameError(ValueError):
    """A checkpoint tensor that matches no rule (and is not known to be ignorable)."""


class MissingWeightError(ValueError):
    """A canonical parameter (or one layer of it) that the checkpoint does not provide."""


# ----------------------------------------------------------------------------------------- transforms
def permute_for_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF [out, in] q/k weight -> llama.cpp's interleaved-RoPE row order (what convert_hf_to_gguf does)."""
    out = w.shape[0]
    hd = out // n_head
    return w.reshape(n_head, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_from_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_for_llama_cpp`: GGUF [out, in] q/k weight -> HF (rotate_half) row order."""
    out = w.shape[0]
    hd = out // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _identity(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return w


def _transpose(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return w.T


def _unpermute_q_t(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return unpermute_from_llama_cpp(w, cfg.n_heads).T


def _unpermute_k_t(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return unpermute_from_llama_cpp(w, cfg.n_kv_heads).T


TRANSFORMS: dict[str, Callable[[np.ndarray, ModelConfig], np.ndarray]] = {
    "identity": _identity,
    "transpose": _transpose,
    "unpermute_q_transpose": _unpermute_q_t,
    "unpermute_k_transpose": _unpermute_k_t,
}


@dataclasses.dataclass(frozen=True)
class WeightRule:
    pattern: re.Pattern
    canonical: str
    transform: str      # key of TRANSFORMS
    template: str       # human-readable source name, "{i}" for the layer


def _rules(table: Iterable[tuple[str, str, str, str]]) -> tuple[WeightRule, ...]:
    return tuple(WeightRule(re.compile(p), c, t, s) for p, c, t, s in table)


# (regex, canonical, transform, source-name template). Layer index is regex group 1.
GGUF_RULES = _rules([
    (r"token_embd\.weight", "embed", "identity", "token_embd.weight"),
    (r"output_norm\.weight", "final_norm", "identity", "output_norm.weight"),
    (r"output\.weight", "lm_head", "transpose", "output.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", "attn_norm", "identity", "blk.{i}.attn_norm.weight"),
    (r"blk\.(\d+)\.attn_q\.weight", "wq", "unpermute_q_transpose", "blk.{i}.attn_q.weight"),
    (r"blk\.(\d+)\.attn_k\.weight", "wk", "unpermute_k_transpose", "blk.{i}.attn_k.weight"),
    (r"blk\.(\d+)\.attn_v\.weight", "wv", "transpose", "blk.{i}.attn_v.weight"),
    (r"blk\.(\d+)\.attn_output\.weight", "wo", "transpose", "blk.{i}.attn_output.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", "mlp_norm", "identity", "blk.{i}.ffn_norm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", "w_gate", "transpose", "blk.{i}.ffn_gate.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", "w_up", "transpose", "blk.{i}.ffn_up.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", "w_down", "transpose", "blk.{i}.ffn_down.weight"),
])
# Tensors that carry nothing the model needs. (`rope_freqs.weight`, llama3 rope scaling, is NOT
# ignorable: the GGUF loader rejects it explicitly.)
GGUF_IGNORED = tuple(re.compile(p) for p in (
    r"blk\.\d+\.attn_rot_embd",          # old llama.cpp files: precomputed rotary tables
))

HF_RULES = _rules([
    (r"model\.embed_tokens\.weight", "embed", "identity", "model.embed_tokens.weight"),
    (r"model\.norm\.weight", "final_norm", "identity", "model.norm.weight"),
    (r"lm_head\.weight", "lm_head", "transpose", "lm_head.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "attn_norm", "identity",
     "model.layers.{i}.input_layernorm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", "wq", "transpose",
     "model.layers.{i}.self_attn.q_proj.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight", "wk", "transpose",
     "model.layers.{i}.self_attn.k_proj.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight", "wv", "transpose",
     "model.layers.{i}.self_attn.v_proj.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.bias", "bq", "identity", "model.layers.{i}.self_attn.q_proj.bias"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.bias", "bk", "identity", "model.layers.{i}.self_attn.k_proj.bias"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.bias", "bv", "identity", "model.layers.{i}.self_attn.v_proj.bias"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", "wo", "transpose",
     "model.layers.{i}.self_attn.o_proj.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "mlp_norm", "identity",
     "model.layers.{i}.post_attention_layernorm.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", "w_gate", "transpose",
     "model.layers.{i}.mlp.gate_proj.weight"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", "w_up", "transpose",
     "model.layers.{i}.mlp.up_proj.weight"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "w_down", "transpose",
     "model.layers.{i}.mlp.down_proj.weight"),
])
HF_IGNORED = tuple(re.compile(p) for p in (
    r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",
    r"model\.rotary_emb\.inv_freq",
))


def match_weight(name: str, rules: tuple[WeightRule, ...],
                 ignored: tuple[re.Pattern, ...] = ()) -> tuple[WeightRule, int | None] | None:
    """(rule, layer index or None) for a source tensor name; None if ignorable; WeightNameError otherwise."""
    for rule in rules:
        m = rule.pattern.fullmatch(name)
        if m:
            return rule, (int(m.group(1)) if m.groups() else None)
    if any(p.fullmatch(name) for p in ignored):
        return None
    raise WeightNameError(
        f"Unexpected tensor {name!r} in checkpoint: it matches no known Llama weight name "
        f"(is this a Llama-family model without biases / extra modules?)")


def canonical_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of every canonical parameter this config has (lm_head only when untied)."""
    d, L, V, f = cfg.d_model, cfg.n_layers, cfg.vocab_size, cfg.ffn_dim
    shapes = {
        "embed": (V, d),
        "final_norm": (d,),
        "attn_norm": (L, d),
        "wq": (L, d, cfg.q_dim),
        "wk": (L, d, cfg.kv_dim),
        "wv": (L, d, cfg.kv_dim),
        "wo": (L, cfg.q_dim, d),
        "mlp_norm": (L, d),
        "w_gate": (L, d, f),
        "w_up": (L, d, f),
        "w_down": (L, f, d),
    }
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (d, V)
    if cfg.qkv_bias:
        shapes.update(bq=(L, cfg.q_dim), bk=(L, cfg.kv_dim), bv=(L, cfg.kv_dim))
    return shapes


def transformed_shape(transform: str, shape) -> tuple[int, ...]:
    """The shape a TRANSFORMS entry gives a source tensor of `shape` (no data read)."""
    shape = tuple(shape)
    return shape[::-1] if transform.endswith("transpose") else shape


class ParamAssembler:
    """Collects source tensors into preallocated, stacked canonical arrays and checks completeness.

    `allocate=False`: no arrays; `locate` alone checks a checkpoint's names and shapes and records
    which tensor fills what (the streaming loader reads the data itself, slice by slice)."""

    def __init__(self, cfg: ModelConfig, rules: tuple[WeightRule, ...],
                 ignored: tuple[re.Pattern, ...] = (), dtype=np.float32, source: str = "checkpoint",
                 allocate: bool = True):
        self.cfg = cfg
        self.rules = rules
        self.ignored = ignored
        self.dtype = np.dtype(dtype)
        self.source = source
        self.shapes = canonical_shapes(cfg)
        self.params = {k: np.empty(s, dtype=self.dtype) for k, s in self.shapes.items()} if allocate else {}
        self._filled: dict[str, set] = {k: set() for k in self.shapes}
        self._templates = {r.canonical: r.template for r in rules}

    def wants(self, name: str) -> bool:
        """Whether `name` maps to a parameter of this config (raises WeightNameError for unknown names).

        A tied model's `lm_head`/`output.weight` (some checkpoints store the duplicate) is skipped.
        """
        hit = match_weight(name, self.rules, self.ignored)
        if hit is not None and hit[0].canonical in QKV_BIASES and not self.cfg.qkv_bias:
            raise WeightNameError(f"{self.source}: checkpoint has bias tensor {name!r}, but this architecture's "
                                  f"config has no q/k/v biases (qkv_bias=False)")
        return hit is not None and hit[0].canonical in self.shapes

    def locate(self, name: str, shape) -> tuple[WeightRule, int | None] | None:
        """(rule, layer index or None) of the canonical slice tensor `name` of `shape` fills, after the
        name, shape and layer checks (errors name the tensor); None for an ignorable tensor. Marks the
        slice filled for `check_complete`."""
        if not self.wants(name):                    # ignorable, or a tied model's stored lm_head copy
            return None
        rule, layer = match_weight(name, self.rules, self.ignored)
        got = transformed_shape(rule.transform, shape)
        full = self.shapes[rule.canonical]
        expected = full[1:] if rule.canonical in LAYERED else full
        if got != tuple(expected):
            raise ValueError(
                f"{self.source}: tensor {name!r} has shape {tuple(shape)}, which gives "
                f"{rule.canonical} slice {got}; expected {tuple(expected)} from the config")
        if rule.canonical in LAYERED:
            if layer is None or not 0 <= layer < self.cfg.n_layers:
                raise ValueError(f"{self.source}: tensor {name!r} has layer index {layer}, "
                                 f"but the config has {self.cfg.n_layers} layers")
        else:
            layer = None
        self._filled[rule.canonical].add(layer)
        return rule, layer

    def add(self, name: str, array: np.ndarray) -> None:
        hit = self.locate(name, np.shape(array))
        if hit is None:
            return
        rule, layer = hit
        value = TRANSFORMS[rule.transform](np.asarray(array), self.cfg)
        if layer is None:
            self.params[rule.canonical][...] = value
        else:
            self.params[rule.canonical][layer] = value

    def check_complete(self) -> None:
        """MissingWeightError naming every canonical slice no located tensor filled."""
        missing = []
        for k in self.shapes:
            tmpl = self._templates.get(k, k)
            if k in LAYERED:
                for i in range(self.cfg.n_layers):
                    if i not in self._filled[k]:
                        missing.append(tmpl.format(i=i))
            elif not self._filled[k]:
                missing.append(tmpl)
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
            raise MissingWeightError(f"{self.source}: missing tensor(s): {shown}")

    def finish(self) -> dict[str, np.ndarray]:
        self.check_complete()
        return self.params
