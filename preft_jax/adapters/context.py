"""Per-step adapter context: the token -> slot layout, built once per step, and one backend-independent
call per adapter kind that every layer makes (the role of vLLM's punica wrapper).

    ctx = AdapterContext.build(token_slots, bank.n_slots, backend)   # once per step, [B, T] slots
    y = x @ w + ctx.lora(x, A, B)                                    # every LoRA projection
    h = ctx.reft(h, R, W, b, subtract)                               # after a layer with ReFT

The context holds the flattened slot ids and whatever grouped layout its backend needs (for `xla`:
the stable sort order by slot, its inverse and the group sizes), so no layer recomputes layout.

Layout mode, decided when the context is built (static):
  "gather"   each token gathers its own slot's weights (BGMV). Default when every sequence has one
             token (decode: token_slots [n, 1]).
  "grouped"  tokens grouped by slot, each group multiplied by its slot's weights (SGMV / ragged_dot).
             Default for chunks (prefill, training).
  "rows"     chunks whose rows are sequences with one adapter each (`row_slots` given: token (b, t)
             uses slot 0 or row_slots[b], as `token_adapter_index` makes them): each row gathers its
             slot's weights once (`apply.lora_rows`). The jnp backend's layout for such chunks on banks
             of more than ROWS_MASKED_MAX_SLOTS slots: its cost is one LoRA's, where the masked product's
             grows with the bank and the per-token gather's with the chunk (`benchmarks.lora_layouts`;
             this CPU, 32 x 16 tokens, 9 slots: 68 vs 127 ms per 120 projections; 33: 74 vs 232 gather).
             Other backends keep "grouped" for such chunks (their kernels group by slot already).

Backends (`BACKENDS`):
  jnp     plain XLA, the reference: per-token gather; grouped chunks of banks with <= 32 slots use
          one dense product through every slot's weights, each row keeping its own slot's rank
          columns (`apply.lora_masked`; on CPU ~10-40x cheaper than gathering A and B per token);
          chunks with one adapter per row on banks of > 4 slots use the rows layout.
  xla     for accelerators: grouped chunks through `jax.lax.ragged_dot` on tokens sorted by slot
          (shrink and expand each one grouped matmul); decode through the per-token gather.
          Note: XLA lowers ragged_dot natively on TPU; on CPU and NVIDIA GPUs (jax 0.10) it expands
          it into a dense group-masked dot (N x the FLOPs, an [N, T, d] temporary) unless the cuDNN
          ragged-dot fusion is enabled (XLA_FLAGS=--xla_gpu_experimental_use_ragged_dot_fusion=true,
          cuDNN >= 9.22). scripts/device_check.py times it against the Pallas kernels.
  pallas  the Pallas kernels (pallas_kernels: SGMV grouped, BGMV gather, ReFT); interpret mode on CPU.
          A shape the kernels cannot tile falls back to `xla` with a one-time warning. One exception,
          chosen by the platform the step is lowered for: LoRA in the gather layout (decode) runs
          XLA's per-token gather on GPUs (`GATHER_LORA_XLA_PLATFORMS`), BGMV on TPU (and interpreted
          on CPU). On one H200 (scripts/device_check.py, docs/device_check.md, bf16, 64 decode tokens,
          rank 16) BGMV took 0.86-0.96x of XLA's gather speed at 1-512 adapters (60-77 us per call
          either way: launch-bound), while SGMV prefill was 3-39x faster than XLA's ragged_dot.
  auto    pallas on TPU and GPU when the kernels lower there (probed once by lowering them), else
          xla; jnp on CPU. The platform is `jax.default_backend()` at resolution time. On a GPU that
          means SGMV / Pallas ReFT for prefill chunks and XLA's gather for decode LoRA (above).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from preft_jax.adapters import apply

BACKENDS = ("auto", "jnp", "xla", "pallas")
MODES = ("gather", "grouped", "rows")
MASKED_MAX_SLOTS = 32         # jnp backend: chunks on banks up to this many slots use apply.lora_masked
ROWS_MASKED_MAX_SLOTS = 4     # jnp backend: one-adapter-per-row chunks on banks of more slots use apply.lora_rows
PALLAS_BLOCK_TOKENS = 16      # token tile of the grouped Pallas kernels (their default)
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))   # activations and adapter weights, every backend
# Lowering platforms on which the pallas backend's gather-layout LoRA (decode) is XLA's per-token
# gather instead of the BGMV kernel: measured no faster there (module docstring).
GATHER_LORA_XLA_PLATFORMS = ("cuda", "rocm")

log = logging.getLogger(__name__)
_warned: set = set()


# ---- backend resolution ----------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def pallas_lowers_on(platform: str) -> bool:
    """Whether the Pallas kernels compile (interpret=False) for `platform` ("cpu" = interpret mode).

    Probed once per platform by lowering each kernel at a small shape (no device needed)."""
    if platform == "cpu":
        return True
    import pallas_kernels
    from preft_jax.lowering import lowering_platform, lowers
    lp = lowering_platform(platform)
    T, d, r, n = 32, 128, 8, 3
    x = jax.ShapeDtypeStruct((T, d), jnp.float32)
    idx = jax.ShapeDtypeStruct((T,), jnp.int32)
    A = jax.ShapeDtypeStruct((n, d, r), jnp.float32)
    B = jax.ShapeDtypeStruct((n, r, d), jnp.float32)
    R = jax.ShapeDtypeStruct((n, r, d), jnp.float32)
    b, s = jax.ShapeDtypeStruct((n, r), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.float32)
    probes = [(functools.partial(pallas_kernels.lora_sgmv, interpret=False), (x, A, B, idx)),
              (functools.partial(pallas_kernels.lora_bgmv, interpret=False), (x, A, B, idx)),
              (functools.partial(pallas_kernels.reft_apply, interpret=False), (x, R, R, b, s, idx))]
    for fn, args in probes:
        why = lowers(jax.jit(fn), *args, platform=lp)
        if why:                # any lowering failure means "not on this platform"
            log.info("pallas kernels do not lower on %s: %s", lp, why)
            return False
    return True


def resolve_backend(backend: str, platform: str | None = None) -> str:
    """'auto' -> a concrete backend for `platform` (default: jax.default_backend()); checks support.

    Raises ValueError for an unknown backend, or pallas on a platform its kernels do not lower on."""
    if backend not in BACKENDS:
        raise ValueError(f"adapter backend must be one of {BACKENDS}, got {backend!r}")
    platform = jax.default_backend() if platform is None else platform
    if backend == "auto":
        if platform == "cpu":
            return "jnp"
        if platform in ("tpu", "gpu") and pallas_lowers_on(platform):
            return "pallas"
        return "xla"
    if backend == "pallas" and not pallas_lowers_on(platform):
        raise ValueError(f"adapter backend 'pallas': the Pallas kernels do not lower on {platform!r} "
                         f"in this build; supported here: 'jnp', 'xla' (or 'auto', which picks one)")
    return backend


def _tiling_errors():
    import pallas_kernels
    return pallas_kernels.TilingError


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        log.warning(message)


# ---- the context -----------------------------------------------------------------------------
@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["slots", "order", "inverse", "group_sizes", "kernel_metadata", "row_slots"],
                   meta_fields=["backend", "mode", "n_slots"])
@dataclasses.dataclass(frozen=True)
class AdapterContext:
    slots: jax.Array                    # int32 [T]: slot of each flattened token
    order: jax.Array | None             # int32 [T]: tokens stably sorted by slot (xla grouped)
    inverse: jax.Array | None           # int32 [T]: position of token t in `order`
    group_sizes: jax.Array | None       # int32 [N]: tokens per slot (xla grouped)
    kernel_metadata: Any                # Pallas group metadata, built once per step (see build)
    row_slots: jax.Array | None         # int32 [R]: each row's adapter slot (rows mode)
    backend: str                        # resolved: "jnp" | "xla" | "pallas"
    mode: str                           # "gather" | "grouped" | "rows"
    n_slots: int

    @classmethod
    def build(cls, token_slots, n_slots: int, backend: str = "jnp", mode: str | None = None,
              row_slots=None) -> "AdapterContext":
        """token_slots: int [B, T] (or [T]) slot per token, 0 = base; n_slots: the bank's slot count;
        row_slots: int [B], optional: each row's one adapter slot, declaring that token (b, t) uses slot 0
        or row_slots[b] (a token that does not gets NaN in rows mode).

        mode None: "gather" when each sequence has one token (token_slots [B, 1] or [T]); for chunks,
        "rows" on the jnp backend when row_slots is given and the bank has more than ROWS_MASKED_MAX_SLOTS
        slots, else "grouped". Slot ids are clipped to [0, n_slots) like the kernels do (callers validate)."""
        backend = resolve_backend(backend)
        token_slots = jnp.asarray(token_slots)
        if mode is None:
            if token_slots.ndim == 1 or token_slots.shape[-1] == 1:
                mode = "gather"
            elif row_slots is not None and backend == "jnp" and n_slots > ROWS_MASKED_MAX_SLOTS:
                mode = "rows"
            else:
                mode = "grouped"
        if mode not in MODES:
            raise ValueError(f"adapter context mode must be one of {MODES}, got {mode!r}")
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        if mode == "rows":
            if backend != "jnp":
                raise ValueError(f"adapter context mode 'rows' is the jnp backend's layout, not {backend!r}'s")
            if row_slots is None or token_slots.ndim != 2 or jnp.shape(row_slots) != token_slots.shape[:1]:
                raise ValueError(f"adapter context mode 'rows' needs token_slots [B, T] and row_slots [B]; got "
                                 f"{token_slots.shape} and {None if row_slots is None else jnp.shape(row_slots)}")
            row_slots = jnp.clip(jnp.asarray(row_slots).astype(jnp.int32), 0, n_slots - 1)
        else:
            row_slots = None
        slots = jnp.clip(token_slots.reshape(-1).astype(jnp.int32), 0, n_slots - 1)
        order = inverse = group_sizes = metadata = None
        if mode == "grouped" and backend == "xla":
            order, inverse, group_sizes = sorted_layout(slots, n_slots)
        if mode == "grouped" and backend == "pallas":
            import pallas_kernels          # the kernels' tile layout, once per step for every layer
            metadata = pallas_kernels.make_group_metadata(slots, n_slots, PALLAS_BLOCK_TOKENS)
        return cls(slots, order, inverse, group_sizes, metadata, row_slots, backend, mode, int(n_slots))

    @property
    def num_tokens(self) -> int:
        return self.slots.shape[0]

    def _flat(self, x, name):
        tokens = math.prod(x.shape[:-1])
        if tokens != self.num_tokens:
            raise ValueError(f"{name} {x.shape} has {tokens} tokens, the adapter context {self.num_tokens}")
        return x.reshape(tokens, x.shape[-1])

    def _check(self, x, w, name):
        if w.shape[0] != self.n_slots:
            raise ValueError(f"{name} has {w.shape[0]} slots, the adapter context was built for {self.n_slots}")
        for a in (x, w):
            if jnp.dtype(a.dtype) not in DTYPES:
                raise ValueError(f"adapter backend {self.backend!r}: dtype {jnp.dtype(a.dtype).name} is not supported; "
                                 f"supported: {', '.join(d.name for d in DTYPES)}")

    def _sorted(self):
        if self.order is not None:
            return self.order, self.inverse, self.group_sizes
        return sorted_layout(self.slots, self.n_slots)       # only the Pallas fallback gets here

    def _kernel_kwargs(self):
        return {} if self.kernel_metadata is None else {"metadata": self.kernel_metadata}

    # ---- LoRA ----------------------------------------------------------------------------------
    def lora(self, x, A, B):
        """Multi-adapter LoRA delta: x [..., d_in] (T tokens), A [N, d_in, r], B [N, r, d_out] -> [..., d_out]."""
        self._check(x, A, "LoRA A")
        lead, xf = x.shape[:-1], self._flat(x, "x")
        out = self._lora_flat(xf, A, B)
        return out.reshape(lead + out.shape[-1:])

    def _lora_flat(self, x, A, B):
        if self.mode == "gather" and self.backend in ("jnp", "xla"):
            return apply.lora_gather(x, A, B, self.slots)
        if self.mode == "rows":
            return apply.lora_rows(x, A, B, self.row_slots, self.slots)
        if self.backend == "jnp":
            if self.n_slots <= MASKED_MAX_SLOTS:
                return apply.lora_masked(x, A, B, self.slots)
            return apply.lora_gather(x, A, B, self.slots)
        if self.backend == "pallas" and self.mode == "gather":
            xla = {p: apply.lora_gather for p in GATHER_LORA_XLA_PLATFORMS}
            return jax.lax.platform_dependent(x, A, B, self.slots, default=self._bgmv, **xla)
        if self.backend == "pallas":
            import pallas_kernels
            try:
                return pallas_kernels.lora_sgmv(x, A, B, self.slots, **self._kernel_kwargs())
            except _tiling_errors() as e:
                self._fallback_warning("lora_sgmv", (x.shape, A.shape, B.shape, str(x.dtype)), e)
        order, inverse, gs = self._sorted()
        ys = apply.lora_ragged(x[order], A, B, gs, self.slots[order])
        return ys[inverse]

    def _bgmv(self, x, A, B, slots):
        import pallas_kernels
        try:
            return pallas_kernels.lora_bgmv(x, A, B, slots)
        except _tiling_errors() as e:
            self._fallback_warning("lora_bgmv", (x.shape, A.shape, B.shape, str(x.dtype)), e)
            return apply.lora_gather(x, A, B, slots)

    # ---- ReFT ----------------------------------------------------------------------------------
    def reft(self, h, R, W, b, subtract):
        """Multi-adapter ReFT edit of the residual stream: h [..., d]; R, W [N, r, d]; b [N, r];
        subtract [N] -> h + R^T (W h + b - subtract * R h), per token's slot (zero R = identity)."""
        self._check(h, R, "ReFT R")
        lead, hf = h.shape[:-1], self._flat(h, "h")
        return self._reft_flat(hf, R, W, b, subtract).reshape(lead + h.shape[-1:])

    def _reft_flat(self, h, R, W, b, subtract):
        if self.backend == "jnp" or (self.backend == "xla" and self.mode == "gather"):
            return apply.reft_gather(h, R, W, b, subtract, self.slots)
        if self.backend == "pallas":
            import pallas_kernels
            try:
                return pallas_kernels.reft_apply(h, R, W, b, subtract, self.slots, **self._kernel_kwargs())
            except _tiling_errors() as e:
                self._fallback_warning("reft_apply", (h.shape, R.shape, str(h.dtype)), e)
                if self.mode == "gather":
                    return apply.reft_gather(h, R, W, b, subtract, self.slots)
        order, inverse, gs = self._sorted()
        outs = apply.reft_ragged(h[order], R, W, b, subtract, gs, self.slots[order])
        return outs[inverse]

    def _fallback_warning(self, kernel, shapes, err):
        _warn_once((kernel, shapes), f"pallas kernel {kernel} cannot tile shapes {shapes} ({err}); "
                                     f"using the xla adapter backend for them")


def sorted_layout(slots, n_slots: int):
    """(order, inverse, group_sizes) of int32 slot ids [T]: stable sort by slot and its inverse."""
    T = slots.shape[0]
    order = jnp.argsort(slots, stable=True).astype(jnp.int32)
    inverse = jnp.zeros((T,), jnp.int32).at[order].set(jnp.arange(T, dtype=jnp.int32), unique_indices=True)
    group_sizes = jnp.bincount(slots, length=n_slots).astype(jnp.int32)
    return order, inverse, group_sizes
