"""The persistent decode rows (serve/step_runner.py `DecodeRows`) against a reference that rebuilds
every row's inputs from the sequences' lists each call (what the engine did before the rows were
persistent): random joins, leaves, block growth, copy-on-write replacements, re-admissions after
preemption and pipelined (ahead) calls. Host-only: nothing is compiled."""
import numpy as np

from preft_jax.sampling import SamplingParams
from serve.request import Request
from serve.scheduler import Sequence
from serve.step_runner import BLOCKS, DecodeRows, decode_batch

R, MAX_BLOCKS, BS, NB = 6, 8, 4, 600      # NB: the pool's blocks (ids below it)


def _seq(rng, i) -> Sequence:
    plen = int(rng.integers(1, 10))
    sp = SamplingParams(temperature=float(rng.choice([0.0, 0.7])), top_p=float(rng.choice([1.0, 0.9])),
                        top_k=int(rng.integers(0, 5)), max_new_tokens=50, logprobs=[None, 3][i % 2])
    req = Request(f"r{i}", list(range(plen)), None, sp, (), (), key_data=rng.integers(0, 2 ** 32, 2, dtype=np.uint32))
    s = Sequence(req, rng.integers(0, 100, plen + 1).tolist(), plen)     # the prompt + its first token
    req.tokens.append(s.tokens[-1])
    s.num_computed, s.admitted_at = plen, 1000 + i
    s.blocks = rng.permutation(np.arange(1, 200))[:-(-(plen + 1) // BS)].tolist()
    return s


def _reference(seqs, rows, ahead, got, handed=None):
    """The row inputs built from scratch: the buffer a call must carry (padding rows zero, but for
    their prompt length 1 and top_p 1). A pipelined call's rows take their token from
    the previous call on the device: their host token is not read (copied from `got`); so do
    `handed` rows (a prefill's first token, not read: it is the token index + 1 the call samples)."""
    want = np.zeros((R, BLOCKS + MAX_BLOCKS), np.int32)
    want[:, 4], want[:, 9] = 1, np.float32(1.0).view(np.int32)
    for i, (s, r) in enumerate(zip(seqs, rows)):
        p = s.num_computed + ahead
        sp = s.req.sampling
        dev = ahead or (handed is not None and bool(handed[i]))
        want[r, :10] = [got[r, 0] if dev else s.tokens[p], int(dev), p, 1, s.plen, 0,
                        sp.top_k, len(s.req.tokens) + int(dev), np.float32(sp.temperature).view(np.int32),
                        np.float32(sp.top_p).view(np.int32)]
        want[r, 10:12] = s.req.key_data.view(np.int32)
        want[r, BLOCKS:BLOCKS + len(s.blocks)] = s.blocks
    return want


def _check_writes(rows, seqs, got_rows, ahead, where):
    """The write index the decode program derives from the buffer (`decode_batch`) against each
    sequence's own block at its position (a padding row: the dropped index NB * BS)."""
    want = np.full(R, NB * BS)
    for s, r in zip(seqs, got_rows):
        p = s.num_computed + ahead
        want[r] = s.blocks[p // BS] * BS + p % BS
    got = np.asarray(decode_batch(rows.buffer, "gather", BS, NB).write_index)[:, 0]
    np.testing.assert_array_equal(got, want, err_msg=where)


def test_decode_rows_equal_a_rebuild_from_the_sequences():
    rng = np.random.default_rng(0)
    rows = DecodeRows(R, MAX_BLOCKS, BS)
    pool = [_seq(rng, i) for i in range(12)]
    running: list[Sequence] = []
    fresh = 12
    for step in range(300):
        ahead = int(step % 3 == 2)                                    # a pipelined call now and then
        op = rng.integers(0, 5)
        idle = [s for s in pool if s not in running]
        if op == 0 and len(running) < R and idle:                     # a sequence joins (prefill done)
            running.append(idle[int(rng.integers(0, len(idle)))])
        elif op == 1 and running:                                     # one leaves (finished / preempted)
            running.remove(running[int(rng.integers(0, len(running)))])
        elif op == 2 and running:                                     # preempted and re-admitted: new blocks
            s = running[int(rng.integers(0, len(running)))]
            s.admitted_at, fresh = fresh + 1000, fresh + 1
            s.blocks = rng.permutation(np.arange(1, 200))[:len(s.blocks)].tolist()
        elif op == 3 and running:                                     # copy-on-write of the written block
            s = running[int(rng.integers(0, len(running)))]
            if (s.num_computed + ahead) // BS < len(s.blocks):
                s.blocks[(s.num_computed + ahead) // BS] = int(rng.integers(200, 300))
        seqs = list(running)
        if not seqs:
            continue
        # now and then some rows' tokens come from a prefill's output (async scheduling's hand-off)
        handed = rng.random(len(seqs)) < 0.5 if step % 3 == 1 else None
        for s in seqs:                                                # a home for the written position
            while len(s.blocks) * BS <= s.num_computed + ahead and len(s.blocks) < MAX_BLOCKS:
                s.blocks.append(int(rng.integers(300, 400)))
        got_rows, width, _ = rows.update(seqs, ahead, handed)
        assert len(set(got_rows.tolist())) == len(seqs) and width == max((s.num_computed + ahead) // BS + 1
                                                                         for s in seqs)
        np.testing.assert_array_equal(rows.buffer, _reference(seqs, got_rows, ahead, rows.buffer, handed),
                                      err_msg=f"step {step}")
        _check_writes(rows, seqs, got_rows, ahead, f"step {step}")
        assert rows.logprob_rows == sum(s.req.sampling.logprobs is not None for s in seqs)
        for s in seqs:                                                # the call's token, accounted
            if s.num_computed + 2 < MAX_BLOCKS * BS:
                s.num_computed += 1
                s.tokens.append(int(rng.integers(0, 100)))
                s.req.tokens.append(s.tokens[-1])
    rows.clear()
    np.testing.assert_array_equal(rows.buffer, _reference([], [], 0, rows.buffer))


def test_rows_stay_put_and_freed_rows_are_reused_lowest_first():
    rng = np.random.default_rng(1)
    rows = DecodeRows(R, MAX_BLOCKS, BS)
    a, b, c, d = (_seq(rng, i) for i in range(4))
    assert rows.update([a, b, c], 0)[0].tolist() == [0, 1, 2]
    assert rows.update([c, a], 1)[0].tolist() == [2, 0]              # b left: row 1 is padding now
    assert rows.buffer[1, 3] == 0 and rows.buffer[1, 4] == 1          # chunk length 0, prompt length 1
    assert rows.update([d, c, a], 0)[0].tolist() == [1, 2, 0]        # d takes the lowest free row


def test_advance_equals_a_rebuild_along_pipelined_chains():
    """`DecodeRows.advance` (the column-wise continuation of a pipelined chain) against the same
    from-scratch reference: chains of 1-6 continuations after an `update(.., 0)` call, rows leaving
    mid-chain (finished, out of room) and rows entering new blocks; the host sees each call's token
    one call late, as in the engine (a call's sequences are accounted after its successor is
    dispatched)."""
    rng = np.random.default_rng(2)
    rows = DecodeRows(R, MAX_BLOCKS, BS)
    pool = [_seq(rng, i) for i in range(12)]
    running: list[Sequence] = []
    checked = 0

    def account(seqs):                                              # a call's tokens reach the host
        for s in seqs:
            s.num_computed += 1
            s.tokens.append(int(rng.integers(0, 100)))
            s.req.tokens.append(s.tokens[-1])

    for chain in range(60):
        pool = [s if s.num_computed + 8 < MAX_BLOCKS * BS else _seq(rng, 100 + chain * R + i)   # spent: a new one
                for i, s in enumerate(pool)]
        idle = [s for s in pool if s not in running]
        while len(running) < R and idle and rng.random() < 0.7:    # joins between chains
            running.append(idle.pop(int(rng.integers(0, len(idle)))))
        running = [s for s in running if s.num_computed + 8 < MAX_BLOCKS * BS]
        if not running:
            continue
        for s in running:
            while len(s.blocks) * BS <= s.num_computed:
                s.blocks.append(int(rng.integers(300, 400)))
        seqs, ahead = list(running), 0
        got_rows, _, _ = rows.update(seqs, 0)
        np.testing.assert_array_equal(rows.buffer, _reference(seqs, got_rows, 0, rows.buffer))
        prev_seqs, prev_rows = seqs, got_rows
        for link in range(int(rng.integers(1, 7))):
            keep = rng.random(len(prev_seqs)) < 0.85                  # some rows leave the chain
            kept = [s for s, k in zip(prev_seqs, keep) if k]
            lacking = [s for s in kept if len(s.blocks) * BS <= s.num_computed + 1]
            if link % 2:                 # a home for the position it writes next (the engine's grow)
                for s in lacking:
                    s.blocks.append(int(rng.integers(400, 500)))
                got, new_rows, width, positions = rows.advance(prev_seqs, prev_rows, keep)
            else:                        # advance asks `grow` for the rows lacking one; some get none
                asked, failed = [], set()

                def grow(ss, upto):
                    asked.extend(zip(ss, upto))
                    for s in ss:
                        if rng.random() < 0.25:
                            failed.add(s)
                        else:
                            s.blocks.append(int(rng.integers(400, 500)))
                    return [s not in failed for s in ss]

                got, new_rows, width, positions = rows.advance(prev_seqs, prev_rows, keep, grow=grow)
                assert asked == [(s, s.num_computed + 2) for s in lacking]
                kept = [s for s in kept if s not in failed]
                assert all(s not in rows.row_of for s in failed)
            assert got == kept
            assert positions.tolist() == [s.num_computed + 1 for s in kept]   # the position each row writes
            np.testing.assert_array_equal(rows.buffer, _reference(kept, new_rows, 1, rows.buffer),
                                          err_msg=f"chain {chain} link {link}")
            _check_writes(rows, kept, new_rows, 1, f"chain {chain} link {link}")
            if kept:
                assert width == max((s.num_computed + 1) // BS + 1 for s in kept)
            account(prev_seqs)                    # then the host sees the previous call's tokens
            checked += len(kept)
            prev_seqs, prev_rows = kept, new_rows
            if not kept:
                break
        account(prev_seqs)                                           # the chain's last call
        running = [s for s in running if rng.random() < 0.8]         # some finish between chains
    assert checked > 300, checked


def test_rows_entering_blocks_together():
    """Every row at the same position (a batch admitted together), so all enter a new block on the
    same call (`_extend_tables`' column write), and now and then one row gains two blocks at once
    (the per-row path): `advance` and `update` against the from-scratch reference."""
    rng = np.random.default_rng(3)
    rows = DecodeRows(R, MAX_BLOCKS, BS)
    seqs = []
    for i in range(R):
        s = _seq(rng, i)
        s.num_computed = BS - 2                                       # all rows at one position
        s.tokens = s.tokens[:1] * 0 + rng.integers(0, 100, BS - 1).tolist()
        s.plen = BS - 2
        s.blocks = s.blocks[:1]
        seqs.append(s)
    got_rows, _, _ = rows.update(seqs, 0)
    prev_seqs, prev_rows = seqs, got_rows
    for link in range(3 * BS):
        two = link == BS + 1                                          # one row gets two blocks here
        for j, s in enumerate(prev_seqs):
            need = (s.num_computed + 1) // BS + 1 + (two and j == 0)
            while len(s.blocks) < min(need, MAX_BLOCKS):
                s.blocks.append(int(rng.integers(400, 500)))
        if link % 5 == 4:                                             # a fresh update between chains
            got_rows, _, _ = rows.update(prev_seqs, 1)
            np.testing.assert_array_equal(rows.buffer, _reference(prev_seqs, got_rows, 1, rows.buffer))
            _check_writes(rows, prev_seqs, got_rows, 1, f"update {link}")
        else:
            got, new_rows, width, _ = rows.advance(prev_seqs, prev_rows, None)
            assert got is prev_seqs
            np.testing.assert_array_equal(rows.buffer, _reference(got, new_rows, 1, rows.buffer),
                                          err_msg=f"link {link}")
            _check_writes(rows, got, new_rows, 1, f"link {link}")
            assert width == (got[0].num_computed + 1) // BS + 1
        for s in prev_seqs:
            s.num_computed += 1
            s.tokens.append(int(rng.integers(0, 100)))
            s.req.tokens.append(s.tokens[-1])
    keep = np.zeros(R, bool)
    keep[2] = True                                                    # five rows end on one call
    got, new_rows, _, _ = rows.advance(prev_seqs, prev_rows, keep)
    assert got == [prev_seqs[2]] and rows.logprob_rows == int(prev_seqs[2].req.sampling.logprobs is not None)
    np.testing.assert_array_equal(rows.buffer, _reference(got, new_rows, 1, rows.buffer))
    assert sorted(rows._free) == sorted(set(range(R)) - {int(new_rows[0])})
    assert rows.update([seqs[0]], 0)[0].tolist() == [0]               # the lowest free row again
