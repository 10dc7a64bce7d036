"""Weight-only quantization of the frozen base model through qwix (Google's JAX quantization library).

    qc = QuantConfig.parse("int8")                                 # or "int4", or QuantConfig(...)
    params = quantize_params(cfg, params, qc, dtype)               # canonical params -> qwix QArrays
    model = Llama.from_params(cfg, params, dtype=dtype)            # reads the QArrays as they are

* int8: one scale per output channel (per layer), symmetric: w ~ q * scale, q in [-128, 127].
* int4: one scale and one integer zero point per `group_size` consecutive inputs of each output
  channel ("grouped", asymmetric, as AWQ): w ~ (q - zero_point) * scale, q in [-8, 7] (qwix's
  "minmax" calibration; on SmolLM2 its KL to float32 is 40-50 % below the symmetric variant's,
  docs/quantization.md). Default group: 64 inputs (QLoRA's NF4 block), 32 where 64 does not
  divide. XLA stores int4 packed, two values per byte.
* The seven base projections (q/k/v/o/gate/up/down, stacked over layers) are quantized in both
  modes. The embedding table and the LM head (the same array when tied) are int8 with one scale per
  vocabulary row in BOTH modes (`QuantConfig.embeddings`; False keeps them in the compute dtype):
  the logits are the most quantization-sensitive product (llama.cpp's Q4 mixes keep the output
  tensor at 6-8 bits too), and on a small model they are a large share of the bytes read per
  decode step (SmolLM2-135M: 28 M of 135 M parameters). docs/quantization.md has the measurements.
* Norms, q/k/v biases, the KV cache, activations and every adapter (LoRA / ReFT, trainable or in a
  bank) stay in the compute dtype (QLoRA): the quantized base is a constant input of the jitted
  steps, so training differentiates only the adapter params.

The numerics are qwix's (`qwix.quantize`, absmax calibration for int8, minmax for int4; a matmul of a float activation
with a QArray dequantizes the weight and runs a float dot, qwix's own path for float activations,
which XLA fuses into the dot where the backend can): a quantized model computes exactly what the
same model with the dequantized weights (`dequantize_params`) computes, up to summation order.
Scales are computed in float32 and stored in the model dtype.

qwix's model-level API (`quantize_model` / `PtqProvider` / `LoraProvider`, as Tunix uses for QLoRA)
intercepts the einsums a module calls on its own nnx.Params. Our layer weights are stacked and
sliced inside a `jax.lax.scan`, so those einsums see a scan slice, not a Param, and the adapters are
ours (PreFT masking, multi-adapter banks); we therefore use qwix one level down: its QArray, its
quantize / dequantize and its einsum, called from `Llama` through `einsum` and `take` here.

GGUF files: a Q8_0 (int8) or Q4_0 (int4) tensor IS a qwix QArray layout (symmetric integers, one
scale per 32 inputs of an output row), so those tensors go straight into QArrays (tile 32, the
file's exact values): `preft_jax.loading.quantized.quantize_model_params` reads them
(`preft_jax.loading.gguf_loader.read_direct`) and hands them to `quantize_params` as `direct`.
Q4_1 (the default
SmolLM2 file), Q5_x and the K-quants carry a float offset per block (or nested sub-block scales),
which a qwix QArray cannot hold (its zero point is an integer of the quantized type): those are
dequantized to float and requantized.

Sharding: a quantized weight keeps its nnx.Param and its declared logical axes; its qvalue has them
as they are, its scale the same names with size-1 dimensions unsplit (qwix's own rule), so the
scales follow the output-channel axis and, grouped, the input axis (preft_jax.sharding).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from preft_jax.config import QUANT_MODES

try:
    import qwix
    from qwix import QArray
    QWIX_MISSING: str | None = None
except Exception as _e:            # noqa: BLE001 - not installed (an accelerator image with jax and flax,
    qwix = None                     # not qwix), or one that breaks on this jax / flax: the float model
                                    # needs none of it; quantizing says what is missing
    QWIX_MISSING = f"{type(_e).__name__}: {_e}"

    class QArray:                   # noqa: D101 - no array is one where qwix is absent
        pass
QTYPES = {"int8": jnp.int8, "int4": jnp.int4}
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")     # [L, d_in, d_out] each
EMBEDDINGS = ("embed", "lm_head")                                        # [V, d] and [d, V]
GROUP_SIZES = (64, 32)              # int4 default: the first that divides every projection's input
DIRECT_TYPES = {"int8": "Q8_0", "int4": "Q4_0"}    # GGUF block types that are this mode's QArray layout


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """mode "int8" (per output channel) | "int4" (grouped); group_size: int4 inputs per scale (None:
    64, or 32 where 64 does not divide every projection's input dimension); embeddings: also
    quantize the embedding / LM head (int8, one scale per vocabulary row)."""
    mode: str
    group_size: int | None = None
    embeddings: bool = True

    def __post_init__(self):
        if self.mode not in QUANT_MODES:
            raise ValueError(f"quantize must be one of {QUANT_MODES}, got {self.mode!r}")
        if self.group_size is not None:
            if self.mode != "int4":
                raise ValueError(f"group_size is for int4 (int8 has one scale per output channel), got "
                                 f"group_size={self.group_size} with {self.mode}")
            if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
                raise ValueError(f"group_size must be a positive integer, got {self.group_size!r}")

    @classmethod
    def parse(cls, spec) -> "QuantConfig | None":
        """None / "" / "none" -> None; "int8" | "int4" -> QuantConfig; a QuantConfig as it is."""
        if spec is None or isinstance(spec, cls):
            return spec
        if spec in ("", "none"):
            return None
        return cls(mode=spec)

    def group_for(self, cfg) -> int | None:
        """The int4 group size for this model (None for int8)."""
        if self.mode != "int4":
            return None
        dims = {d_in for d_in, _ in cfg.projection_dims().values()}
        if self.group_size is not None:
            bad = sorted(d for d in dims if d % self.group_size)
            if bad:
                raise ValueError(f"int4 group_size {self.group_size} does not divide the projection input "
                                 f"dimension(s) {bad}")
            return self.group_size
        for g in GROUP_SIZES:
            if all(d % g == 0 for d in dims):
                return g
        raise ValueError(f"no int4 group size in {GROUP_SIZES} divides the projection input dimensions "
                         f"{sorted(dims)}; pass QuantConfig(group_size=...)")


class QwixMissingError(ImportError, ValueError):
    """Quantization asked for where qwix does not import: an ImportError, and a ValueError so the
    CLIs' usage-error path (`error: ...`, exit status 2) reports it in one line."""


def require_qwix() -> None:
    """Raises QwixMissingError naming qwix when it is not installed (only quantizing needs it)."""
    if qwix is None:
        raise QwixMissingError(f"quantized base weights need qwix (pip install 'qwix==0.1.8'), which does not "
                               f"import here ({QWIX_MISSING}); the float model does not need it")


# ---------------------------------------------------------------------------------- one array
def quantize_weight(w, mode: str, group_size: int | None = None, dtype=None) -> QArray:
    """A projection weight [..., d_in, d_out] (leading axes, e.g. layers, each get their own scales)
    -> QArray: int8 symmetric, one scale per output channel; int4 asymmetric, one scale and zero
    point per `group_size` inputs of each output channel. Scales are computed in float32 and stored
    in `dtype` (default: w's dtype)."""
    require_qwix()
    w = jnp.asarray(w)
    dtype = w.dtype if dtype is None else jnp.dtype(dtype)
    axes = tuple(a for a in range(w.ndim) if a != w.ndim - 2)
    if mode == "int8":
        q = qwix.quantize(w.astype(jnp.float32), jnp.int8, channelwise_axes=axes)
    elif mode == "int4":
        if not group_size or w.shape[-2] % group_size:
            raise ValueError(f"int4 needs a group size dividing the input dimension {w.shape[-2]}, got {group_size}")
        q = qwix.quantize(w.astype(jnp.float32), jnp.int4, channelwise_axes=axes, tiled_axes={w.ndim - 2: group_size},
                          calibration_method="minmax")
    else:
        raise ValueError(f"quantize must be one of {QUANT_MODES}, got {mode!r}")
    return dataclasses.replace(q, scale=q.scale.astype(dtype))


def quantize_rows(table, dtype=None) -> QArray:
    """An embedding table [V, d] -> int8 QArray with one scale per row (per vocabulary entry); its
    transpose is the tied LM head quantized per output channel."""
    require_qwix()
    t = jnp.asarray(table)
    dtype = t.dtype if dtype is None else jnp.dtype(dtype)
    q = qwix.quantize(t.astype(jnp.float32), jnp.int8, channelwise_axes=(0,))
    return dataclasses.replace(q, scale=q.scale.astype(dtype))


def from_blocks(values: np.ndarray, scales: np.ndarray, mode: str, dtype) -> QArray:
    """A QArray from integer values [..., n, m] and per-block scales [..., n / block, m] (e.g. GGUF
    Q8_0 / Q4_0 blocks, `read_direct`): w = values * scale of the value's block."""
    require_qwix()
    return QArray(jnp.asarray(values, jnp.int8).astype(QTYPES[mode]), jnp.asarray(scales, jnp.float32).astype(dtype),
                  qtype=QTYPES[mode])


def is_quantized(x) -> bool:
    return isinstance(x, QArray)


def dequantize(x):
    """A QArray -> its float array (dtype of its scales); anything else unchanged."""
    return qwix.dequantize(x) if isinstance(x, QArray) else x


def qtype_mode(x) -> str | None:
    """"int8" | "int4" for a QArray, None for a float array."""
    if not isinstance(x, QArray):
        return None
    return {jnp.dtype(v): k for k, v in QTYPES.items()}.get(jnp.dtype(x.qtype), str(x.qtype))


# ------------------------------------------------------------------------------- params / model
def quantize_params(cfg, params: dict, config, dtype=jnp.float32, direct: dict | None = None) -> dict:
    """Canonical params (see preft_jax.loading) -> the same dict with the base projections (and the
    embedding / LM head unless `config.embeddings` is False) as qwix QArrays whose scales are in
    `dtype`; other entries unchanged. `config`: a QuantConfig or "int8" | "int4".

    `direct`: {canonical name: (mode, (values, scales))} of tensors a model file already stores in a
    QArray layout (read by `preft_jax.loading.quantized.direct_tensors`): those become QArrays
    as they are instead of being requantized from the float params. Entries that already are
    QArrays are kept."""
    qc = QuantConfig.parse(config)
    if qc is None:
        return params
    require_qwix()
    dtype = jnp.dtype(dtype)
    group = qc.group_for(cfg)
    out = dict(params)
    direct = direct or {}
    for name in PROJECTIONS + (EMBEDDINGS if qc.embeddings else ()):
        if name not in params:
            continue
        value = params[name]
        if isinstance(value, QArray):
            out[name] = dataclasses.replace(value, scale=value.scale.astype(dtype))
        elif name in direct:
            mode, (values, scales) = direct[name]
            out[name] = from_blocks(values, scales, mode, dtype)
        elif name == "embed":
            out[name] = quantize_rows(value, dtype)
        elif name == "lm_head":
            out[name] = quantize_weight(value, "int8", dtype=dtype)
        else:
            out[name] = quantize_weight(value, qc.mode, group, dtype)
    return out


def direct_types(config, names) -> dict[str, tuple[str, str]]:
    """{canonical name: (mode, GGUF block type)} of the params in `names` that `config` would store in
    a layout a GGUF block type already has (projections: the mode's own, DIRECT_TYPES; the embedding
    / LM head: Q8_0 as int8). The file reader (preft_jax.loading.quantized) reads just these."""
    qc = QuantConfig.parse(config)
    if qc is None:
        return {}
    out = {n: (qc.mode, DIRECT_TYPES[qc.mode]) for n in PROJECTIONS if n in names}
    if qc.embeddings:
        out.update({n: ("int8", DIRECT_TYPES["int8"]) for n in EMBEDDINGS if n in names})
    return out


def dequantize_params(params: dict) -> dict:
    """Every QArray of a params dict as its float array (what the quantized model computes with)."""
    return {k: (np.asarray(qwix.dequantize(v)) if isinstance(v, QArray) else v) for k, v in params.items()}


def model_quantization(model) -> str | None:
    """"int8" | "int4" when `model`'s (a Llama) base projections are quantized, else None."""
    return qtype_mode(model.layers.wq.get_value())


# -------------------------------------------------------------------------- model computations
def einsum(spec: str, x, w, **kwargs):
    """`jnp.einsum(spec, x, w)`; a QArray weight is dequantized first (`qwix.dequantize`), which is
    what `qwix.einsum` itself does for a float activation (its "slow path": XLA fuses the dequantize
    into the dot's operand). Calling `qwix.einsum` directly is avoided: on XLA:CPU (jax 0.10.2) its
    operand order makes the bfloat16 LM head (bf16 x bf16 -> f32 dot) fail to run ("Unsupported
    element type for DotThunk::Execute: BF16 x BF16 = F32"), see docs/quantization.md."""
    if isinstance(w, QArray):
        w = qwix.dequantize(w)
    return jnp.einsum(spec, x, w, **kwargs)


def take(table, ids):
    """Rows `table[ids]` of an embedding table, float or quantized (dequantized after the gather)."""
    if isinstance(table, QArray):      # scales are per row (quantize_rows, GGUF blocks): gather them alike
        ids = jnp.asarray(ids)
        return qwix.dequantize(dataclasses.replace(table, qvalue=table.qvalue[ids], scale=table.scale[ids]))
    return table[ids]


# ------------------------------------------------------------------------------------- sharding
def component_axes(value, axes: tuple) -> dict[str, tuple] | None:
    """{component: logical axes} of a QArray whose weight has logical `axes` (None for anything
    else): qvalue the weight's axes, scale / zero_point the same names with size-1 dimensions
    unsplit (qwix's rule: a per-channel scale follows the output axis, a grouped one also the input)."""
    if not isinstance(value, QArray):
        return None
    out = {"qvalue": tuple(axes)}
    for name in ("scale", "zero_point"):
        part = getattr(value, name)
        if part is not None:
            out[name] = tuple(None if n == 1 else a for a, n in zip(axes, np.shape(part)))
    return out


__all__ = ["QUANT_MODES", "QWIX_MISSING", "QwixMissingError", "require_qwix", "QuantConfig", "quantize_weight",
           "quantize_rows", "quantize_params", "dequantize_params", "dequantize", "is_quantized", "model_quantization", "direct_types", "einsum", "take", "component_axes",
           "from_blocks", "QArray"]
