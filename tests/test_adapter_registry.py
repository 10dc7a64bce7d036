"""The adapter registry's two parts without an engine: the catalog (names, references, versions and
the identity the prefix cache keys on) and the adapter slots (pinning, LRU eviction, static banks,
mode switches). Bank contents are checked against a float64 recompute in tests/test_bank_writer.py."""
import numpy as np
import pytest

from adapter_factory import random_lora, random_reft
from preft_jax.adapters.bank import build_bank
from preft_jax.adapters.policy import PositionPolicy
from preft_jax.config import tiny_config
from serve.errors import AdapterInUseError, UnknownAdapterError
from serve.registry import AdapterRegistry, NoDeviceSlot, with_policy

CFG = tiny_config()


def _registry(capacity=2, **kw):
    return AdapterRegistry(CFG, capacity, lora_targets=("q", "v"), lora_rank=4, reft_rank=4, **kw)


def _ref(reg, name):
    ref = reg.acquire(name)
    assert reg.resolve(ref) is not None
    return ref


def test_identity_names_the_weights_and_the_policy():
    reg = _registry()
    w1, w2 = random_lora(CFG, 1, targets=("q",)), random_lora(CFG, 2, targets=("q",))
    reg.load("a", w1)
    r1 = _ref(reg, "a")
    assert reg.identity(r1).startswith(b"a\0") and reg.identity(None) is None
    assert reg.identity(_ref(reg, "a")) == reg.identity(r1)              # same version, same identity
    reg.release(r1)
    reg.release(reg.acquire("a"))
    with pytest.raises(AdapterInUseError, match=r"^adapter 'a' is used by 1 running or queued request\(s\); "
                                                r"retry when they finish$"):
        reg.unload("a")                                                  # the second _ref is still held
    other = _registry()
    other.load("a", w2)                                                  # new weights
    other.load("b", random_lora(CFG, 1, targets=("q",), policy=PositionPolicy(last_k=2)))   # w1, new policy
    ids = {reg.identity(r1), other.identity(_ref(other, "a")), other.identity(_ref(other, "b"))}
    assert len(ids) == 3
    everything = _registry(mode="all")
    everything.load("a", w1)
    ra = _ref(everything, "a")
    assert everything.policy(ra) == PositionPolicy("all") and everything.identity(ra) not in ids


def test_adapter_slots_pin_lru_and_unload():
    reg = _registry(capacity=2)
    for i, name in enumerate("abc"):
        reg.load(name, random_lora(CFG, i, targets=("q",)) if name != "b" else random_reft(CFG, i))
    ra, rb = _ref(reg, "a"), _ref(reg, "b")
    assert (reg.pin(ra), reg.pin(rb)) == (1, 2) and reg.pin(ra) == 1     # pinning twice is one pin
    rc = _ref(reg, "c")
    with pytest.raises(NoDeviceSlot, match=r"^all 2 device adapter slots are pinned$"):
        reg.pin(rc)
    reg.unpin(rb)
    reg.unpin(ra)                                                        # a was pinned first: the LRU slot
    assert reg.pin(rc) == 1 and reg.stats.device_evictions == 1
    assert reg.resident(rb) and not reg.resident(ra)
    assert reg.occupancy()["device_pinned"] == 1 and reg.occupancy()["device_resident"] == 2
    hits = reg.stats.device_hits
    assert reg.pin(rb) == 2 and reg.stats.device_hits == hits + 1       # still resident: a device hit
    for r in (ra, rb, rc):
        reg.unpin(r)                                 # the pin's owner (the engine's scheduler) unpins,
        reg.release(r)                               # then the request's reference is dropped
    assert reg.occupancy()["device_pinned"] == 0 and reg.in_use("b") == 0
    reg.unload("b")                                                      # its unpinned slot is emptied
    assert not reg.resident(rb) and reg.occupancy()["device_resident"] == 1
    with pytest.raises(UnknownAdapterError, match=r"^unknown adapter 'b' \(not registered; registered: a, c\)$"):
        reg.acquire("b")


def test_residency_index_agrees_with_the_slots_under_random_pins_unloads_and_mode_switches():
    """`resident` (a key -> slot index, O(1) per waiting request and step) equals a scan of the slots'
    keys after every operation of a random sequence of pins, unpins, reloads with new weights, unloads
    and mode switches; pin hits go by the index too, so a stale entry would pin the wrong weights."""
    rng = np.random.default_rng(0)
    reg = _registry(capacity=3)
    slots = reg.slots
    names, held, version = list("abcdef"), [], {}
    for n in names:
        version[n] = 0
        reg.load(n, random_lora(CFG, ord(n), targets=("q",)))

    def scan(ref):
        e = ref.entry
        return any(s.key == (e.name, e.digest) for s in slots._slots[1:])

    for step in range(300):
        op = rng.integers(6)
        if op <= 1:                                                   # a request pins its adapter
            ref = _ref(reg, names[rng.integers(len(names))])
            try:
                slot = reg.pin(ref)
                assert slots._slots[slot].key == (ref.entry.name, ref.entry.digest)
                held.append(ref)
            except NoDeviceSlot:
                reg.release(ref)
        elif op == 2 and held:                                       # a request ends
            ref = held.pop(rng.integers(len(held)))
            reg.unpin(ref)
            reg.release(ref)
        elif op == 3:                                                # new weights under a name not in use
            n = names[rng.integers(len(names))]
            if reg.in_use(n) == 0:
                reg.unload(n)
                version[n] += 1
                reg.load(n, random_lora(CFG, 1000 * version[n] + ord(n), targets=("q",)))
        elif op == 4:
            slots.set_mode("all" if step % 2 else "prefill")
        probes = [_ref(reg, n) for n in names] + held
        for ref in probes:
            assert reg.resident(ref) == scan(ref), (step, ref.name)
        for ref in probes[:len(names)]:
            reg.release(ref)
    assert set(slots._where.values()) <= set(range(1, 4))
    assert {k: i for i, s in enumerate(slots._slots) if i and (k := s.key) is not None} == slots._where


def test_prebuilt_bank_is_static_and_switches_mode():
    window = PositionPolicy(last_k=3)
    adapters = [random_lora(CFG, 1, targets=("q",), policy=window), random_lora(CFG, 2, targets=("q",))]
    reg = AdapterRegistry.from_bank(CFG, build_bank(CFG, adapters), ["x", "y"])
    rx, ry = _ref(reg, "x"), _ref(reg, "y")
    assert (reg.pin(rx), reg.pin(ry)) == (1, 2) and reg.stats.device_misses == 0
    assert reg.policy(rx) == window and reg.policy(ry) == PositionPolicy()
    reg.release(rx)
    reg.release(ry)
    reg.set_mode("all")
    assert [reg.bank.policy.slot_policy(i) for i in range(3)] == [PositionPolicy()] + [PositionPolicy("all")] * 2
    assert reg.policy(_ref(reg, "x")) == PositionPolicy("all")           # what the prefix cache sees too
    reg2 = AdapterRegistry.from_bank(CFG, build_bank(CFG, [with_policy(adapters[0], "all")]), ["x"], mode="all")
    reg2.set_mode("prefill")
    assert reg2.policy(_ref(reg2, "x")) == PositionPolicy()


def test_unload_in_use_drains_then_the_last_release_unloads():
    """DELETE's path without a server: an adapter held by a request drains (gone for new requests,
    the holder keeps it), the last release unloads it and frees its slot; the name loads again."""
    reg = _registry()
    reg.load("a", random_lora(CFG, 1, targets=("q",)))
    ref = reg.acquire("a")
    with pytest.raises(AdapterInUseError):
        reg.unload("a")                                  # without drain: refused while in use
    assert reg.unload("a", drain=True) == "draining"
    assert "a" not in reg and reg.draining() == {"a": 1}
    with pytest.raises(UnknownAdapterError):
        reg.acquire("a")                                 # new requests no longer find it
    with pytest.raises(AdapterInUseError):
        reg.load("a", random_lora(CFG, 2, targets=("q",)))   # still draining
    reg.release(ref)
    assert reg.draining() == {} and not any(reg.catalog.refs.values())
    reg.load("a", random_lora(CFG, 2, targets=("q",)))   # unloaded: the name is free again
    assert "a" in reg


def test_in_use_knows_what_acquire_knows(tmp_path):
    """An adapter that only its folder in adapter_dir provides is known before it reaches the host
    tier (`acquire` takes references on it; `in_use` once raised UnknownAdapterError there, e.g.
    right after a refused request released it while its load's callback had not run yet)."""
    from preft_jax.adapters.peft_io import save_peft_lora
    save_peft_lora(tmp_path / "late", random_lora(CFG, 3, targets=("q",)), CFG)
    reg = _registry(adapter_dir=tmp_path)
    assert reg.in_use("late") == 0                       # a folder, nothing loaded yet
    ref = reg.acquire("late")
    assert reg.in_use("late") == 1
    reg.release(ref)
    assert reg.in_use("late") == 0
    with pytest.raises(UnknownAdapterError):
        reg.in_use("nowhere")
