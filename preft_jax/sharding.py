"""Sharding: logical axis names declared where arrays are created, one logical -> mesh rules table.

Every model, adapter, bank and cache array declares the *logical* name of each of its dimensions
where it is created (MaxText / Tunix style):

* model weights: `nnx.Param(..., out_sharding=("layers", "embed", "q_heads"), eager_sharding=False)`
  in `preft_jax.model` (read back from the Variable metadata). A quantized weight (a qwix QArray,
  preft_jax.quantize) declares `<path>/qvalue` with the weight's axes and `<path>/scale` with the
  same names, size-1 dimensions unsplit: per-channel scales follow the output-channel axis, grouped
  ones the input axis too (a head axis only where each head holds whole groups);
* `AdapterBank.logical_axes()`, `KVCache.logical_axes()`, `PagedKVCache.logical_axes()` (same pytree,
  tuples of names at the leaves), and `preft_jax.adapters.trainable.param_axes(params)` for the
  trainable single-adapter dicts;
* activations: `constrain(x, axes, units)` inside the model (`jax.lax.with_sharding_constraint`;
  a no-op unless a mesh is set with `jax.set_mesh`).

`RULES` is the one table that maps a logical name to mesh axes. The mesh has three named axes:

* ``data``   - pure data parallelism (batch split, weights replicated),
* ``fsdp``   - batch split *and* weights sharded on their model (``embed`` = ``d_model``) dimension,
* ``tensor`` - tensor (Megatron-style) parallelism on heads / ffn / vocab dimensions.

An array whose path has no declared axes, or a logical name without a rule, is an error naming the
path (never silently replicated).

Divisibility (explicit): head axes (``q_heads``, ``kv_heads``) are split by *whole heads*: they need
the head counts (`axis_units(cfg)`), also for the fused ``[.., n_heads * head_dim]`` weight
dimensions. A dimension whose unit count the mesh axes do not divide falls back to the longest
prefix of its mesh-axis tuple that divides (batch: ("data", "fsdp") -> "data"), else it is
**replicated, with a logged warning** (once per message). E.g. SmolLM2-135M (9 query heads, 3 KV
heads) at tensor=2: wq/wk/wv/wo, the q/k/v activations and the KV cache are replicated over
"tensor" while the MLP (ffn 1536) and the vocabulary (49152) are split. Batch dimensions fall back
silently (a batch of 6 rows on 8 devices is normal). Mesh axes of size 1 are left out of the specs.

Everything here is plain pjit style: build ``NamedSharding`` pytrees with the ``*_shardings``
helpers, place arrays with ``jax.device_put`` (``shard_*``), and pass the same pytrees as
``in_shardings`` / ``out_shardings`` to ``jax.jit``.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

log = logging.getLogger("preft_jax.sharding")

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")          # the batch dimension is split over both data-parallel axes

# The one logical -> mesh rules table. Values: a mesh axis, a tuple of mesh axes, or None (replicated).
RULES: dict[str, str | tuple[str, ...] | None] = {
    # weights
    "vocab": "tensor",          # embedding rows / lm_head columns
    "embed": "fsdp",            # d_model of a weight (all-gathered layer by layer inside the scan)
    "q_heads": "tensor",        # query heads (fused: n_heads * head_dim), whole heads only
    "kv_heads": "tensor",       # key/value heads (weights, caches, activations), whole heads only
    "mlp": "tensor",            # ffn_dim
    "layers": None,             # the stacked layer axis (scanned)
    "norm": None,               # RMSNorm scales
    # adapters
    "adapters": None,           # bank slots
    "rank": ("tensor", "fsdp"), # LoRA / ReFT rank: whichever of these the array's other dims leave (DEFERRED)
    # caches and activations
    "batch": BATCH,             # sequences / rows / KVCache slots
    "seq": None,                # positions
    "head_dim": None,
    "act_embed": None,          # d_model of activations (the residual stream)
    "kv_blocks": None,          # paged KV pool blocks (shared by every row)
    "block": None,              # tokens within a KV block
}
HEAD_AXES = ("q_heads", "kv_heads")
# Logical axes fitted after the array's other dimensions, taking only the mesh axes those leave. The
# adapter rank: LoRA A [embed, rank] -> (fsdp, tensor) and A [mlp, rank] -> (tensor, fsdp) (the shrink
# output is all-gathered, vLLM's fully sharded LoRA), B [rank, q_heads] -> (fsdp, tensor) (split like
# its projection's output) and B [rank, embed] -> (tensor, fsdp): a bank of N adapters is split over
# every device of a tensor x fsdp mesh, never replicated over "tensor" (benchmarks.memory_plan:
# 70B, 512 adapters, tensor=8 - 86 GiB of bank per device before, 25 after).
DEFERRED = ("rank",)

Axes = tuple   # one logical name (or None) per dimension

_warned: set[str] = set()


def axis_units(cfg) -> dict[str, int]:
    """Unit counts of the head axes (a fused head dimension is split only at head boundaries)."""
    return {"q_heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads}


def _warn_once(msg: str):
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


# ------------------------------------------------------------------------------------------ mesh
def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices: Sequence | None = None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh with Auto axis types over the first data*fsdp*tensor devices."""
    n = data * fsdp * tensor
    devices = list(jax.devices() if devices is None else devices)
    if n < 1 or n > len(devices):
        raise ValueError(f"mesh {data}x{fsdp}x{tensor} needs {n} devices, {len(devices)} available")
    return Mesh(np.asarray(devices[:n]).reshape(data, fsdp, tensor), AXES)


def parse_mesh(spec: str | None) -> dict[str, int]:
    """'data=2,tensor=4' -> {"data": 2, "fsdp": 1, "tensor": 4}; None / '' -> all 1."""
    out = {a: 1 for a in AXES}
    seen = set()
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in AXES:
            raise ValueError(f"mesh takes AXIS=N[,AXIS=N] with AXIS in {AXES}, got {part!r}")
        if name in seen:
            raise ValueError(f"mesh axis {name!r} given twice")
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"mesh axis {name}: size must be a positive integer, got {value!r}")
        seen.add(name)
        out[name] = n
    return out


def mesh_from_spec(spec: str | None, devices: Sequence | None = None) -> Mesh:
    """The mesh of `parse_mesh(spec)`; its size must equal the number of devices."""
    shape = parse_mesh(spec)
    devices = list(jax.devices() if devices is None else devices)
    n = int(np.prod(list(shape.values())))
    if n != len(devices):
        desc = ",".join(f"{a}={shape[a]}" for a in AXES)
        raise ValueError(f"mesh {desc} has {n} devices but {len(devices)} are available "
                         f"({jax.default_backend()}); the mesh must use every device")
    return make_mesh(shape["data"], shape["fsdp"], shape["tensor"], devices)


def _mesh_shape(mesh) -> Mapping[str, int]:
    return dict(mesh.shape)


def _axis_size(shape: Mapping[str, int], names) -> int:
    return int(np.prod([shape[a] for a in names])) if names else 1


def fit_spec(spec: Sequence, shape: Sequence[int], mesh) -> P:
    """`spec` (mesh axes per dim) with every entry that does not divide its dim replaced, silently.

    A tuple entry falls back to its longest prefix that divides, then to None (replicated). Extra
    entries are dropped; missing ones are None. Axis names not in the mesh (or of size 1) are dropped."""
    ms = _mesh_shape(mesh)
    out = []
    for i, dim in enumerate(shape):
        axis = spec[i] if i < len(spec) else None
        out.append(_fit(axis, dim, ms, set())[0])
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _mesh_names(target, ms: Mapping[str, int], used: set) -> tuple:
    names = () if target is None else (target if isinstance(target, tuple) else (target,))
    return tuple(a for a in names if a in ms and ms[a] > 1 and a not in used)


def _fit(target, units: int, ms: Mapping[str, int], used: set):
    """(spec entry, mesh axes dropped for divisibility) for one dimension of `units` units."""
    names = _mesh_names(target, ms, used)
    for k in range(len(names), 0, -1):
        if units % _axis_size(ms, names[:k]) == 0:
            used.update(names[:k])
            return (names[:k] if k > 1 else names[0]), names[k:]
    return None, names


def logical_spec(axes: Sequence, shape: Sequence[int], mesh, units: Mapping[str, int] | None = None,
                 where: str = "array", rules: Mapping = RULES) -> P:
    """PartitionSpec of an array with logical `axes` (one name or None per dim) on `mesh` by `rules`.

    `units`: unit counts of axes split by whole units (the head axes: `axis_units(cfg)`); a dimension
    whose units the rule's mesh axes do not divide falls back to a dividing prefix, else is
    replicated with a warning (batch dims: silently). A mesh axis is used at most once per spec."""
    axes = tuple(axes)
    if len(axes) != len(shape):
        raise ValueError(f"{where}: {len(axes)} logical axes {axes} for shape {tuple(shape)}")
    ms = _mesh_shape(mesh)
    used: set = set()
    out = [None] * len(axes)
    order = sorted(range(len(axes)), key=lambda i: axes[i] in DEFERRED)      # stable: DEFERRED names last
    for i in order:
        name, dim = axes[i], shape[i]
        if name is None:
            continue
        if name not in rules:
            raise ValueError(f"{where}: logical axis {name!r} has no rule in preft_jax.sharding.RULES "
                             f"(known: {sorted(rules)})")
        n = dim
        if name in HEAD_AXES and _mesh_names(rules[name], ms, used):
            if units is None or name not in units:
                raise ValueError(f"{where}: dimension {name!r} is split by whole heads; pass the model "
                                 f"config (units=axis_units(cfg))")
            if dim % units[name]:
                # e.g. the group scales of an int4 weight whose groups span heads: no whole-head split
                _warn_once(f"{where}: {name} dimension {dim} is not a whole number per head "
                           f"({units[name]} heads); replicated")
                continue
            n = units[name]
        entry, dropped = _fit(rules[name], n, ms, used)
        if dropped and name != "batch":
            _warn_once(f"{where}: {name} ({n}) is not divisible by mesh axes {dropped} "
                       f"(size {_axis_size(ms, dropped)}); replicated over them")
        out[i] = entry
    while out and out[-1] is None:
        out.pop()
    return P(*out)


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


# ------------------------------------------------------------------------------ declared axes
def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x)


def declared_axes(tree) -> dict[str, Axes]:
    """{path: logical axes} of every array of `tree`, from where it was declared:

    nnx State / Module (Variable `out_sharding` metadata), objects with `logical_axes()` (AdapterBank,
    KVCache, PagedKVCache), trainable adapter dicts (`trainable.param_axes`)."""
    from flax import nnx
    from preft_jax.quantize import component_axes
    if isinstance(tree, (nnx.State, nnx.Module)):
        state = nnx.state(tree) if isinstance(tree, nnx.Module) else tree
        out = {}
        leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
        for path, var in leaves:
            if isinstance(var, nnx.Variable):
                axes = var.get_metadata().get("out_sharding")
                parts = None if axes is None else component_axes(var.get_value(), axes)
                if parts is None:
                    out[path_name(path)] = axes
                else:                                   # a quantized weight: its qvalue and scale
                    out.update({f"{path_name(path)}/{k}": a for k, a in parts.items()})
        return out
    if hasattr(tree, "logical_axes"):
        axes_tree = tree.logical_axes()
    elif isinstance(tree, dict):
        from preft_jax.adapters.trainable import param_axes
        axes_tree = param_axes(tree)
    else:
        raise TypeError(f"no logical axes are declared for a {type(tree).__name__}")
    leaves = jax.tree_util.tree_flatten_with_path(axes_tree, is_leaf=_is_axes)[0]
    return {path_name(p): a for p, a in leaves}


def _specs(tree, mesh, units, what: str):
    axes = declared_axes(tree)

    def one(path, x):
        name = path_name(path)
        where = f"{what}{'/' if what and name else ''}{name}" or "array"
        a = axes.get(name)
        if a is None:
            raise ValueError(f"{where}: no logical axes declared (see preft_jax.sharding); "
                             f"refusing to replicate it silently")
        return logical_spec(a, np.shape(x), mesh, units, where)
    return jax.tree_util.tree_map_with_path(one, tree)


def tree_specs(tree: Any, mesh, cfg=None, what: str = "") -> Any:
    """A pytree of PartitionSpec, one per array leaf of `tree` (same structure), from its declared
    axes; `cfg` (a ModelConfig) gives the head counts. A leaf without declared axes is an error."""
    return _specs(tree, mesh, None if cfg is None else axis_units(cfg), what)


def tree_shardings(tree: Any, mesh: Mesh, cfg=None, what: str = "") -> Any:
    """A pytree of NamedSharding, one per array leaf of `tree` (same structure)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), tree_specs(tree, mesh, cfg, what),
                        is_leaf=lambda x: isinstance(x, P))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# ---------------------------------------------------------------------------------- activations
def constrain(x, axes: Sequence, units: Mapping[str, int] | None = None, where: str = "activation"):
    """`jax.lax.with_sharding_constraint(x, spec of axes)` under a mesh set with `jax.set_mesh`;
    `x` unchanged without one (single-device code is untouched)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_spec(axes, x.shape, mesh, units, where))


def constrain_tree(tree, units: Mapping[str, int] | None = None, what: str = ""):
    """`constrain` on every array of a tree with declared axes (e.g. a KV cache leaving a step)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return tree
    specs = _specs(tree, mesh, units, what)
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, specs, is_leaf=lambda x: isinstance(x, P))


def use_mesh(mesh: Mesh | None):
    """`jax.set_mesh(mesh)` as a context (activation constraints on), or nothing for mesh None."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


# -------------------------------------------------------------------------------- model / adapter
def model_state_shardings(state, mesh: Mesh, cfg=None):
    """NamedShardings of a split `Llama` state (declared on its nnx.Params). `cfg` (its ModelConfig)
    gives the head counts; it is required when a head axis meets a mesh axis of size > 1."""
    return tree_shardings(state, mesh, cfg, "model")


def shard_model_state(state, mesh: Mesh, cfg=None):
    """The split model state with every weight placed as NamedSharding'ed arrays."""
    return jax.device_put(state, model_state_shardings(state, mesh, cfg))


def adapter_shardings(params, mesh: Mesh, cfg=None):
    return tree_shardings(params, mesh, cfg, "adapter")


def shard_adapter(params, mesh: Mesh, cfg=None):
    return jax.device_put(params, adapter_shardings(params, mesh, cfg))


def optimizer_shardings(tx, opt_state, param_shardings, mesh: Mesh):
    """Shardings for an optax state: param-shaped parts follow `param_shardings`, the rest replicated."""
    import optax
    return optax.tree_map_params(tx, lambda _, s: s, opt_state, param_shardings,
                                 transform_non_params=lambda _: replicated(mesh),
                                 is_leaf=lambda x: isinstance(x, NamedSharding))


def cache_shardings(cache, mesh: Mesh, cfg=None):
    return tree_shardings(cache, mesh, cfg, "cache")


def bank_shardings(bank, mesh: Mesh, cfg=None):
    return tree_shardings(bank, mesh, cfg, "bank")


# ------------------------------------------------------------------------------------------ batch
def batch_spec(shape: Sequence[int], mesh: Mesh) -> P:
    """Leading (batch) dim split over ("data", "fsdp") when it divides; other dims replicated."""
    return fit_spec((BATCH,) + (None,) * (len(shape) - 1), shape, mesh)


def batch_shardings(batch, mesh: Mesh):
    return jax.tree.map(lambda x: NamedSharding(mesh, batch_spec(np.shape(x), mesh)), batch)


def shard_batch(batch, mesh: Mesh):
    """Places every array of `batch` (a pytree of [B, ...] arrays) split on its batch dim."""
    return jax.device_put(batch, batch_shardings(batch, mesh))
