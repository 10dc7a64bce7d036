"""Paged KV cache: a pool of fixed-size blocks per layer, addressed through per-sequence block tables.

    k, v: [n_layers, n_kv_heads, num_blocks, block_size, head_dim]

(per layer the `[kv_heads, pages, page_size, head_dim]` layout of jax's Pallas paged-attention
kernels). Block 0 is never handed out by the engine's block pool, so padding entries of block tables
point at it and padding tokens write past the end of the pool (dropped).

One step's paged work is described by a `PagedBatch` (built once per step on the host): R rows of
C tokens each (decode: C = 1; prefill chunks: C > 1), row r's tokens sit at positions
context_lens[r] + [0, C) and attend to its `context_lens[r]` cached tokens (named by its block
table) plus, causally, to the chunk itself.

Attention backends (`PagedBatch.attention`, static):
* "gather" (CPU, and prefill chunks everywhere): each layer gathers the rows' context blocks straight
  from the pool, concatenates the chunk's own new K/V, and emits the new K/V; they are written into
  the pool once, after the layer scan (`write_kv`). Work follows the block-table width, which the
  engine buckets to the longest live sequence.
* "kernel:tpu" / "kernel:gpu" (decode, C == 1): the whole pool is carried through the layer scan;
  each layer writes its new K/V into it in place (`write_token_layer`) and jax's Pallas
  paged-attention kernel (`ops.tpu.paged_attention` / `ops.gpu.paged_attention`) reads the rows'
  pages straight from the pool (`kernel_decode_attention`: no per-layer slice of the pool is
  materialized, so a step moves the live context's bytes, not the pool's), splitting long
  contexts over `k_splits` partitions on GPU (`kernel_layout`). `choose_attention` falls back to
  "gather" for shapes the kernels cannot take, and where jax lacks the kernel (`kernel_missing`)
  or it does not lower (`kernel_fails_to_lower`). Off their platform (CPU tests) both run the GPU
  kernel in Pallas interpret mode.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os

import jax
import jax.numpy as jnp

from preft_jax.config import ModelConfig

log = logging.getLogger("preft_jax.paged_kv")
_logged: set = set()
ATTENTION_BACKENDS = ("gather", "kernel:tpu", "kernel:gpu")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    k: jax.Array    # [L, KV, num_blocks, block_size, hd]
    v: jax.Array

    AXES = ("layers", "kv_heads", "kv_blocks", "block", "head_dim")   # logical axes (preft_jax.sharding)

    def logical_axes(self) -> "PagedKVCache":
        return PagedKVCache(self.AXES, self.AXES)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[2]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]

    @classmethod
    def create(cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype=jnp.float32,
               fill: float = 0.0) -> "PagedKVCache":
        """A pool of `num_blocks` blocks, every element `fill` (benchmarks use a non-zero one: made in
        place, not as a second pool beside a zero one)."""
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"a paged cache needs >= 2 blocks (block 0 is reserved) and block_size >= 1, got "
                             f"{num_blocks}, {block_size}")
        shape = (cfg.n_layers, cfg.n_kv_heads, num_blocks, block_size, cfg.head_dim)
        return cls(k=jnp.full(shape, fill, dtype), v=jnp.full(shape, fill, dtype))

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype=jnp.float32) -> int:
        return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


@functools.partial(jax.tree_util.register_dataclass, data_fields=("block_tables", "context_lens", "chunk_lens",
                                                                  "write_index"),
                   meta_fields=("attention",))
@dataclasses.dataclass
class PagedBatch:
    block_tables: jax.Array     # int32 [R, nb]: the row's blocks in order (NULL_BLOCK = 0 padding)
    context_lens: jax.Array     # int32 [R]: cached tokens before this chunk (= the chunk's first position)
    chunk_lens: jax.Array       # int32 [R]: valid tokens of the chunk (0: padding row)
    write_index: jax.Array      # int32 [R, C]: flat pool index block * block_size + offset; >= pool size drops
    attention: str = "gather"

    @property
    def positions(self):
        C = self.write_index.shape[1]
        return self.context_lens[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]


def _chunk_mask(batch: PagedBatch, C: int, S: int):
    """bool [R, C, S + C]: context keys < context_len; chunk keys causal and valid."""
    ctx = jnp.arange(S, dtype=jnp.int32)[None, None, :] < batch.context_lens[:, None, None]
    i = jnp.arange(C, dtype=jnp.int32)
    own = (i[None, :] <= i[:, None])[None] & (i[None, None, :] < batch.chunk_lens[:, None, None])
    ctx = jnp.broadcast_to(ctx, (ctx.shape[0], C, S))
    return jnp.concatenate([ctx, own], axis=-1)


Q_BLOCK = 256      # chunks longer than this attend in blocks of Q_BLOCK queries (bounded score temporaries)


def gather_attention(q, k_new, v_new, k_all, v_all, batch: PagedBatch, layer):
    """q [R, C, H, hd]; k_new, v_new [R, C, KV, hd]; k_all, v_all the whole pool [L, KV, NB, bs, hd]
    (only layer `layer`'s blocks named by the block tables are read) -> [R, C, H, hd].

    Softmax in float32 over the row's context blocks plus the causal chunk. A chunk of more than
    Q_BLOCK tokens (a multiple of it) is processed Q_BLOCK queries at a time, so the float32 scores
    are [R, H, Q_BLOCK, context + C], not [R, H, C, context + C] (10 GiB for 4 x 2048 tokens of
    Llama-3.1-8B against 8k of context; benchmarks.memory_plan)."""
    R, C, H, hd = q.shape
    kc = k_all[layer, :, batch.block_tables]                 # [R, nb, KV, bs, hd] (no transpose copy)
    vc = v_all[layer, :, batch.block_tables]
    mask = _chunk_mask(batch, C, kc.shape[1] * kc.shape[3])  # [R, C, S + C]
    if C <= Q_BLOCK or C % Q_BLOCK:
        return _attend(q, k_new, v_new, kc, vc, mask)
    n = C // Q_BLOCK
    blocks = (q.reshape(R, n, Q_BLOCK, H, hd).swapaxes(0, 1), mask.reshape(R, n, Q_BLOCK, -1).swapaxes(0, 1))
    out = jax.lax.map(lambda b: _attend(b[0], k_new, v_new, kc, vc, b[1]), blocks)   # [n, R, Q_BLOCK, H, hd]
    return out.swapaxes(0, 1).reshape(R, C, H, hd)


def _attend(q, k_new, v_new, kc, vc, mask):
    """q [R, Cq, H, hd] against the gathered context kc, vc [R, nb, KV, bs, hd] and the chunk's own
    k_new, v_new [R, C, KV, hd]; mask bool [R, Cq, nb * bs + C] -> [R, Cq, H, hd]."""
    R, Cq, H, hd = q.shape
    KV = k_new.shape[2]
    nb, bs = kc.shape[1], kc.shape[3]
    groups = H // KV
    qg = q.reshape(R, Cq, KV, groups, hd)
    s_ctx = jnp.einsum("rckgh,rnkbh->rkgcnb", qg, kc.astype(q.dtype), preferred_element_type=jnp.float32)
    s_ctx = s_ctx.reshape(R, KV, groups, Cq, nb * bs)
    s_own = jnp.einsum("rckgh,rjkh->rkgcj", qg, k_new.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = jnp.concatenate([s_ctx, s_own], axis=-1) * hd ** -0.5
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    p_ctx = probs[..., :nb * bs].reshape(R, KV, groups, Cq, nb, bs).astype(v_new.dtype)
    p_own = probs[..., nb * bs:].astype(v_new.dtype)
    out = (jnp.einsum("rkgcnb,rnkbh->rckgh", p_ctx, vc.astype(v_new.dtype), preferred_element_type=jnp.float32)
           + jnp.einsum("rkgcj,rjkh->rckgh", p_own, v_new, preferred_element_type=jnp.float32))
    return out.reshape(R, Cq, H, hd).astype(q.dtype)


def write_kv(cache: PagedKVCache, new_k, new_v, write_index) -> PagedKVCache:
    """The pool with every layer's new K/V [L, R, C, KV, hd] written at write_index [R, C] (one scatter)."""
    L, KV, NB, bs, hd = cache.k.shape

    def put(pool, new):
        flat = pool.reshape(L, KV, NB * bs, hd)
        vals = jnp.moveaxis(new.astype(pool.dtype), 3, 1).reshape(L, KV, -1, hd)
        return flat.at[:, :, write_index.reshape(-1)].set(vals, mode="drop").reshape(pool.shape)

    return PagedKVCache(put(cache.k, new_k), put(cache.v, new_v))


# ------------------------------------------------------------------------------------ kernels
KERNEL_MODULES = {"gpu": "jax.experimental.pallas.ops.gpu.paged_attention",       # Pallas Triton (deprecated
                  "tpu": "jax.experimental.pallas.ops.tpu.paged_attention"}       # from jax 0.11: docs/device_check.md)


def _kind(platform: str) -> str:
    """Which of jax's paged-attention kernels serves `platform`: "tpu" (Mosaic) or "gpu" (Triton)."""
    return "tpu" if platform == "tpu" else "gpu"


@functools.lru_cache(maxsize=None)
def kernel_missing(kind: str) -> str:
    """Why jax's paged-attention kernel `kind` ("gpu" | "tpu") cannot be imported here ("" when it
    can): the GPU one is one of jax's Pallas Triton ops, deprecated from jax 0.11 and to be removed
    with the Triton backend, so a jax without it falls back to the gather path instead of failing
    every decode call at trace time. Imported once (jax >= 0.11 warns on that import)."""
    import importlib
    try:
        importlib.import_module(KERNEL_MODULES[kind])
    except ImportError as e:
        return f"jax {jax.__version__} has no {KERNEL_MODULES[kind]} ({type(e).__name__}: {e})"
    return ""


@functools.lru_cache(maxsize=None)
def kernel_fails_to_lower(platform: str) -> str:
    """Why jax's paged-attention kernel does not lower for `platform` ("gpu" | "cuda" | "rocm" |
    "tpu") here ("" when it does): probed once per process, at a small shape, as `pallas_lowers_on`
    probes the adapter kernels, so a jax or a device the kernel does not lower for gets the gather
    path and one log line instead of a decode step that fails at its first call."""
    from preft_jax.lowering import lowers
    S = jax.ShapeDtypeStruct
    L, KV, NB, bs, hd, R, H, nb = 2, 2, 8, 16, 128, 2, 8, 2
    pool = S((L, KV, NB, bs, hd), jnp.bfloat16)
    args = (S((R, H, hd), jnp.bfloat16), pool, pool, S((R, nb), jnp.int32), S((R,), jnp.int32))
    kind = _kind(platform)
    why = lowers(jax.jit(lambda q, k, v, t, n: kernel_decode_attention(q, k, v, 1, t, n, kind)), *args,
                 platform=platform)
    return f"jax {jax.__version__}'s {kind} paged-attention kernel does not lower for {platform} ({why})" \
        if why else ""


def kernel_supported(cfg: ModelConfig, block_size: int, pages_per_seq: int, platform: str) -> tuple[bool, str]:
    """Whether jax's Pallas paged-attention kernel for `platform` takes these shapes, is there
    (`kernel_missing`) and lowers (`kernel_fails_to_lower`); and why not."""
    hd = cfg.head_dim
    if platform == "tpu":
        if hd % 128:
            return False, f"head_dim {hd} is not a multiple of 128"
        if block_size % 16:
            return False, f"block_size {block_size} is not a multiple of 16"
    elif platform in ("cuda", "gpu", "rocm"):
        if hd < 16 or hd & (hd - 1):
            return False, f"head_dim {hd} is not a power of two >= 16"
        if block_size < 16 or block_size & (block_size - 1):
            return False, f"block_size {block_size} is not a power of two >= 16"
    else:
        return False, f"no paged-attention kernel for platform {platform!r}"
    why = kernel_missing(_kind(platform)) or kernel_fails_to_lower(platform)
    return not why, why


ATTENTION_ENV = "PREFT_JAX_DECODE_ATTENTION"     # "gather" forces the gather path ("auto"/unset: the choice below)


def choose_attention(cfg: ModelConfig, block_size: int, platform: str | None = None) -> str:
    """The decode attention for `platform` (default: jax.default_backend()): the Pallas paged kernel
    where it takes these shapes, else "gather" (with a one-time log line saying why).
    PREFT_JAX_DECODE_ATTENTION=gather in the environment forces "gather" (as vLLM's
    VLLM_ATTENTION_BACKEND picks its attention backend): a way around a kernel that fails on a
    device, without a code change."""
    platform = jax.default_backend() if platform is None else platform
    forced = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if forced not in ("auto", "gather"):
        raise ValueError(f"{ATTENTION_ENV} must be 'auto' or 'gather', got {forced!r}")
    if platform == "cpu" or forced == "gather":
        if forced == "gather" and platform != "cpu" and ("forced", platform) not in _logged:
            _logged.add(("forced", platform))
            log.warning("paged attention: %s=gather; decode uses the gather path on %s", ATTENTION_ENV, platform)
        return "gather"
    ok, why = kernel_supported(cfg, block_size, 0, platform)
    if not ok:
        if ("unsupported", platform, why) not in _logged:
            _logged.add(("unsupported", platform, why))
            log.warning("paged attention: no %s kernel (%s); using the gather path", platform, why)
        return "gather"
    return f"kernel:{_kind(platform)}"


GPU_PROGRAMS_TARGET = 264      # ~2 waves of an H100/H200's 132 SMs: split K until the grid has this many programs
PAGES_PER_BLOCK = 8            # pages per compute block (128 tokens of 16-token pages: one tile of K/V per step)


@dataclasses.dataclass(frozen=True)
class KernelLayout:
    """How the paged-attention kernel walks a block table of `pages` pages per sequence: compute
    blocks of `pages_per_block` pages, `k_splits` partitions of the sequence (GPU split-K), and the
    table padded to `width` pages (a multiple of pages_per_block x k_splits; the padding points at
    the layer's and head's first page: the kernels load no compute block past a row's length, and
    mask what a row's last block loads past it)."""
    pages: int
    width: int
    pages_per_block: int
    k_splits: int


def kernel_layout(pages: int, programs: int, platform: str, k_splits: int | None = None,
                  target: int = GPU_PROGRAMS_TARGET) -> KernelLayout:
    """The `KernelLayout` of a `pages`-wide block table for a grid of `programs` (rows x KV heads).

    Compute blocks are `PAGES_PER_BLOCK` pages (fewer, a power of two, for a narrower table). On GPU
    (not "tpu") K is split, unless `k_splits` is given, when the programs do not fill the device:
    the smallest power of two that brings the grid to `target` programs or gives every compute
    block its own partition. Long contexts at small batch (B=1, 2048 tokens: 8 programs) are then
    read by many SMs at once. Any table width works: an odd one (a context of 2048 tokens + 1 new
    token is 129 pages) is padded rather than read in 1-page blocks with no split. A partition past
    a row's length loads nothing, so the padding costs table entries and empty programs, not reads."""
    pages = int(pages)
    if pages < 1:
        raise ValueError(f"a block table of {pages} pages: the kernel needs at least one")
    if k_splits is not None and k_splits < 1:
        raise ValueError(f"k_splits must be >= 1, got {k_splits}")
    ppb = min(PAGES_PER_BLOCK, 1 << (pages - 1).bit_length())
    blocks = -(-pages // ppb)
    if k_splits is None:
        k_splits = 1
        if platform != "tpu":
            while programs * k_splits < target and k_splits < blocks:
                k_splits *= 2
    width = ppb * k_splits * -(-blocks // k_splits)
    return KernelLayout(pages, width, ppb, k_splits)


def write_token_layer(pool, layer, new, write_index):
    """The whole pool [L, KV, NB, bs, hd] with layer `layer`'s new K (or V) [R, C, KV, hd] written at
    flat write_index [R, C] (>= NB * bs: dropped). Inside the layer scan on the carried pool this is
    an in-place scatter: no copy of the pool or of the layer's slice."""
    L, KV, NB, bs, hd = pool.shape
    flat = pool.reshape(L, KV, NB * bs, hd)
    vals = new.astype(pool.dtype).reshape(-1, KV, hd)     # [R * C, KV, hd]: the indexed dims lead
    return flat.at[layer, :, write_index.reshape(-1)].set(vals, mode="drop").reshape(pool.shape)


def _gpu_kernel(q, k_pages, v_pages, tables, lengths, ppb, k_splits, interpret):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention   # KERNEL_MODULES["gpu"]
    return paged_attention(q, k_pages, v_pages, tables, lengths, block_h=16, pages_per_compute_block=ppb,
                           k_splits=k_splits, interpret=interpret)


def _tpu_kernel(q, k_pages, v_pages, tables, lengths, ppb):
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention   # KERNEL_MODULES["tpu"]
    return paged_attention(q, k_pages, v_pages, lengths, tables, pages_per_compute_block=ppb)


def kernel_decode_attention(q, k_pool, v_pool, layer, block_tables, lengths, platform: str,
                            k_splits: int | None = None):
    """q [R, H, hd] (one token per row, already written to the pool); k_pool, v_pool the whole pool
    [L, KV, NB, bs, hd]; layer: the (traced) layer index; lengths = tokens to attend -> [R, H, hd].

    The pool is viewed, without a copy, as one KV head of L * KV * NB pages (a reshape), and each
    (row, KV head) pair becomes one kernel row whose block table is the row's, offset to that
    layer's and head's pages: the kernel reads the pages in place, whatever the layer. Its G = H / KV
    query heads are that row's group (head h uses KV head h // G, as in `gather_attention`).

    The table is read in the `kernel_layout` for its width: compute blocks, split-K (`k_splits`
    overrides the choice) and its padding. platform "gpu": jax's Triton kernel; "tpu": jax's Mosaic
    kernel. Lowered for another platform (CPU tests) it runs the GPU kernel in
    Pallas interpret mode."""
    L, KV, NB, bs, hd = k_pool.shape
    R, H, _ = q.shape
    G = H // KV
    lay = kernel_layout(block_tables.shape[1], R * KV, platform, k_splits)
    nb, ppb, k_splits = lay.width, lay.pages_per_block, lay.k_splits
    if nb > lay.pages:                                                    # entries past every row's length
        block_tables = jnp.pad(block_tables, ((0, 0), (0, nb - lay.pages)))
    qs = (q.astype(jnp.float32) * hd ** -0.5).astype(q.dtype)            # the kernels do not scale
    qs = qs.reshape(R * KV, G, hd)
    base = (layer * KV + jnp.arange(KV, dtype=jnp.int32)) * NB             # first page of (layer, head)
    tables = (block_tables[:, None, :].astype(jnp.int32) + base[None, :, None]).reshape(R * KV, nb)
    lens = jnp.repeat(lengths.astype(jnp.int32), KV)
    kp = k_pool.reshape(1, L * KV * NB, bs, hd)
    vp = v_pool.reshape(1, L * KV * NB, bs, hd)
    args = (qs, kp, vp, tables, lens)
    interp = functools.partial(_gpu_kernel, ppb=ppb, k_splits=k_splits, interpret=True)
    if platform == "tpu":
        tpu = functools.partial(_tpu_kernel, ppb=ppb)
        # every branch is traced: without jax's GPU (Triton) kernel, off a TPU it is not run anyway
        out = jax.lax.platform_dependent(*args, tpu=tpu, default=tpu if kernel_missing("gpu") else interp)
    else:
        gpu = functools.partial(_gpu_kernel, ppb=ppb, k_splits=k_splits, interpret=False)
        out = jax.lax.platform_dependent(*args, cuda=gpu, rocm=gpu, default=interp)
    return out.reshape(R, H, hd)
