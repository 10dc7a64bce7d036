"""KV block pool: allocation, reference counts, prefix-cache hits and LRU eviction, and the rule
that decides when a block is shareable across adapters."""
import numpy as np
import pytest

from preft_jax.adapters.policy import PositionPolicy, adapted_windows
from serve.kv_blocks import NULL_BLOCK, BlockPool, NoFreeBlocks, block_hashes


def test_allocate_free_and_exhaustion():
    pool = BlockPool(5, 4)
    blocks = pool.allocate_many(4)
    assert NULL_BLOCK not in blocks and sorted(blocks) == [1, 2, 3, 4] and pool.num_available == 0
    with pytest.raises(NoFreeBlocks):
        pool.allocate()
    pool.free(blocks[:2])
    assert pool.num_available == 2
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([blocks[0]])


def test_prefix_hits_refcounts_and_lru_eviction():
    pool = BlockPool(4, 2)
    hs = block_hashes([1, 2, 3, 4, 5, 6], 2, windows=(), adapter_key=None)
    a = pool.allocate_many(3)
    for b, h in zip(a, hs):
        pool.register(b, h)
    assert pool.lookup(hs[0]) == a[0]                    # shared while the first owner runs
    pool.free(a)                                         # a[0] still referenced by the hit
    assert pool.num_available == 2 and pool.num_cached == 3
    pool.free([a[0]])
    assert pool.num_available == 3
    # evicted least recently used first: a's tail (freed in reverse) before its head
    fresh = pool.allocate()
    assert fresh == a[2] and pool.stats.evictions == 1 and pool.lookup(hs[2]) is None
    assert pool.lookup(hs[1]) == a[1] and pool.stats.hits == 2


def test_hashes_chain_and_adapter_taint():
    toks = list(range(12))
    base = block_hashes(toks, 4, windows=(), adapter_key=None)
    ka, kb = b"a\0w1", b"b\0w2"                      # adapter identities (AdapterRegistry.identity)
    # last_k=1 on a 12-token prompt: only position 11 is adapted -> blocks ending at 4 and 8 are base
    w = adapted_windows(PositionPolicy(last_k=1), toks)
    assert w == ((11, 12),)
    ha, hb = block_hashes(toks, 4, w, ka), block_hashes(toks, 4, w, kb)
    assert ha[:2] == base[:2] == hb[:2] and ha[2] != base[2] and ha[2] != hb[2]
    # first_k, unrestricted prefill and all-token adapt position 0: nothing is shared
    for p in (PositionPolicy(first_k=2), PositionPolicy(), PositionPolicy(mode="all")):
        assert block_hashes(toks, 4, adapted_windows(p, toks), ka)[0] != base[0]
    # a changed prefix changes every later hash (the identity's own tests: tests/test_adapter_registry.py)
    assert block_hashes([99] + toks[1:], 4, (), None)[2] != base[2]
    assert adapted_windows(None, toks) == ()


def test_a_block_hashes_which_of_its_positions_are_adapted():
    """Two sequences that adapt different positions of the same tokens never share a block - against
    the positions themselves: equal hashes <=> equal tokens and equal adapted positions up to the block's end."""
    toks = list(range(20, 36))
    key = b"k\0w"
    cases = {
        "prefill 8 (a turn's prompt)": adapted_windows(PositionPolicy(), toks[:8]),
        "prefill 12 (the next turn: the first turn's generated tokens now in the prompt)":
            adapted_windows(PositionPolicy(), toks[:12]),
        "last_k=3 of 8": adapted_windows(PositionPolicy(last_k=3), toks[:8]),
        "last_k=3 of 9": adapted_windows(PositionPolicy(last_k=3), toks[:9]),
        "activated from 0": ((0, 1 << 62),),
        "activated from 3": ((3, 1 << 62),),
        "all": adapted_windows(PositionPolicy(mode="all"), toks),
        "base": (),
    }
    hashes = {name: block_hashes(toks, 4, w, None if name == "base" else key) for name, w in cases.items()}

    def adapted_upto(w, end):
        return frozenset(t for a, b in w for t in range(a, min(b, end)))
    for x, wx in cases.items():
        for y, wy in cases.items():
            for blk in range(4):
                end = 4 * (blk + 1)
                same = adapted_upto(wx, end) == adapted_upto(wy, end)
                assert (hashes[x][blk] == hashes[y][blk]) == same, (x, y, blk)


def test_prefilling_sequences_that_hold_each_others_blocks_do_not_deadlock():
    """Two recomputes (after preemptions) prefilling at once, each holding blocks the other needs and
    the pool empty: the scheduler preempts the newest (it used to plan nothing, forever: only decode
    growth preempted). Every sequence then finishes its prompt, oldest first."""
    from preft_jax.config import tiny_config
    from preft_jax.sampling import SamplingParams
    from serve.registry import AdapterRegistry
    from serve.request import Request
    from serve.scheduler import DECODE, PREFILL, Scheduler, SchedulerConfig, Sequence

    pool = BlockPool(12, 4, enable_prefix_cache=False)              # 11 usable blocks
    sched = Scheduler(SchedulerConfig(4, 16, 2, 64, 4), pool, AdapterRegistry(tiny_config(), 0))
    seqs = []
    for i, (n, done, blocks) in enumerate([(33, 28, 7), (19, 16, 4)]):
        req = Request(f"r{i}", list(range(n)), None, SamplingParams(max_new_tokens=8), (-1,), ())
        s = Sequence(req, list(range(n)), n, status=PREFILL, num_computed=done, admitted_at=i + 1)
        s.blocks = pool.allocate_many(blocks)
        sched.running.append(s)
        seqs.append(s)
    assert pool.num_available == 0
    for _ in range(20):
        plan = sched.schedule(lambda s: True)
        assert plan.prefill or plan.preempted or plan.decode, "a step that plans nothing stalls for ever"
        for ch in plan.prefill:
            ch.seq.num_computed += ch.length
            if ch.completes_prompt:
                sched.prefill_done(ch.seq)
        for s in list(plan.decode):                                   # finished after its first token
            sched.remove(s)
        if all(s.status == DECODE or s not in sched.running and s not in sched.waiting for s in seqs):
            break
    assert seqs[0].status == DECODE and seqs[0].preemptions == 0      # the oldest never gave way
    assert seqs[1].preemptions == 1


def _simulate(seed: int, limit: int = 3000, blocks: int = 17, bs: int = 16):
    """Steps a Scheduler as the engine would (one client request arriving per step, prefill chunks and
    decode tokens applied, sequences leaving when done) over a pool far smaller than the workload;
    returns the step on which everything finished (None: not within `limit`)."""
    from preft_jax.config import tiny_config
    from preft_jax.sampling import SamplingParams
    from serve.registry import AdapterRegistry
    from serve.request import Request
    from serve.scheduler import DECODE, Scheduler, SchedulerConfig, Sequence

    rng = np.random.default_rng(seed)
    pool = BlockPool(blocks, bs, enable_prefix_cache=False)
    sched = Scheduler(SchedulerConfig(4, 64, 2, 1024, bs), pool, AdapterRegistry(tiny_config(), 0))
    arrivals = []
    for i in range(int(rng.integers(6, 12))):
        plen, gen = int(rng.integers(20, 160)), int(rng.integers(10, 45))
        gen = min(gen, (blocks - 1) * bs - plen)                  # each fits the pool alone
        req = Request(f"r{i}", list(range(plen)), None, SamplingParams(max_new_tokens=gen), (-1,), (), group=f"g{i}")
        arrivals.append(Sequence(req, list(range(plen)), plen))
    left = len(arrivals)
    for step in range(limit):
        if arrivals:
            sched.add(arrivals.pop(0))
        plan = sched.schedule(lambda s: True)
        for ch in plan.prefill:
            ch.seq.num_computed += ch.length
            if ch.completes_prompt:
                sched.prefill_done(ch.seq)
                ch.seq.tokens.append(7)                             # its first token
                ch.seq.req.tokens.append(7)
        for s in plan.decode:
            s.num_computed += 1
            s.tokens.append(7)
            s.req.tokens.append(7)
        for s in list(sched.running):
            if s.status == DECODE and len(s.req.tokens) >= s.req.sampling.max_new_tokens:
                sched.remove(s)
                left -= 1
        assert pool.num_available + sum(len(s.blocks) for s in sched.running) == pool.capacity
        if left == 0:
            return step
    return None


def test_a_small_pool_never_livelocks():
    """A pool far smaller than the workload (one request arriving per step, each from its own client):
    every request finishes. The scheduler used to livelock in most of these: a new request (favoured by
    fair_pick, holding no rows) took the blocks a running prefill needed, the next step stalled and
    preempted it, it was admitted again first and took the same blocks - for ever (found against a
    real server: 34k preemptions in 80 s, nothing finished). Now a running prefill takes the blocks
    that are left (a shorter chunk) and, after a stall, the running sequences go first."""
    stuck = [seed for seed in range(60) if _simulate(seed) is None]
    assert stuck == []


def _twin_schedulers(free_blocks: int, cached: int):
    """Two schedulers over identical pools: `cached` registered, unreferenced (evictable) blocks,
    then `free_blocks` of the rest allocated away so that many stay free."""
    from preft_jax.config import tiny_config
    from serve.registry import AdapterRegistry
    from serve.scheduler import Scheduler, SchedulerConfig
    out = []
    for _ in range(2):
        pool = BlockPool(40, 4)
        held = pool.allocate_many(cached)
        for i, b in enumerate(held):
            pool.register(b, bytes([i]))
        pool.free(held)                                   # evictable, LRU order kept
        pool.allocate_many(len(pool._free) - free_blocks)
        out.append(Scheduler(SchedulerConfig(8, 64, 4, 64, 4), pool, AdapterRegistry(tiny_config(), 0)))
    return out


@pytest.mark.parametrize("free_blocks,cached", [(30, 0), (6, 3), (4, 0), (0, 2)])
def test_grow_many_equals_one_grow_each(free_blocks, cached):
    """`Scheduler.grow_many` (one pool check, one allocation) against `grow` called per sequence in
    order on a twin pool: the same results, the same blocks to the same sequences, the same pool
    after - with room for all, with evictable blocks taken after the free ones, and short of blocks
    (the later sequences that still fit get theirs, as one grow each)."""
    import numpy as np
    from preft_jax.sampling import SamplingParams
    from serve.request import Request
    from serve.scheduler import Sequence
    rng = np.random.default_rng(free_blocks * 10 + cached)
    for trial in range(20):
        a, b = _twin_schedulers(free_blocks, cached)
        seqs = []
        for sched in (a, b):
            r2 = np.random.default_rng(trial)
            group = []
            for i in range(int(r2.integers(1, 9))):
                req = Request(f"r{i}", [1], None, SamplingParams(max_new_tokens=8), (), ())
                s = Sequence(req, [1], 1)
                s.blocks = [int(x) for x in r2.integers(100, 200, int(r2.integers(0, 3)))]
                group.append(s)
            seqs.append(group)
        upto = [len(s.blocks) * 4 + int(rng.integers(-3, 9)) for s in seqs[0]]
        got = a.grow_many(seqs[0], upto)
        want = [b.grow(s, u) for s, u in zip(seqs[1], upto)]
        assert got == want, (trial, upto)
        assert [s.blocks for s in seqs[0]] == [s.blocks for s in seqs[1]]
        assert list(a.pool._free) == list(b.pool._free) and list(a.pool._evictable) == list(b.pool._evictable)
        assert a.pool._ref == b.pool._ref and a.pool.stats == b.pool.stats


def test_remove_many_equals_one_remove_each():
    """`Scheduler.remove_many` (one pass over the running list) against `remove` per sequence in
    order on a twin scheduler: running and waiting sequences, and some in neither; the same lists
    and the same pool (free order, reference counts) after."""
    import numpy as np
    from preft_jax.sampling import SamplingParams
    from serve.request import Request
    from serve.scheduler import Sequence
    for trial in range(30):
        twins = _twin_schedulers(30, 0)
        picked = []
        for sched in twins:
            rng = np.random.default_rng(trial)
            all_seqs = []
            for i in range(int(rng.integers(3, 12))):
                req = Request(f"r{i}", [1], None, SamplingParams(max_new_tokens=8), (), ())
                s = Sequence(req, [1], 1)
                s.blocks = sched.pool.allocate_many(int(rng.integers(0, 3)))
                where = rng.integers(0, 3)
                (sched.running if where == 0 else sched.waiting if where == 1 else []).append(s)
                all_seqs.append(s)
            picked.append([all_seqs[i] for i in rng.permutation(len(all_seqs))[:int(rng.integers(0, len(all_seqs)))]])
        a, b = twins
        a.remove_many(picked[0])
        for s in picked[1]:
            b.remove(s)
        name = lambda seqs: [s.req.request_id for s in seqs]          # noqa: E731
        assert name(a.running) == name(b.running) and name(a.waiting) == name(b.waiting), trial
        assert list(a.pool._free) == list(b.pool._free) and a.pool._ref == b.pool._ref, trial
        assert all(s.blocks == [] for s in picked[0])
