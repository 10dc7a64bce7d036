"""The engine's device side (vLLM v1's "model runner"): it owns the paged KV pool, the choice of the
native CPU decode path, the shape buckets, the packing of scheduled work into host arrays, and every
jitted call. The loop (serve/engine.py) decides what runs; the scheduler never touches the device.

    runner = StepRunner(model_runner, registry, config, num_blocks)
    out = runner.run(runner.prefill_call(chunks))      # one prefill call, dispatched (asynchronous)
    step = runner.dispatch_decode(seqs)                # one decode call over the persistent decode rows
    step = runner.dispatch_decode(seqs, after=step)    # pipelined: input tokens stay on the device
    step = runner.dispatch_decode(seqs, handoff=(out, src))   # first tokens from a prefill not read yet
    host = to_host(step.out)                           # the one host transfer of a call
    token_entry(host, r, k), prompt_entry(host, r, j, k)   # decoding its log-prob arrays
    runner.sample_forks(logits, row, seqs, logprobs)   # n > 1: first tokens from one prefill's logits
    runner.copy_blocks(copies)                         # copy-on-write of shared partial blocks
    runner.cache_lost(); runner.reset_cache()          # after a failed call consumed the donated pool
    runner.compile_prefill / compile_decode / compile_forks   # warm-up (serve/warmup.py)

Every jitted step is a call object, `PrefillCall` or `DecodeCall` (its arguments, on the device but
for a decode call's host buffer; `rows`, `chunk` and `width` give its shape), run by `run(call)`; `add_call_hook(hook)` wraps
that (benchmarks record and replay the calls, tests inject faults) and `run_on(call, cache)` runs one
on any KV pool (a replay).

Decode rows are persistent (vLLM's persistent input batch): a running sequence keeps its decode row
from its first decode call until it leaves the batch, and `DecodeRows` keeps every row's inputs in
one int32 host buffer updated in place (its position, the block-table entries it gained, its token
index), not rebuilt from the sequences' lists each step. A decode call is that buffer in one
transfer (`decode_step` unpacks it on the device) plus the previous call's output tokens: a row
marked "from previous" takes its input token from the same row of that output, on the device, so a
pipelined call (`after=`) needs nothing from the host but the buffer.

Bank and KV pool are read when a call is built, never captured earlier: an adapter upload replaces
(donates) the bank and a failed call can replace the pool.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import logging
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from preft_jax import native_decode
from preft_jax import sharding as shd
from preft_jax.generation import ModelRunner
from preft_jax.paged_kv import PagedBatch, PagedKVCache, choose_attention
from preft_jax.paged_step import (bind_paged_step, bind_state, copy_blocks, decode_advance, paged_decode_steps, paged_step,
                                  sample_rows, step_out_shardings)
from serve.engine_config import EngineConfig
from serve.kv_blocks import NULL_BLOCK
from serve.registry import AdapterRegistry
from serve.scheduler import Chunk, Sequence

log = logging.getLogger("serve.step_runner")


def pow_buckets(lo: int, hi: int, base: int = 2) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= base
    out.append(hi)
    return sorted(set(out))


def bucket(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    return buckets[-1]


def to_host(out) -> dict:
    """A call's device output -> numpy arrays (tokens - [R], or [R, steps] for a fused decode call -
    and, when present, log-prob arrays)."""
    if isinstance(out, tuple):                       # a fused decode call: (tokens [R, steps], last [R])
        return {"tokens": np.asarray(out[0])}
    if not isinstance(out, dict):
        return {"tokens": np.asarray(out)}
    return {k: np.asarray(v) for k, v in out.items() if k != "logits"}


def token_entry(host: dict, r: int, k: int | None):
    """Row r's log-prob entry (logprob, [(id, logprob)] * k), or None when not asked for."""
    if k is None or "logprob" not in host:
        return None
    return (float(host["logprob"][r]),
            [(int(i), float(v)) for i, v in zip(host["top_ids"][r, :k], host["top_values"][r, :k])])


def prompt_entry(host: dict, r: int, j: int, k: int):
    """Row r's prompt log-prob entry at chunk position j: the prompt token at j + 1 given the ones before."""
    return (float(host["prompt_logprob"][r, j]),
            [(int(i), float(v)) for i, v in zip(host["prompt_top_ids"][r, j, :k], host["prompt_top_values"][r, j, :k])])


def _tokens_of(out):
    """A decode call's output -> its last tokens [R] (the next call's FROM_PREV input)."""
    if isinstance(out, tuple):                       # a multi-step call: (tokens [R, steps], last [R])
        return out[1]
    return out["tokens"] if isinstance(out, dict) else out


def sampling_columns(seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(temperature f32, top_p f32, top_k int64, key data uint32 [n, 2]) of `seqs`' requests."""
    n, sps = len(seqs), [s.req.sampling for s in seqs]
    return (np.fromiter([sp.temperature for sp in sps], np.float32, n),
            np.fromiter([sp.top_p for sp in sps], np.float32, n),
            np.fromiter([sp.top_k for sp in sps], np.int64, n),
            np.array([s.req.key_data for s in seqs], np.uint32).reshape(n, 2))


# Columns of a decode row in `DecodeRows.buffer` (int32; floats and key data stored as their bits),
# then the row's block table.
TOKEN, FROM_PREV, CONTEXT, CHUNK, PROMPT, ADAPTER, TOP_K, COUNTER, TEMPERATURE, TOP_P, KEY = range(11)
START = KEY + 2                  # an activated (aLoRA) row's activation start (0 for other rows)
BLOCKS = START + 1


def decode_batch(packed, attention: str, block_size: int, num_blocks: int) -> PagedBatch:
    """The `PagedBatch` of a decode call's rows buffer (`packed` [R, BLOCKS + width]): block tables,
    context lengths, chunk lengths, and each row's write index looked up from its block table at its
    context length (`decode_advance` by 0; a padding row - chunk length 0 - writes to the dropped
    index num_blocks * block_size)."""
    return decode_advance(PagedBatch(packed[:, BLOCKS:], packed[:, CONTEXT], packed[:, CHUNK], None, attention),
                          block_size, num_blocks, 0)


def _decode_steps(graphdef, state, packed, prev_tokens, cache, bank, native, *, attention: str, logprobs: bool,
                  steps: int):
    """One decode call given as its `DecodeRows` buffer (`packed` int32 [R, BLOCKS + width]) and the
    previous decode call's last output tokens [R] (rows marked FROM_PREV take theirs): `paged_step`,
    or with `steps` > 1 `paged_decode_steps` (that many steps in a device-side loop: positions,
    write indices and sampling counters advanced on the device; the caller names the blocks of
    every position the steps reach), returning ((tokens [R, steps], last tokens [R]), cache).
    Each row's write index is looked up on the device from its block table and context length
    (`decode_advance`; a padding row - chunk length 0 - writes nowhere): the host keeps no column
    of it, so a chain of calls moving its rows on touches no per-row block lookup on the host."""
    col = lambda c: packed[:, c]                                                 # noqa: E731
    bits = lambda c, dtype: jax.lax.bitcast_convert_type(packed[:, c], dtype)    # noqa: E731
    tokens = jnp.where(col(FROM_PREV) > 0, prev_tokens, col(TOKEN))[:, None]
    batch = decode_batch(packed, attention, cache.block_size, cache.num_blocks)
    args = (graphdef, state, tokens, batch, cache, bank, None if bank is None else col(ADAPTER), col(PROMPT),
            bits(TEMPERATURE, jnp.float32), bits(TOP_P, jnp.float32), col(TOP_K),
            (bits(slice(KEY, KEY + 2), jnp.uint32), col(COUNTER)))
    starts = None if bank is None else col(START)
    if steps == 1:
        return paged_step(*args, None, native, starts, logprobs=logprobs)
    toks, cache = paged_decode_steps(*args, starts, native, num_steps=steps)
    return (toks, toks[:, -1]), cache


@jax.jit
def handoff_tokens(prefill_tokens, src):
    """A decode call's input tokens [R] from a prefill call's sampled tokens [P] (not read by the
    host): decode row i takes prefill row src[i] (-1: none, 0; such a row's token comes from the host)."""
    return jnp.where(src >= 0, prefill_tokens[jnp.maximum(src, 0)], 0).astype(jnp.int32)


@functools.lru_cache(maxsize=16)
def decode_step(graphdef, mesh=None, k_spec=None, v_spec=None, state_tree=None):
    """`_decode_steps` jitted with the model's graph bound in (`bind_state`; with `state_tree` it
    takes the State's leaves): a static graphdef argument would be hashed whole at every dispatch
    (~0.1 ms per call for the tiny model, more with depth), an nnx State flattened in Python; here
    the graph is hashed once, when a runner asks for its function. On a mesh: tokens replicated,
    the donated pool kept in its declared sharding."""
    return jax.jit(bind_state(_decode_steps, graphdef, state_tree), static_argnames=("attention", "logprobs", "steps"),
                   donate_argnames=("cache",), **step_out_shardings(mesh, k_spec, v_spec))


@dataclasses.dataclass
class PrefillCall:
    """The arguments of one prefill `paged_step` call (chunks of C > 1 tokens per row): host (numpy)
    arrays, moved to the device by the call's dispatch (a replay may stage them there first)."""
    tokens: jax.Array                    # int32 [R, C]
    batch: PagedBatch
    bank: object                         # AdapterBank, or None: base weights
    adapter_ids: jax.Array               # int32 [R]
    prompt_lens: jax.Array               # int32 [R]
    sampling: tuple                      # per row: temperature, top_p, top_k, key data [R, 2], token index
    next_tokens: jax.Array | None = None  # int32 [R, C]: the prompt token each position predicts
    adapter_starts: jax.Array | None = None   # int32 [R]: activated (aLoRA) rows' activation starts
    logprobs: bool = False
    prompt_logprobs: bool = False
    return_logits: bool = True

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def chunk(self) -> int:
        return self.tokens.shape[1]

    @property
    def width(self) -> int:
        return self.batch.block_tables.shape[1]

    def arrays(self) -> tuple:
        return (self.tokens, self.batch, self.adapter_ids, self.prompt_lens, self.sampling, self.next_tokens,
                self.adapter_starts)


@dataclasses.dataclass
class DecodeCall:
    """The arguments of one decode call (one token per row): the rows' buffer (a host copy, moved by
    the call's dispatch) and the tokens of the decode call before, on the device (used by the rows
    marked FROM_PREV)."""
    packed: np.ndarray | jax.Array       # int32 [R, BLOCKS + width] (`DecodeRows` layout)
    prev_tokens: jax.Array               # int32 [R]
    bank: object                         # the adapter bank when a row's generated tokens use its adapter
                                         # (all-token or activated); else None (base weights)
    native: object                       # NativeWeights: the call runs natively (base weights only)
    attention: str
    logprobs: bool = False
    steps: int = 1                       # decode steps fused in the call (`_decode_steps`)
    chunk = 1

    @property
    def rows(self) -> int:
        return self.packed.shape[0]

    @property
    def width(self) -> int:
        return self.packed.shape[1] - BLOCKS

    def arrays(self) -> tuple:
        return self.packed, self.prev_tokens


StepCall = PrefillCall | DecodeCall


@dataclasses.dataclass
class DecodeStep:
    """A dispatched decode call: `seqs[i]` is row `rows[i]` of `out` (device arrays, not read yet),
    its first K/V written at `positions[i]` (then one further per step); `room` and `handout` are the
    caller's (the engine's per-row token budget and per-row handles, serve/handout.py)."""
    seqs: list[Sequence]
    rows: np.ndarray
    out: object
    positions: np.ndarray | None = None
    room: np.ndarray | None = None
    steps: int = 1                       # tokens per row (a multi-step call: `out` is (tokens [R, steps], last))
    handout: object = None


class DecodeRows:
    """The persistent decode batch: decode row -> running sequence, and every row's call inputs as
    numpy buffers. A free row is padding (no attention, its write dropped)."""

    def __init__(self, rows: int, max_blocks: int, block_size: int):
        self.size, self.block_size = rows, block_size
        self.buffer = np.zeros((rows, BLOCKS + max_blocks), np.int32)      # NULL_BLOCK == 0: empty tables
        b = self.buffer                                                      # views into it, by column
        self.tokens, self.from_prev, self.context_lens = b[:, TOKEN], b[:, FROM_PREV], b[:, CONTEXT]
        self.chunk_lens, self.prompt_lens = b[:, CHUNK], b[:, PROMPT]
        self.adapter_ids, self.adapter_starts = b[:, ADAPTER], b[:, START]
        self.top_k, self.counters = b[:, TOP_K], b[:, COUNTER]
        self.temperature, self.top_p = b[:, TEMPERATURE].view(np.float32), b[:, TOP_P].view(np.float32)
        self.key_data = b[:, KEY:KEY + 2].view(np.uint32)
        self.block_tables = b[:, BLOCKS:]
        self._pad(slice(None))
        self.row_of: dict[Sequence, int] = {}
        self._admitted = [0] * rows          # the admission a row was filled for (re-admission: refill)
        self._blocks = np.zeros(rows, np.int64)   # block-table entries written
        self._free = list(range(rows))       # a heap: the lowest free row first
        self.logprob_rows = 0                # rows that asked for log-probabilities
        self.adapted_rows = 0                # rows whose generated tokens use their adapter (slot pinned)
        self._indexed: tuple = (None, None)  # (rows array, its index: `_index`)

    def update(self, seqs: list[Sequence], ahead: int, handed: np.ndarray | None = None) -> tuple[np.ndarray, int, bool]:
        """Makes the rows hold exactly `seqs` at their next position (+ `ahead` tokens dispatched but
        not yet seen). `handed` (bool per sequence, with ahead 0): the sequence's input token is the
        output of a prefill call the host has not read (its computed positions already count the
        prompt, its tokens lack that first one). Returns (row of each sequence, block-table width
        needed, whether a row was filled).
        Per row only attribute reads in list comprehensions; the buffer is written column-wise (numpy),
        so a decode step's host cost grows slowly with its rows."""
        row_of, bs, admitted = self.row_of, self.block_size, self._admitted
        if len(row_of) != len(seqs) or any(s not in row_of for s in seqs):
            live = set(seqs)
            self.release_many([s for s in row_of if s not in live])
        rows_l = [row_of.get(s) for s in seqs]
        filled = None in rows_l or any(admitted[r] != s.admitted_at for r, s in zip(rows_l, seqs))
        if filled:                                         # new (or re-admitted) sequences: fill their rows
            new = []
            for i, s in enumerate(seqs):
                r = rows_l[i]
                if r is None or admitted[r] != s.admitted_at:
                    if r is not None:
                        self.release(s)
                    new.append(i)
            for i, r in zip(new, self._fill([seqs[i] for i in new])):
                rows_l[i] = r
        rows = np.array(rows_l, np.int32)
        pos = np.fromiter([s.num_computed for s in seqs], np.int64, len(seqs)) + ahead
        lens = np.fromiter([len(s.blocks) for s in seqs], np.int64, len(seqs))
        gained = np.flatnonzero(lens > self._blocks[rows])                # blocks gained since the last call
        if gained.size:
            self._extend_tables(rows[gained], [seqs[i] for i in gained.tolist()])
        b = pos // bs
        block = np.fromiter([s.blocks[j] for s, j in zip(seqs, b.tolist())], np.int64, len(seqs))
        self.block_tables[rows, b] = block                 # a copy-on-write replaces the written block
        self.context_lens[rows] = pos
        counters = np.fromiter([len(s.req.tokens) for s in seqs], np.int64, len(seqs)) + ahead
        self.from_prev[rows] = ahead                       # its token: the previous call's output
        if handed is not None:                             # its token: the prefill's output
            counters += handed
            self.from_prev[rows] = handed
            host = np.flatnonzero(~handed).tolist()
            self.tokens[rows[host]] = [seqs[i].tokens[q] for i, q in zip(host, pos[host].tolist())]
        elif not ahead:
            self.tokens[rows] = [s.tokens[q] for s, q in zip(seqs, pos.tolist())]
        self.counters[rows] = counters
        return rows, int(b.max(initial=0)) + 1, filled

    def advance(self, prev_seqs: list[Sequence], prev_rows: np.ndarray, keep: np.ndarray | None, by: int = 1,
                span: int = 1, positions: np.ndarray | None = None, reach: np.ndarray | None = None,
                grow: Callable[[list[Sequence], list[int]], list[bool]] | None = None,
                ) -> tuple[list[Sequence], np.ndarray, int, np.ndarray]:
        """`update(seqs, ahead=by)` for a pipelined call continuing the previous call (its sequences
        `prev_seqs` on rows `prev_rows`, from `update` or `advance`; `by`: the tokens it computes
        per row): the sequences where `keep` holds (None: all) move `by` positions on,
        column-wise (numpy; per-row Python only for a row whose table lacks a block of the `span`
        positions the call reaches), the others are released. `positions`: the caller's copy of
        the rows' new first positions (each row's context length + `by`), else read from the rows.
        `reach` (per previous row; None: each row's positions + `span`): the positions below it need
        a KV home; `grow(seqs, upto)` (the scheduler's allocation, e.g. `Scheduler.grow_many`) is
        asked for the rows whose tables lack a block below their reach, and a row it cannot grow
        leaves the call (released) as if `keep` had dropped it.
        Returns (the kept sequences, their rows, block-table width needed for `span` positions,
        their new positions; `prev_seqs` and `prev_rows` themselves when every row is kept).
        Valid only while nothing but this chain of calls changed the rows' sequences (no
        copy-on-write, no re-admission in between): the engine takes it between the calls of one
        pipelined chain and `update` everywhere else."""
        if keep is None or keep.all():                   # the common case: the chain goes on for every row
            seqs, rows = prev_seqs, prev_rows
        else:
            kept = keep.tolist()
            seqs = [s for s, k in zip(prev_seqs, kept) if k]
            self.release_many([s for s, k in zip(prev_seqs, kept) if not k and s in self.row_of])
            rows = prev_rows[keep]
            if positions is not None:
                positions = positions[keep]
            if reach is not None:
                reach = reach[keep]
        bs, at = self.block_size, self._index(rows)
        pos = self.context_lens[at].astype(np.int64) + by if positions is None else positions
        last = (pos + span - 1) // bs                                    # the last block the call reaches
        home = last if reach is None else (reach - 1) // bs              # the last block that needs a home
        short = np.flatnonzero(home >= self._blocks[at])                 # blocks not in the table yet
        if short.size:
            idx = short.tolist()
            if grow is not None:
                grown = grow([seqs[i] for i in idx], ((pos + span) if reach is None else reach)[short].tolist())
                if not all(grown):                                       # no block for them: they leave
                    stay = np.ones(len(seqs), bool)
                    stay[[i for i, ok in zip(idx, grown) if not ok]] = False
                    return self.advance(seqs, rows, stay, by, span, pos, reach)
            self._extend_tables(rows[short], [seqs[i] for i in idx])
        self.context_lens[at] = pos
        self.counters[at] += by
        self.from_prev[at] = 1
        return seqs, rows, int(last.max()) + 1 if len(last) else 1, pos

    def _extend_tables(self, rows: np.ndarray, seqs: list[Sequence]) -> None:
        """Writes the block-table entries the sequences `seqs` (on `rows`) gained since their tables
        were last written: per row for a few, one column write when many rows gained one block
        each (a batch whose positions enter a new block together)."""
        if len(seqs) > 4:
            have = self._blocks[rows]
            lens = np.fromiter([len(s.blocks) for s in seqs], np.int64, len(seqs))
            if (lens == have + 1).all():
                self.block_tables[rows, have] = [s.blocks[-1] for s in seqs]
                self._blocks[rows] = lens
                return
        for r, s in zip(rows.tolist(), seqs):
            blocks, have = s.blocks, int(self._blocks[r])
            self.block_tables[r, have:len(blocks)] = blocks[have:]
            self._blocks[r] = len(blocks)

    def _index(self, rows: np.ndarray):
        """`rows` as an index of the column views: a basic slice when they are r0 .. r0 + n - 1 in
        order (a batch admitted together; numpy views instead of a gather and a scatter per column),
        else the array. Kept for the array object a chain of calls passes along (`advance`)."""
        if self._indexed[0] is rows:
            return self._indexed[1]
        n = len(rows)
        at = slice(int(rows[0]), int(rows[0]) + n) if n and rows[-1] - rows[0] == n - 1 and (
            n < 3 or bool((rows[1:] > rows[:-1]).all())) else rows
        self._indexed = (rows, at)
        return at

    def _fill(self, seqs: list[Sequence]) -> list[int]:
        """Takes the lowest free rows for `seqs` and writes their per-request columns, column-wise."""
        rows = [heapq.heappop(self._free) for _ in seqs]
        for s, r in zip(seqs, rows):
            self.row_of[s] = r
            self._admitted[r] = s.admitted_at
        idx = np.array(rows, np.int64)
        n = len(seqs)
        self._blocks[idx] = 0
        self.chunk_lens[idx] = 1
        self.prompt_lens[idx] = np.fromiter([s.plen for s in seqs], np.int64, n)
        ids = np.fromiter([0 if s.ref is None else s.ref.slot for s in seqs], np.int64, n)   # PreFT: unpinned by now, so 0
        self.adapter_ids[idx] = ids
        self.adapter_starts[idx] = np.fromiter([s.adapter_start or 0 for s in seqs], np.int64, n)
        self.adapted_rows += int(np.count_nonzero(ids))
        self.temperature[idx], self.top_p[idx], self.top_k[idx], self.key_data[idx] = sampling_columns(seqs)
        self.logprob_rows += sum(s.req.sampling.logprobs is not None for s in seqs)
        return rows

    def _pad(self, rows) -> None:
        """Makes `rows` (an index of the buffer's rows) padding: chunk length 0 (no attention, no
        write), every column 0 but prompt length 1 and top_p 1."""
        self.buffer[rows] = 0
        self.prompt_lens[rows], self.top_p[rows] = 1, 1.0

    def release(self, s: Sequence) -> None:
        """Frees the sequence's row (padding from now on)."""
        self.release_many([s])

    def release_many(self, seqs: list[Sequence]) -> None:
        """Frees the rows of `seqs` (each holds one), column-wise: a batch whose requests end on the
        same call frees its rows in one write per column."""
        if not seqs:
            return
        rows = [self.row_of.pop(s) for s in seqs]
        self.logprob_rows -= sum(s.req.sampling.logprobs is not None for s in seqs)
        self.adapted_rows -= int(np.count_nonzero(self.adapter_ids[rows]))
        self._pad(rows)
        self._blocks[rows] = 0
        admitted, free = self._admitted, self._free
        for r in rows:
            admitted[r] = 0
            heapq.heappush(free, r)

    def clear(self) -> None:
        self.release_many(list(self.row_of))


class StepRunner:
    """See the module docstring. `mesh` comes with `model` (ModelRunner.with_mesh): the pool, the
    bank and every call are then placed by their declared logical axes (preft_jax.sharding.RULES)
    with explicit out_shardings, so the donated pool keeps its sharding (`cache_shardings`)."""

    def __init__(self, model: ModelRunner, registry: AdapterRegistry, config: EngineConfig, num_blocks: int):
        self.model, self.registry, self.config = model, registry, config
        self.num_blocks, self.block_size = num_blocks, config.block_size
        self.mesh = model.mesh
        cfg, bs = model.cfg, config.block_size
        self.drop_index = num_blocks * bs                   # a write here is dropped (padding)
        leaves, tree = jax.tree_util.tree_flatten(model.state)   # the calls take the State's leaves (`bind_state`):
        self._state_leaves = tuple(leaves)              # the weights are fixed for the runner's life (as the
                                                        # native CPU step's, packed once from them)
        self._step_fn = bind_paged_step(model.graphdef, state_tree=tree)
        self._decode_fn, self.cache_shardings = decode_step(model.graphdef, state_tree=tree), None
        no_prev = jax.devices()[0]                          # placed as a call's output tokens are
        if self.mesh is not None:
            abstract = jax.eval_shape(lambda: PagedKVCache.create(cfg, num_blocks, bs, model.dtype))
            self.cache_shardings = shd.cache_shardings(abstract, self.mesh, cfg)
            self._step_fn = bind_paged_step(model.graphdef, self.mesh, self.cache_shardings, tree)
            self._decode_fn = decode_step(model.graphdef, self.mesh, self.cache_shardings.k.spec,
                                          self.cache_shardings.v.spec, tree)
            no_prev = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            if registry.bank is not None:
                registry.place(shd.bank_shardings(registry.bank, self.mesh, cfg))
        self._no_prev = jax.device_put(np.zeros(config.max_num_seqs, np.int32), no_prev)   # no previous call
        self.cache = self.new_cache()
        self.decode_attention = choose_attention(cfg, bs)
        self.native = self._native_weights()
        max_blocks = -(-config.max_model_len // bs)
        self.block_buckets = pow_buckets(1, max_blocks)               # decode: every step, fine buckets
        self.prefill_block_buckets = pow_buckets(1, max_blocks, 4)    # prefill context: coarser
        self.prefill_row_buckets = pow_buckets(1, config.max_prefill_seqs, 4)
        self.chunk_buckets = pow_buckets(min(config.min_chunk, config.max_num_batched_tokens),
                                         min(config.max_num_batched_tokens, config.max_model_len))
        self.fork_buckets = pow_buckets(1, config.max_num_seqs)
        self.rows = DecodeRows(config.max_num_seqs, max_blocks, bs)
        self._run: Callable[[StepCall], object] = self._execute

    # ---- the KV pool and the native path ---------------------------------------------------
    def new_cache(self) -> PagedKVCache:
        """The paged KV pool, created in place on the mesh (never whole on one device first)."""
        cfg, nb, bs, dt = self.model.cfg, self.num_blocks, self.block_size, self.model.dtype
        if self.mesh is None:        # committed to its device, as every step's output pool is: warm-up
            # then compiles the very programs serving calls (an uncommitted pool is another signature)
            return jax.device_put(PagedKVCache.create(cfg, nb, bs, dt), jax.devices()[0])
        return jax.jit(lambda: PagedKVCache.create(cfg, nb, bs, dt), out_shardings=self.cache_shardings)()

    def cache_lost(self) -> bool:
        """Whether a failed call consumed the (donated) KV pool."""
        try:
            return self.cache.k.is_deleted() or self.cache.v.is_deleted()
        except Exception:  # noqa: BLE001
            return True

    def reset_cache(self) -> None:
        """A fresh pool; every decode row is freed (their sequences are recomputed)."""
        self.rows.clear()
        self.cache = self.new_cache()

    def _native_weights(self):
        """The packed weights of the native CPU decode step (preft_jax.native_decode), or None: "auto"
        takes it where it can serve (one CPU device, float32, a model whose every ModelConfig field it
        implements, the library builds), "native" requires it. With them, every base-weights decode
        call (base and PreFT engines) is one native call; prefill and all-token decode stay XLA's."""
        choice = self.config.cpu_decode
        if choice == "xla":
            return None
        why = (f"the default backend is {jax.default_backend()}" if jax.default_backend() != "cpu"
               else native_decode.unsupported_reason(self.model.cfg, self.model.dtype, self.mesh,
                                                         self.model.quantization))
        if why:
            if choice == "native":
                raise ValueError(f"cpu_decode='native' is unavailable: {why}")
            if not native_decode.logged_by_library(why):       # a failed build has its own WARNING line
                log.info("decode on the XLA path: %s", why)
            return None
        return native_decode.pack(nnx.merge(self.model.graphdef, self.model.state))

    # ---- calls -----------------------------------------------------------------------------
    def add_call_hook(self, hook: Callable[[StepCall, Callable[[StepCall], object]], object]) -> Callable[[], None]:
        """Wraps every `paged_step` call of this runner: hook(call, run) returns the call's output,
        normally run(call), or raises. Benchmarks record calls with it (and answer them from a
        recording, the device left out), tests inject failures. Returns the hook's removal (hooks
        come off in the reverse order of adding)."""
        inner = self._run

        def wrapped(call):
            return hook(call, inner)
        self._run = wrapped

        def remove() -> None:
            if self._run is not wrapped:
                raise RuntimeError("call hooks are removed in the reverse order of adding")
            self._run = inner
        return remove

    def run(self, call: StepCall):
        """Dispatches one call on this runner's pool (asynchronously): its device output."""
        return self._run(call)

    def _execute(self, call: StepCall):
        out, self.cache = self.run_on(call, self.cache)
        return out

    def run_on(self, call: StepCall, cache: PagedKVCache):
        """One call on `cache` (donated): (output, cache). The output is the sampled token ids, or a
        dict of device arrays (`paged_step`) when the call asks for log-probabilities or logits."""
        if isinstance(call, DecodeCall):
            with self.model.mesh_context():
                return self._decode_fn(self._state_leaves, call.packed, call.prev_tokens, cache, call.bank,
                                       call.native, attention=call.attention, logprobs=call.logprobs, steps=call.steps)
        temp, top_p, top_k, key_data, counters = call.sampling
        with self.model.mesh_context():
            return self._step_fn(
                self._state_leaves, call.tokens, call.batch, cache, call.bank,
                None if call.bank is None else call.adapter_ids, call.prompt_lens, temp, top_p, top_k,
                (key_data, counters), call.next_tokens, None, None if call.bank is None else call.adapter_starts,
                logprobs=call.logprobs, prompt_logprobs=call.prompt_logprobs, return_logits=call.return_logits)

    def sampling_rows(self, seqs, n: int):
        """(temperature, top_p, top_k, key data, token index) of `n` rows, the first from `seqs`; a
        row's token index is the number of tokens its request has generated."""
        temp, top_p, top_k = np.zeros(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.int32)
        key_data, counters = np.zeros((n, 2), np.uint32), np.zeros(n, np.int32)
        m = len(seqs)
        if m:
            temp[:m], top_p[:m], top_k[:m], key_data[:m] = sampling_columns(seqs)
            counters[:m] = np.fromiter([len(s.req.tokens) for s in seqs], np.int64, m)
        return temp, top_p, top_k, key_data, counters

    # ---- prefill ---------------------------------------------------------------------------
    def prefill_call(self, chunks: list[Chunk]) -> PrefillCall:
        """The call for this step's prefill chunks (rows, chunk length and context bucketed); its
        logits are returned too (forks sample from them)."""
        bs = self.block_size
        P = bucket(len(chunks), self.prefill_row_buckets)
        C = bucket(max(ch.length for ch in chunks), self.chunk_buckets)
        nb = bucket(max(1, max(-(-ch.start // bs) for ch in chunks)), self.prefill_block_buckets)
        logprobs = any(ch.completes_prompt and ch.seq.req.sampling.logprobs is not None for ch in chunks)
        prompt_logprobs = any(ch.seq.prompt_logprobs and ch.start + 1 < ch.seq.plen for ch in chunks)
        return self._prefill(chunks, P, C, nb, logprobs, prompt_logprobs)

    def _prefill(self, chunks: list[Chunk], P: int, C: int, nb: int, logprobs: bool, prompt_logprobs: bool):
        bs = self.block_size
        tokens = np.zeros((P, C), np.int32)
        ctx, clen, plen = np.zeros(P, np.int32), np.zeros(P, np.int32), np.ones(P, np.int32)
        widx = np.full((P, C), self.drop_index, np.int32)
        ids, starts = np.zeros(P, np.int32), np.zeros(P, np.int32)
        bt = np.full((P, nb), NULL_BLOCK, np.int32)
        next_tokens = np.zeros((P, C), np.int32) if prompt_logprobs else None   # the token each position predicts
        n = len(chunks)
        short = [ch.seq.req.request_id for ch in chunks if len(ch.seq.blocks) * bs < ch.start + ch.length]
        if short:                                  # never: the scheduler allocates before it plans a chunk
            raise RuntimeError(f"prefill chunks without KV blocks for all their positions: {short}")
        homes = np.zeros((n, max((len(ch.seq.blocks) for ch in chunks), default=0) + 1), np.int64)
        for r, ch in enumerate(chunks):
            s = ch.seq
            tokens[r, :ch.length] = s.tokens[ch.start:ch.start + ch.length]
            homes[r, :len(s.blocks)] = s.blocks
            if next_tokens is not None:
                nxt = s.tokens[ch.start + 1:ch.start + ch.length + 1]
                next_tokens[r, :len(nxt)] = nxt
        if n:                                      # per-row columns and write indices, column-wise
            seqs = [ch.seq for ch in chunks]
            ctx[:n] = np.fromiter([ch.start for ch in chunks], np.int64, n)
            clen[:n] = np.fromiter([ch.length for ch in chunks], np.int64, n)
            plen[:n] = np.fromiter([s.plen for s in seqs], np.int64, n)
            ids[:n] = np.fromiter([0 if s.ref is None else s.ref.slot for s in seqs], np.int64, n)
            starts[:n] = np.fromiter([s.adapter_start or 0 for s in seqs], np.int64, n)
            pos = ctx[:n, None].astype(np.int64) + np.arange(C)                     # [n, C]
            home = np.take_along_axis(homes, np.minimum(pos // bs, homes.shape[1] - 1), 1)
            widx[:n] = np.where(np.arange(C) < clen[:n, None], home * bs + pos % bs, self.drop_index)
            ctx_blocks = -(-ctx[:n, None] // bs)                                      # blocks before the chunk
            w = min(nb, homes.shape[1])
            bt[:n, :w] = np.where(np.arange(w) < ctx_blocks, homes[:, :w], NULL_BLOCK)
        samp = self.sampling_rows([ch.seq for ch in chunks], P)
        # host arrays: the jitted call's dispatch moves them (~0.1 ms for the lot; a jax.device_put of
        # the same 14 arrays first cost ~0.3-0.5 ms of host time per prefill call)
        return PrefillCall(tokens, PagedBatch(bt, ctx, clen, widx, "gather"), self.registry.bank, ids, plen, samp,
                           next_tokens=next_tokens, adapter_starts=starts, logprobs=logprobs,
                           prompt_logprobs=prompt_logprobs)

    # ---- decode ----------------------------------------------------------------------------
    def dispatch_decode(self, seqs: list[Sequence], after: DecodeStep | None = None,
                        handoff: tuple[object, np.ndarray] | None = None) -> DecodeStep:
        """One decode call for `seqs` (each at its next position), dispatched. With `after` (the
        previous decode call, not yet seen by the host; `seqs` a subset of its sequences) each row's
        input token is that call's output at the same row, and positions are one further. With
        `handoff` (a prefill call's output, not read yet, and per sequence its row there or -1)
        those sequences' input token is their row of that output (`handoff_tokens`, on the device),
        the others' comes from the host."""
        if handoff is not None:
            out, src = handoff
            rows, width, _ = self.rows.update(seqs, 0, src >= 0)
            by_row = np.full(self.rows.size, -1, np.int32)
            by_row[rows] = src
            with self.model.mesh_context():
                prev = handoff_tokens(_tokens_of(out), by_row)
            return self._dispatch(seqs, rows, width, None, prev=prev)
        rows, width, filled = self.rows.update(seqs, 0 if after is None else 1)
        if after is not None and filled:
            raise RuntimeError("a pipelined decode call can only continue the previous call's rows")
        return self._dispatch(seqs, rows, width, after)

    def continue_decode(self, after: DecodeStep, keep: np.ndarray | None, steps: int = 1,
                        positions: np.ndarray | None = None, reach: np.ndarray | None = None,
                        grow: Callable[[list[Sequence], list[int]], list[bool]] | None = None) -> DecodeStep | None:
        """`dispatch_decode(seqs, after=after)` for the sequences of `after` where `keep` (bool, one
        per sequence; None: every one) holds, as one call of `steps` fused decode steps: every kept
        row has a home for the positions whose tokens it may still use (a later position's write
        goes to no block of its own: dropped or into the reserved block, never read). The rows
        move on column-wise (`DecodeRows.advance`), no per-sequence reads; `positions`, when the
        caller has them: `after`'s rows' first positions in this call; `reach` and `grow`: the rows'
        KV homes, as for `DecodeRows.advance`. None when no row is kept."""
        seqs, rows, width, positions = self.rows.advance(after.seqs, after.rows, keep, after.steps, steps, positions,
                                                         reach, grow)
        if not seqs:
            return None
        return self._dispatch(seqs, rows, width, after, steps, positions=positions)

    def fused_steps(self) -> int:
        """Decode steps the next pipelined call may fuse (`EngineConfig.decode_steps_per_call`): 1
        while a row asks for log-probabilities (a fused call returns tokens only)."""
        return 1 if self.rows.logprob_rows else self.config.decode_steps_per_call

    def _dispatch(self, seqs, rows, width, after, steps: int = 1, prev=None, positions=None):
        if prev is None:
            prev = self._no_prev if after is None else _tokens_of(after.out)
        if positions is None:
            positions = self.rows.context_lens[rows].astype(np.int64)
        out = self.run(self._decode(self.rows, bucket(width, self.block_buckets), prev, steps))
        return DecodeStep(seqs, rows, out, positions, steps=steps)

    def _decode(self, rows: DecodeRows, nb: int, prev_tokens, steps: int = 1) -> DecodeCall:
        """The call over every decode row (block tables `nb` wide): one transfer of the rows' buffer,
        made by the jitted call's own dispatch (C++: ~25 us less per call than a `jax.device_put`
        first), of a copy (a transfer may read host memory after it returns: jax aliases numpy
        buffers on CPU, and the buffer changes before the next call).

        The bank goes with the call only when some row's generated tokens use its adapter (mode
        "all", or an activated (aLoRA) adapter): then every row runs the adapted program and the
        position policy leaves PreFT and base rows on the base weights; otherwise the call is the
        base-weights program (the native CPU step where it serves: a batch with such rows runs on XLA)."""
        bank = self.registry.bank if rows.adapted_rows > 0 else None
        return DecodeCall(rows.buffer[:, :BLOCKS + nb].copy(), prev_tokens, bank,
                          self.native if bank is None else None, self.decode_attention, rows.logprob_rows > 0, steps)

    # ---- parallel samples and block copies -------------------------------------------------
    def sample_forks(self, logits, row: int, seqs: list[Sequence], logprobs: bool, size: int | None = None):
        """First tokens of `seqs` drawn from row `row` of a prefill call's `logits` (device output)."""
        S = bucket(len(seqs), self.fork_buckets) if size is None else size
        temp, top_p, top_k, key_data, counters = self.sampling_rows(seqs, S)
        return sample_rows(logits, jnp.full(S, row, jnp.int32), jnp.asarray(temp), jnp.asarray(top_p),
                           jnp.asarray(top_k), jnp.asarray(key_data), jnp.asarray(counters), logprobs=logprobs)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Device copies of shared partial blocks (copy-on-write), padded to one shape (0 -> 0)."""
        src = np.zeros(self.config.max_num_seqs, np.int32)
        dst = np.zeros(self.config.max_num_seqs, np.int32)
        for i, (a, b) in enumerate(copies):
            src[i], dst[i] = a, b
        self.cache = copy_blocks(self.cache, jnp.asarray(src), jnp.asarray(dst))

    # ---- compiling every shape (serve/warmup.py) -------------------------------------------
    def prefill_buckets(self) -> list[tuple[int, int, int]]:
        """(rows, chunk length, block-table width) of every prefill call shape."""
        return [(P, C, nb) for P in self.prefill_row_buckets for C in self.chunk_buckets
                for nb in self.prefill_block_buckets]

    def compile_prefill(self, P: int, C: int, nb: int, logprobs: bool = False, prompt_logprobs: bool = False):
        """Runs the prefill program of this shape on padding rows (every write dropped), and with
        async scheduling the hand-off of its tokens to a decode call (`handoff_tokens`); returns its logits."""
        out = self.run(self._prefill([], P, C, nb, logprobs, prompt_logprobs))
        if self.config.num_scheduler_steps > 1:
            with self.model.mesh_context():
                jax.block_until_ready(handoff_tokens(_tokens_of(out), np.full(self.rows.size, -1, np.int32)))
        return jax.block_until_ready(out["logits"])

    def compile_decode(self, nb: int, logprobs: bool = False, adapted: bool = False, steps: int = 1) -> None:
        """Runs the decode program with `nb`-wide block tables on padding rows (the same program
        serves pipelined calls: their input tokens are an argument either way); `adapted`: the
        program with the adapter bank (rows whose generated tokens use their adapter); `steps`:
        that many decode steps fused in the call."""
        pad = DecodeRows(self.config.max_num_seqs, nb, self.block_size)
        pad.logprob_rows = int(logprobs)
        pad.adapted_rows = int(adapted and self.registry.bank is not None)
        jax.block_until_ready(self.run(self._decode(pad, nb, self._no_prev, steps)))

    def compile_forks(self, S: int, logits, logprobs: bool = False) -> None:
        """Runs the fork sampler for S samples from `logits` [P, V]."""
        jax.block_until_ready(self.sample_forks(logits, 0, [], logprobs, size=S))

    def compile_copies(self) -> None:
        """Runs the block-copy program (no copies: block 0 onto itself)."""
        self.copy_blocks([])
        jax.block_until_ready(self.cache.k)
