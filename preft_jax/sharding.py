"""Logical sharding rules: parameter / adapter / cache / batch names -> PartitionSpecs.

The mesh has three named axes:

* ``data``   - pure data parallelism (batch split, weights replicated),
* ``fsdp``   - batch split *and* weights sharded on their model (``d_model``) dimension,
* ``tensor`` - tensor (Megatron-style) parallelism on heads / ffn / vocab dimensions.

Rules are a table of ``(regex, spec)`` pairs matched (first match wins, ``re.search``) against a
"/"-joined path of names such as ``layers/wq`` (model state), ``A/q`` (trainable LoRA params),
``lora_A/q`` (an AdapterBank) or ``k`` (a KV cache). A spec lists one entry per array dimension:
an axis name, a tuple of axis names, or None. `spec_for` applies a divisibility fallback: a
dimension whose size the (product of the) mesh axes does not divide is replicated, trying a
shorter prefix of an axis tuple first.

Everything here is plain pjit style: build ``NamedSharding`` pytrees with the ``*_shardings``
helpers, place arrays with ``jax.device_put`` (``shard_*``), and pass the same pytrees as
``in_shardings`` / ``out_shardings`` to ``jax.jit``.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")          # the batch dimension is split over both data-parallel axes

Rule = tuple[str, tuple]

# Model state (`nnx.split(Llama)` state; layer weights stacked on a leading [L] axis).
MODEL_RULES: tuple[Rule, ...] = (
    (r"(^|/)embed$", ("tensor", "fsdp")),                       # [V, d]
    (r"(^|/)lm_head$", ("fsdp", "tensor")),                     # [d, V]
    (r"(^|/)final_norm$", (None,)),                             # [d]
    (r"layers/(attn_norm|mlp_norm)$", (None, None)),            # [L, d]
    (r"layers/(wq|wk|wv|w_gate|w_up)$", (None, "fsdp", "tensor")),   # [L, d, out]
    (r"layers/(wo|w_down)$", (None, "tensor", "fsdp")),         # [L, in, d]
)

# Trainable single-adapter params (`preft_jax.adapters.trainable`): LoRA {"A": {t}, "B": {t}},
# ReFT {"R", "W", "b"}. LoRA A follows the input dim of the base weight, B its output dim.
ADAPTER_RULES: tuple[Rule, ...] = (
    (r"(^|/)A/(q|k|v|gate|up)$", (None, "fsdp", None)),         # [L, d, r]
    (r"(^|/)A/(o|down)$", (None, "tensor", None)),              # [L, q_dim | ffn, r]
    (r"(^|/)B/(q|k|v|gate|up)$", (None, None, "tensor")),       # [L, r, out]
    (r"(^|/)B/(o|down)$", (None, None, "fsdp")),                # [L, r, d]
    (r"(^|/)(R|W)$", (None, None, "fsdp")),                     # [L, r, d]
    (r"(^|/)b$", (None, None)),                                 # [L, r]
)

# An AdapterBank (slot axis after the layer axis; small per-slot vectors replicated).
BANK_RULES: tuple[Rule, ...] = (
    (r"(^|/)lora_A/(q|k|v|gate|up)$", (None, None, "fsdp", None)),   # [L, N, d, r]
    (r"(^|/)lora_A/(o|down)$", (None, None, "tensor", None)),
    (r"(^|/)lora_B/(q|k|v|gate|up)$", (None, None, None, "tensor")), # [L, N, r, out]
    (r"(^|/)lora_B/(o|down)$", (None, None, None, "fsdp")),
    (r"(^|/)reft_(R|W)$", (None, None, None, "fsdp")),          # [L, N, r, d]
    (r"(^|/)reft_b$", (None, None, None)),                      # [L, N, r]
    (r"(^|/)(reft_subtract|all_tokens|first_k|last_k)$", (None,)),
)

# KVCache: k, v [L, slots, S, kv_heads, head_dim] - slots split like a batch, heads on tensor.
CACHE_RULES: tuple[Rule, ...] = (
    (r"(^|/)(k|v)$", (None, BATCH, None, "tensor", None)),
)

DEFAULT_RULES: tuple[Rule, ...] = MODEL_RULES + ADAPTER_RULES + BANK_RULES + CACHE_RULES


# ------------------------------------------------------------------------------------------ mesh
def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices: Sequence | None = None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh with Auto axis types over the first data*fsdp*tensor devices."""
    n = data * fsdp * tensor
    devices = list(jax.devices() if devices is None else devices)
    if n < 1 or n > len(devices):
        raise ValueError(f"mesh {data}x{fsdp}x{tensor} needs {n} devices, {len(devices)} available")
    return Mesh(np.asarray(devices[:n]).reshape(data, fsdp, tensor), AXES)


def _axis_size(mesh: Mesh, axis) -> int:
    if axis is None:
        return 1
    names = axis if isinstance(axis, tuple) else (axis,)
    return int(np.prod([mesh.shape[a] for a in names]))


def fit_spec(spec: Sequence, shape: Sequence[int], mesh: Mesh) -> P:
    """`spec` (one entry per dim) with every entry that does not divide its dim replaced.

    A tuple entry falls back to its longest prefix that divides, then to None (replicated).
    Extra spec entries are dropped; missing ones are None. Axis names not in the mesh are dropped.
    """
    out = []
    for i, dim in enumerate(shape):
        axis = spec[i] if i < len(spec) else None
        names = () if axis is None else (axis if isinstance(axis, tuple) else (axis,))
        names = tuple(a for a in names if a in mesh.shape)
        chosen = None
        for k in range(len(names), 0, -1):
            if dim % _axis_size(mesh, names[:k]) == 0:
                chosen = names[:k] if k > 1 else names[0]
                break
        out.append(chosen)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def spec_for(name: str, shape: Sequence[int], mesh: Mesh, rules: Sequence[Rule] = DEFAULT_RULES) -> P:
    """PartitionSpec for the array called `name` ("layers/wq", "A/q", ...); replicated when no rule matches."""
    for pattern, spec in rules:
        if re.search(pattern, name):
            if len(spec) != len(shape):
                raise ValueError(f"sharding rule {pattern!r} has {len(spec)} dims, {name} has shape {tuple(shape)}")
            return fit_spec(spec, shape, mesh)
    return P()


def path_name(path) -> str:
    """A jax key path -> "a/b/c" (nnx Variable `.value` attributes and dataclass fields included)."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            if k.name != "value":
                parts.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        else:
            parts.append(str(k))
    return "/".join(parts)


def tree_shardings(tree: Any, mesh: Mesh, rules: Sequence[Rule] = DEFAULT_RULES) -> Any:
    """A pytree of NamedSharding, one per array leaf of `tree`, from the rules (same structure)."""
    def one(path, x):
        shape = np.shape(x)
        return NamedSharding(mesh, spec_for(path_name(path), shape, mesh, rules))
    return jax.tree_util.tree_map_with_path(one, tree)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# -------------------------------------------------------------------------------- model / adapter
def model_state_shardings(state, mesh: Mesh, rules: Sequence[Rule] = MODEL_RULES):
    return tree_shardings(state, mesh, rules)


def shard_model_state(state, mesh: Mesh, rules: Sequence[Rule] = MODEL_RULES):
    """The split model state with every weight placed as NamedSharding'ed arrays."""
    return jax.device_put(state, model_state_shardings(state, mesh, rules))


def adapter_shardings(params, mesh: Mesh, rules: Sequence[Rule] = ADAPTER_RULES):
    return tree_shardings(params, mesh, rules)


def shard_adapter(params, mesh: Mesh, rules: Sequence[Rule] = ADAPTER_RULES):
    return jax.device_put(params, adapter_shardings(params, mesh, rules))


def optimizer_shardings(tx, opt_state, param_shardings, mesh: Mesh):
    """Shardings for an optax state: param-shaped parts follow `param_shardings`, the rest replicated."""
    import optax
    return optax.tree_map_params(tx, lambda _, s: s, opt_state, param_shardings,
                                 transform_non_params=lambda _: replicated(mesh),
                                 is_leaf=lambda x: isinstance(x, NamedSharding))


def cache_shardings(cache, mesh: Mesh):
    return tree_shardings(cache, mesh, CACHE_RULES)


def bank_shardings(bank, mesh: Mesh):
    return tree_shardings(bank, mesh, BANK_RULES)


# ------------------------------------------------------------------------------------------ batch
def batch_spec(shape: Sequence[int], mesh: Mesh) -> P:
    """Leading (batch) dim split over ("data", "fsdp") when it divides; other dims replicated."""
    return fit_spec((BATCH,) + (None,) * (len(shape) - 1), shape, mesh)


def batch_shardings(batch, mesh: Mesh):
    return jax.tree.map(lambda x: NamedSharding(mesh, batch_spec(np.shape(x), mesh)), batch)


def shard_batch(batch, mesh: Mesh):
    """Places every array of `batch` (a pytree of [B, ...] arrays) split on its batch dim."""
    return jax.device_put(batch, batch_shardings(batch, mesh))
