"""The position policy module: kinds, JSON and device encodings, the per-token mask (against a
brute-force per-position definition), the activation start (against a plain loop, PEFT's search),
the first adapted position and the serving override."""
import jax.numpy as jnp
import numpy as np
import pytest

from preft_jax.adapters import policy as pol
from preft_jax.adapters.policy import (MissingInvocationError, PolicyTable, PositionPolicy, activation_start,
                                       activation_starts, adapted_windows, decode_uses_adapters,
                                       last_occurrence, serving_policy, serving_table, slot_entry,
                                       token_adapter_index)

POLICIES = [PositionPolicy(), PositionPolicy(mode="all"), PositionPolicy(first_k=2), PositionPolicy(last_k=3),
            PositionPolicy(first_k=2, last_k=2), PositionPolicy(first_k=0), PositionPolicy(last_k=0),
            PositionPolicy(first_k=20, last_k=20), PositionPolicy.activated([7, 8, 9]),
            PositionPolicy.activated([5])]


def _adapted(policy, t, plen, prompt):
    """Whether position t of a sequence with prompt `prompt` (length plen) is adapted: the definition,
    one position at a time."""
    if policy.mode == "all":
        return True
    if policy.mode == "activated":
        inv = list(policy.invocation_tokens)
        starts = [s for s in range(plen - len(inv) + 1) if list(prompt[s:s + len(inv)]) == inv]
        return bool(starts) and t >= max(starts)
    if t >= plen:
        return False
    if policy.first_k is None and policy.last_k is None:
        return True
    return (policy.first_k is not None and t < policy.first_k) or (
        policy.last_k is not None and t >= plen - policy.last_k)


def _peft_last_occurrence(seq, inv):
    """HF PEFT's calculate_alora_offsets search, as a loop: the largest start of a full match."""
    best = -1
    for i, tok in enumerate(seq):
        if tok == inv[0] and i + len(inv) <= len(seq) and list(seq[i:i + len(inv)]) == list(inv):
            best = max(best, i)
    return None if best < 0 else best


def test_last_occurrence_matches_peft_search():
    rng = np.random.default_rng(0)
    for _ in range(300):
        seq = rng.integers(0, 4, rng.integers(0, 30)).tolist()
        inv = rng.integers(0, 4, rng.integers(1, 4)).tolist()
        assert last_occurrence(seq, inv) == _peft_last_occurrence(seq, inv), (seq, inv)
    assert last_occurrence([5, 5, 5], [5, 5]) == 1          # overlapping occurrences count
    assert last_occurrence([1, 2], [1, 2, 3]) is None


def test_token_adapter_index_equals_definition_every_kind_and_offset():
    """Prefill chunks at any offset and decode rows: one rule, per row, in one mixed batch."""
    rng = np.random.default_rng(1)
    table = PolicyTable.encode([PositionPolicy()] + POLICIES)
    for trial in range(6):
        B = len(POLICIES) + 1
        ids = np.arange(B)                                   # slot 0 (base) and every policy
        plens = rng.integers(4, 14, B)
        prompts = []
        for b, p in enumerate(POLICIES, start=1):
            prompt = rng.integers(0, 6, plens[b]).tolist()
            if p.mode == "activated":                        # invocation somewhere, maybe twice
                inv = list(p.invocation_tokens)
                for _ in range(1 + trial % 2):
                    at = int(rng.integers(0, plens[b] - len(inv) + 1))
                    prompt[at:at + len(inv)] = inv
            prompts.append(prompt)
        prompts.insert(0, rng.integers(0, 6, plens[0]).tolist())
        starts = activation_starts(table, ids, prompts)
        offset = int(rng.integers(0, 10))                    # a chunk starting at `offset`
        pos = offset + np.arange(12)[None].repeat(B, 0)
        got = np.asarray(token_adapter_index(table, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(plens),
                                             jnp.asarray(starts)))
        for b in range(B):
            for j, t in enumerate(pos[b]):
                want = b if b and _adapted(POLICIES[b - 1], int(t), int(plens[b]), prompts[b]) else 0
                assert got[b, j] == want, (POLICIES[b - 1] if b else "base", t, plens[b], prompts[b])


def test_without_starts_activated_rows_adapt_nothing():
    table = PolicyTable.encode([PositionPolicy(), PositionPolicy.activated([3])])
    pos = jnp.broadcast_to(jnp.arange(8), (1, 8))
    assert not np.asarray(token_adapter_index(table, jnp.asarray([1]), pos, jnp.asarray([5]))).any()


def test_activation_start_and_errors():
    p = PositionPolicy.activated([7, 8])
    assert activation_start(p, [1, 7, 8, 2, 7, 8, 3]) == 4
    with pytest.raises(MissingInvocationError) as e:
        activation_start(p, [1, 7, 2, 8], "'checker'")
    assert str(e.value) == (
        "the prompt (4 tokens) does not contain the invocation sequence [7, 8] of the activated (aLoRA) adapter "
        "'checker'; an activated adapter acts from the last occurrence of its invocation sequence in the prompt, "
        "so the prompt must contain it")
    with pytest.raises(ValueError, match="needs an activated policy"):
        activation_start(PositionPolicy(), [1])
    table = PolicyTable.encode([PositionPolicy(), PositionPolicy(), p])
    assert activation_starts(table, [0, 1], [[1], [2]]) is None            # no activated row
    np.testing.assert_array_equal(activation_starts(table, [2, 0, 2], [[7, 8], [1], [0, 7, 8, 1]]), [0, 0, 1])
    with pytest.raises(MissingInvocationError, match=r"\[7, 8\] of the activated \(aLoRA\) adapter in bank slot 2 "
                                                     r"\(prompt 1\);"):
        activation_starts(table, [2, 2], [[7, 8], [8, 7]])
    with pytest.raises(MissingInvocationError, match=r"adapter 'rewrite' \(prompt 0\);"):
        activation_starts(table, [2], [[8, 7]], names=["rewrite"])


def test_adapted_windows_agree_with_the_mask():
    """Host (prefix cache) and device (token mask) say the same: exactly which positions are adapted,
    prompt and generated ones, for every kind and prompt length."""
    rng = np.random.default_rng(2)
    extra = [PositionPolicy(first_k=2, last_k=2), PositionPolicy(first_k=0), PositionPolicy(first_k=5, last_k=4)]
    table = PolicyTable.encode([PositionPolicy()] + POLICIES + extra)
    for p_i, p in enumerate(POLICIES + extra, start=1):
        for plen in (1, 3, 6, 9, 16):
            prompt = rng.integers(0, 6, plen).tolist()
            if p.mode == "activated":
                if plen < len(p.invocation_tokens):
                    continue
                at = int(rng.integers(0, plen - len(p.invocation_tokens) + 1))
                prompt[at:at + len(p.invocation_tokens)] = list(p.invocation_tokens)
            starts = activation_starts(table, [p_i], [prompt])
            span = plen + 4
            idx = np.asarray(token_adapter_index(table, jnp.asarray([p_i]), jnp.arange(span)[None],
                                                 jnp.asarray([plen]), None if starts is None else jnp.asarray(starts)))
            want = set(np.flatnonzero(idx[0]).tolist())
            windows = adapted_windows(p, prompt)
            got = {t for a, b in windows for t in range(a, min(b, span))}
            assert got == want, (p, plen, windows)
            assert all(a < b for a, b in windows) and all(w[1] < v[0] for w, v in zip(windows, windows[1:]))
    assert adapted_windows(None, [1, 2, 3]) == ()
    assert adapted_windows(PositionPolicy(mode="all"), [1]) == ((0, pol.NEVER),)
    with pytest.raises(MissingInvocationError):
        adapted_windows(PositionPolicy.activated([9]), [1, 2])


def test_table_encoding_round_trip_and_write():
    table = PolicyTable.encode([PositionPolicy()] + POLICIES)
    assert table.n_slots == len(POLICIES) + 1 and table.max_invocation_tokens == 3
    assert table.invocation.shape == (len(POLICIES) + 1, 3)
    for s, p in enumerate(POLICIES, start=1):
        assert table.slot_policy(s) == p
    t2 = table.write(1, slot_entry(PositionPolicy.activated([4, 4]), table))
    assert t2.slot_policy(1) == PositionPolicy.activated([4, 4]) and t2.slot_policy(2) == POLICIES[1]
    assert np.asarray(t2.invocation)[1].tolist() == [4, 4, -1]
    with pytest.raises(ValueError) as e:
        slot_entry(PositionPolicy.activated([1, 2, 3, 4]), table)
    assert str(e.value) == ("invocation sequence of 4 tokens does not fit the adapter bank, which holds invocation "
                            "sequences of up to 3 tokens (build it with max_invocation_tokens >= 4)")
    assert decode_uses_adapters(table, [0, 1, 3]) is False               # base + prefill rows: base decode
    assert decode_uses_adapters(table, [0, 2]) and decode_uses_adapters(table, [9])   # all-token, activated


def test_serving_override():
    act = PositionPolicy.activated([3, 4])
    for mode in ("prefill", "all"):
        assert serving_policy(act, mode) == act                     # the adapter's own policy wins
    assert serving_policy(PositionPolicy(last_k=2), "prefill") == PositionPolicy(last_k=2)
    assert serving_policy(PositionPolicy(last_k=2), "all") == PositionPolicy(mode="all")
    assert serving_policy(PositionPolicy(mode="all"), "prefill") == PositionPolicy()
    table = PolicyTable.encode([PositionPolicy()] + POLICIES)
    for mode in ("prefill", "all"):
        got = serving_table(table, mode)
        want = PolicyTable.encode([PositionPolicy()] + [serving_policy(p, mode) for p in POLICIES])
        for a, b in zip((got.kind, got.first_k, got.last_k, got.invocation),
                        (want.kind, want.first_k, want.last_k, want.invocation)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_policy_validation_and_json():
    for p in POLICIES:
        assert pol.from_json(pol.to_json(p), "x") == p
    assert pol.to_json(PositionPolicy.activated((1, 2))) == {"mode": "activated", "first_k": None, "last_k": None,
                                                            "invocation_tokens": [1, 2]}
    assert PositionPolicy.activated(np.array([3, 4])).invocation_tokens == (3, 4)
    cases = [(dict(mode="decode"), "PositionPolicy.mode must be one of ('prefill', 'all', 'activated'), got 'decode'"),
             (dict(mode="activated"), "mode='activated' needs invocation_tokens: a non-empty sequence of token ids"),
             (dict(mode="activated", invocation_tokens=()), "mode='activated' needs invocation_tokens"),
             (dict(mode="activated", invocation_tokens=(1, -2)),
              "invocation_tokens must be token ids (integers >= 0), got [1, -2]"),
             (dict(mode="activated", invocation_tokens=(1, True)), "invocation_tokens must be token ids"),
             (dict(mode="prefill", invocation_tokens=(1,)),
              "invocation_tokens belong to mode='activated', not mode='prefill'"),
             (dict(mode="activated", invocation_tokens=(1,), last_k=1),
              "first_k/last_k apply to prompt positions; use mode='prefill' with them")]
    for kwargs, msg in cases:
        with pytest.raises(ValueError) as e:
            PositionPolicy(**kwargs)
        assert str(e.value).startswith(msg), str(e.value)
    with pytest.raises(ValueError) as e:
        pol.from_json({"mode": "activated", "invocation_tokens": "abc"}, "f.json")
    assert str(e.value) == "f.json: position policy invocation_tokens must be a list of token ids, got 'abc'"
    with pytest.raises(ValueError, match="f.json: invalid position policy: mode='activated' needs"):
        pol.from_json({"mode": "activated"}, "f.json")
