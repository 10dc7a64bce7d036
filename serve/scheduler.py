"""The paged engine's scheduler: which tokens each step computes, within a token budget.

Per step (`schedule()`):
1. every running sequence whose prompt is done decodes one token (its next position's block is
   allocated; when the pool is exhausted the most recently admitted running sequence is preempted:
   its blocks are freed and it waits to be recomputed - prompt and generated tokens - later, so no
   request is lost, duplicated or corrupted);
2. the rest of `max_num_batched_tokens` goes to prefill chunks: sequences already prefilling
   continue, then waiting sequences are admitted while rows, blocks and device adapter slots last.
   Long prompts are cut into chunks, so decode keeps running while they are admitted; a chunk is
   cut to the blocks the pool has left. A step that would plan nothing while sequences run (all
   prefilling, none with a block for its next chunk) preempts the newest, and admits nothing more
   until a running sequence has used the blocks it freed, so sequences that hold each other's
   blocks never wait for ever and a preempted one cannot take its blocks back at once (a livelock).

Admission order: requests that have waited longer than `starvation_s` first (FCFS), then requests
whose adapter is already on the device (or the base model), then the others - grouping prefills by
adapter without starving anyone. A request whose adapter is still loading from disk never blocks the
queue behind it.

Prefix caching: on admission, the leading full blocks of a sequence's tokens are looked up by hash
(`kv_blocks.block_hashes`): tokens up to the block's end plus, when any of those positions is
adapted, the adapter's identity (weights digest + policy) and which of the block's positions it
adapted. After each step the newly completed full blocks are registered. Which positions are
adapted is the policy's (`adapted_windows`): the blocks before an activated (aLoRA) request's
activation start, or before a PreFT last_k window, are base blocks, shared with base requests and
across adapters; a block is reused by an adapted request only where the same positions were adapted
(a PreFT request's generated tokens ran on base weights, so a later turn that has them in its prompt
computes them again). The last prompt token is always computed (its logits sample the first token).

Device adapter slots: the scheduler is the one owner of pins. A sequence pins its adapter's device
slot when it is admitted (`_admit`); in PreFT mode ("prefill") it unpins when its prompt is done
(`prefill_done`: generated tokens run on the base weights); a sequence whose generated tokens use
its adapter (mode "all", or an activated (aLoRA) adapter in either mode) unpins when it leaves the
running set (`remove`, `preempt`). Forks of such a sequence pin their parent's slot (`fork`).

Parallel samples (`n` > 1): the n sequences of one prompt are prefilled once, by the first of them;
the other n - 1 wait in its `forks` (holding admission room for their rows) and join the running
set when its prefill ends (`fork`), sharing every prompt block by reference. A shared block that is
only partly filled (the prompt's last block, when the prompt length is not a multiple of the block
size) is copied on its first write (`copy_on_write`): each sequence gets its own copy before its
first generated token's K/V lands there, so no sequence ever writes into a block another reads.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections import deque

from preft_jax.adapters.policy import adapted_windows
from serve.kv_blocks import BlockPool, NoFreeBlocks, block_hashes
from serve.registry import AdapterRegistry, NoDeviceSlot
from serve.request import Request

WAITING, PREFILL, DECODE = "waiting", "prefill", "decode"


@dataclasses.dataclass(eq=False)
class Sequence:
    req: Request
    tokens: list[int]                    # prompt + generated (engine-side, what the KV cache holds)
    plen: int                            # prompt length (adapter positions are < plen in prefill mode)
    status: str = WAITING
    num_computed: int = 0                # tokens whose K/V are in the cache
    blocks: list[int] = dataclasses.field(default_factory=list)
    registered: int = 0                  # leading blocks already registered in the prefix cache
    admitted_at: int = 0                 # admission counter (preemption picks the newest)
    arrived: float = dataclasses.field(default_factory=time.monotonic)
    hashes: list[bytes] | None = None    # prefix hashes of full blocks (computed when admitted)
    adapted: tuple = ()                  # the adapter's adapted windows (`adapted_windows`), for the hashes
    adapter_start: int | None = None     # activated (aLoRA) adapter: where it starts acting (set by the engine
                                         # once the adapter version is resolved; 0 for other policies)
    preemptions: int = 0
    forks: list["Sequence"] = dataclasses.field(default_factory=list)   # n > 1: siblings waiting for its prefill
    prompt_logprobs: list | None = None  # per prompt position (entry 0 stays None), filled by prefill chunks

    @property
    def ref(self):
        return self.req.adapter_ref


@dataclasses.dataclass
class Chunk:
    seq: Sequence
    start: int                           # first position computed
    length: int                          # tokens computed this step
    completes_prompt: bool               # its last token's logits sample the next token


@dataclasses.dataclass
class StepPlan:
    decode: list[Sequence]
    prefill: list[Chunk]
    preempted: list[Sequence]
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)   # (src, dst) block copies first


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_seqs: int
    max_model_len: int
    block_size: int
    mode: str = "prefill"
    starvation_s: float = 2.0


def fair_pick(candidates: list, share: collections.Counter) -> int:
    """Index of the next prefill candidate ((sequence, is_new) pairs in priority order): the first
    one whose client request (`Request.group`) holds the fewest rows and chunks so far, so one
    request with many prompts or n > 1 cannot take every prefill row and token of consecutive
    steps while another request's prompt waits (round-robin between requests, FCFS within one)."""
    best, best_share = 0, None
    for i, (seq, _) in enumerate(candidates):
        n = share[seq.req.group]
        if best_share is None or n < best_share:
            best, best_share = i, n
            if n == 0:
                break
    return best


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, registry: AdapterRegistry):
        self.config, self.pool, self.registry = config, pool, registry
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []            # prefill + decode, in admission order
        self._admissions = 0
        self.preemptions = 0
        self._hold_admissions = False                # after a stall's preemption: running ones go first

    # ---- queue -----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drops a finished / cancelled / failed sequence: frees its blocks and its device pin."""
        try:                                  # one scan, not a membership test and then a removal
            self.running.remove(seq)
        except ValueError:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self._free(seq)

    def remove_many(self, seqs: list[Sequence]) -> None:
        """`remove` for each of `seqs`, in order: one pass over the running list for many (a batch
        whose requests end on the same call)."""
        if len(seqs) <= 2:
            for seq in seqs:
                self.remove(seq)
            return
        gone = set(seqs)
        kept = [s for s in self.running if s not in gone]
        if len(self.running) - len(kept) < len(gone):    # some are not running: waiting, or neither
            out = gone.difference(self.running)
            for seq in seqs:
                if seq in out:
                    try:
                        self.waiting.remove(seq)
                    except ValueError:
                        pass
        self.running[:] = kept
        for seq in seqs:
            self._free(seq)

    def _free(self, seq: Sequence) -> None:
        self.pool.free(seq.blocks)
        seq.blocks = []
        seq.registered = 0
        if seq.ref is not None and seq.ref.slot:
            self.registry.unpin(seq.ref)

    # ---- blocks ----------------------------------------------------------------------------
    def _blocks_needed(self, seq: Sequence, upto: int) -> int:
        return max(0, -(-upto // self.config.block_size) - len(seq.blocks))

    def grow(self, seq: Sequence, upto: int) -> bool:
        """Allocates blocks so positions < upto have a home; False when the pool is exhausted."""
        need = self._blocks_needed(seq, upto)
        if need <= 0:                     # the common decode case: the block has room
            return True
        if need > self.pool.num_available:
            return False
        seq.blocks.extend(self.pool.allocate_many(need))
        return True

    def grow_many(self, seqs: list[Sequence], upto: list[int]) -> list[bool]:
        """`grow(seqs[i], upto[i])` for each in order (the same blocks to the same sequences), with one
        pool check and one allocation when the pool has them all (a batch whose rows enter a new
        block together)."""
        need = list(map(self._blocks_needed, seqs, upto))
        total = sum(need)
        if total > self.pool.num_available:               # some fail: in order, as one grow each
            return [self.grow(s, u) for s, u in zip(seqs, upto)]
        blocks = iter(self.pool.allocate_many(total))
        for s, n in zip(seqs, need):
            if n:
                s.blocks.extend(itertools.islice(blocks, n))
        return [True] * len(seqs)

    def copy_on_write(self, seq: Sequence, pos: int) -> tuple[int, int] | None:
        """Before position `pos` is written: if its block is shared (a fork's partial prompt block),
        gives `seq` a private block and returns (src, dst) for the device copy; None otherwise.
        Raises NoFreeBlocks when the pool has no block left (the caller preempts or waits)."""
        i = pos // self.config.block_size
        if i >= len(seq.blocks) or self.pool.refcount(seq.blocks[i]) <= 1:
            return None
        src = seq.blocks[i]
        dst = self.pool.allocate()
        self.pool.free([src])
        seq.blocks[i] = dst
        if seq.registered > i:
            seq.registered = i
        return src, dst

    def _adapts_generated(self, seq: Sequence) -> bool:
        """Whether the sequence's generated tokens use its adapter (all-token or activated policy):
        then its device slot stays pinned while it decodes."""
        return seq.ref is not None and self.registry.policy(seq.ref).adapts_generated

    def prefill_done(self, seq: Sequence) -> None:
        """The sequence's prompt is computed: it decodes next. PreFT: its adapter's device slot is
        free again (generated tokens run on the base weights)."""
        seq.status = DECODE
        if seq.ref is not None and not self._adapts_generated(seq):
            self.registry.unpin(seq.ref)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` (a sibling of `parent`, same prompt) joins the running set sharing the parent's
        computed blocks and its adapter version; it decodes next (an all-token or activated adapter:
        on the parent's pinned slot, pinned again for the child)."""
        if child.ref is not None:
            child.ref.entry = parent.ref.entry           # the same adapter version as the prefill
        self.pool.share(parent.blocks)
        child.blocks = list(parent.blocks)
        child.num_computed = parent.num_computed
        child.registered = parent.registered
        child.hashes = parent.hashes
        child.adapted = parent.adapted
        child.adapter_start = parent.adapter_start
        child.status = DECODE
        self._admissions += 1
        child.admitted_at = self._admissions
        self.running.append(child)
        if self._adapts_generated(child):
            self.registry.pin(child.ref)                  # the parent's slot: pinned, so a hit

    def rows_reserved(self) -> int:
        """Running rows plus those held for forks still waiting for their parent's prefill."""
        return len(self.running) + sum(len(s.forks) for s in self.running)

    def preempt(self, seq: Sequence) -> None:
        """Back to the front of the queue; its tokens (prompt + generated) are recomputed later."""
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed = 0
        seq.status = WAITING
        seq.hashes = None
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    # ---- prefix cache ----------------------------------------------------------------------
    def _identity_and_windows(self, seq: Sequence):
        """(adapter identity or None, the positions it adapts: `adapted_windows`) for the hashes."""
        ref = seq.ref
        if ref is None:
            return None, ()
        return self.registry.identity(ref), adapted_windows(self.registry.policy(ref), seq.tokens[:seq.plen])

    def _lookup_prefix(self, seq: Sequence) -> None:
        """Takes cached blocks for the sequence's leading full blocks (never its last token's block;
        none when the request wants log-probabilities of its prompt tokens: they are computed)."""
        bs = self.config.block_size
        usable = (len(seq.tokens) - 1) // bs          # the last token must be computed
        if seq.req.sampling.prompt_logprobs is not None:
            usable = 0
        if not self.pool.enable_prefix_cache:         # nothing to look up or register: no hashes
            self.pool.count_miss(usable)
            seq.blocks, seq.registered, seq.num_computed = [], 0, 0
            return
        key, seq.adapted = self._identity_and_windows(seq)
        seq.hashes = block_hashes(seq.tokens, bs, seq.adapted, key)
        hits = []
        for h in seq.hashes[:usable]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        cacheable = min(usable, len(seq.hashes))
        self.pool.count_miss(cacheable - len(hits))
        seq.blocks = hits
        seq.registered = len(hits)
        seq.num_computed = len(hits) * bs

    def register_computed(self, seq: Sequence) -> None:
        """Registers the sequence's newly completed full blocks in the prefix cache."""
        bs = self.config.block_size
        full = seq.num_computed // bs
        if full <= seq.registered or not self.pool.enable_prefix_cache:
            return
        if seq.hashes is None or len(seq.hashes) < full:
            key, seq.adapted = self._identity_and_windows(seq)
            seq.hashes = block_hashes(seq.tokens, bs, seq.adapted, key)
        for i in range(seq.registered, min(full, len(seq.hashes))):
            self.pool.register(seq.blocks[i], seq.hashes[i])
        seq.registered = min(full, len(seq.hashes))

    # ---- the plan --------------------------------------------------------------------------
    def schedule(self, adapter_ready) -> StepPlan:
        """adapter_ready(seq) -> bool: the sequence's adapter is loaded (host tier) and can be pinned."""
        c = self.config
        budget = c.max_num_batched_tokens
        self._copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []
        decode: list[Sequence] = []
        gone: set[int] = set()                    # ids of the sequences preempted by this loop
        for seq in list(self.running):
            if seq.status != DECODE or id(seq) in gone:
                continue
            while not self.grow(seq, seq.num_computed + 1):
                victim = self.running[-1]
                self.preempt(victim)
                preempted.append(victim)
                gone.add(id(victim))
                if victim is seq:
                    break
            if id(seq) not in gone and self._private_block(seq, preempted):
                decode.append(seq)
            gone.update(id(v) for v in preempted)
        budget -= len(decode)
        prefill: list[Chunk] = []
        continuing = [s for s in self.running if s.status == PREFILL]
        candidates = [(s, False) for s in continuing] + [(s, True) for s in self._admission_order(adapter_ready)]
        share = collections.Counter(s.req.group for s in self.running)   # rows each client request holds
        # After a stall (below) the running sequences take the freed blocks before anything is admitted:
        # else the sequence just preempted is admitted again first (fair_pick favours a request holding
        # no rows), takes back the same blocks, and the stall repeats for ever while nothing finishes.
        admitting = not (self._hold_admissions and (decode or continuing))
        reserved = self.rows_reserved()           # kept up to date below (not recounted per admission)
        progressed = bool(decode)                 # a running sequence moves this step
        while candidates and budget > 0 and len(prefill) < c.max_prefill_seqs:
            i = fair_pick(candidates, share)
            seq, new = candidates.pop(i)
            if new:
                if not admitting or reserved + 1 + len(seq.forks) > c.max_num_seqs:
                    admitting = False             # FCFS between the requests that wait: none jumps this one
                    continue
                if not self._admit(seq):
                    admitting = False
                    continue
                reserved += 1 + len(seq.forks)
            chunk = self._chunk(seq, budget)
            if chunk is None:                     # no block for even one token: undo, try later
                if new:
                    self._unadmit(seq)
                    admitting = False
                continue
            prefill.append(chunk)
            budget -= chunk.length
            progressed = progressed or not new
            share[seq.req.group] += 1 + (len(seq.forks) if new else 0)   # an admitted prompt's forks hold rows too
        self._hold_admissions = self._hold_admissions and not progressed
        if not decode and not prefill and self.running:
            # A stall: every running sequence is prefilling and the pool has no block for any of their
            # next chunks, e.g. two recomputes after preemptions each holding what the other needs.
            # The newest gives its blocks back (recompute) and admissions wait until a running sequence
            # has used them (`_hold_admissions`).
            victim = self.running[-1]
            self.preempt(victim)
            preempted.append(victim)
            self._hold_admissions = True
        return StepPlan(decode, prefill, preempted, self._copies)

    def _private_block(self, seq: Sequence, preempted: list) -> bool:
        """Copy-on-write of the block this step's decode writes into; preempts like `grow` when the
        pool is out of blocks. False when `seq` itself was preempted."""
        while True:
            try:
                cp = self.copy_on_write(seq, seq.num_computed)
                break
            except NoFreeBlocks:
                victim = self.running[-1]
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    return False
        if cp is not None:
            self._copies.append(cp)
        return True

    def _admission_order(self, adapter_ready) -> list[Sequence]:
        now = time.monotonic()
        starving, resident, others = [], [], []          # one pass, arrival order kept in each
        for s in self.waiting:
            if s.req.finished or not adapter_ready(s):
                continue
            if now - s.arrived > self.config.starvation_s:
                starving.append(s)
            elif s.ref is None or s.ref.slot or self.registry.resident(s.ref):
                resident.append(s)
            else:
                others.append(s)
        return starving + resident + others

    def _admit(self, seq: Sequence) -> bool:
        if seq.ref is not None and seq.ref.slot == 0:
            try:
                self.registry.pin(seq.ref)
            except NoDeviceSlot:
                return False
        self._lookup_prefix(seq)
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = PREFILL
        self._admissions += 1
        seq.admitted_at = self._admissions
        return True

    def _unadmit(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed = 0
        seq.status = WAITING
        seq.hashes = None
        self.waiting.appendleft(seq)

    def _chunk(self, seq: Sequence, budget: int) -> Chunk | None:
        """The sequence's next prefill chunk within `budget` tokens, cut to the blocks it holds and the
        pool has left (None: not one token fits)."""
        remaining = len(seq.tokens) - seq.num_computed
        room = (len(seq.blocks) + self.pool.num_available) * self.config.block_size - seq.num_computed
        n = min(remaining, budget, room)
        if n <= 0 or not self.grow(seq, seq.num_computed + n):
            return None
        return Chunk(seq, seq.num_computed, n, seq.num_computed + n == len(seq.tokens))

    def fits_ever(self, total_tokens: int) -> bool:
        """Whether a sequence of `total_tokens` can ever be held by the pool."""
        return -(-total_tokens // self.config.block_size) <= self.pool.capacity

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
