"""Adapters inside the model: mixed-adapter batches, prefill-only vs all-token, ReFT positions.

Oracle: tests/reference_llama.py, a float64 full-sequence recompute where each token uses the
adapter its position policy says (prompt positions only in prefill mode).
"""
import jax.numpy as jnp
import numpy as np
import pytest

from adapter_factory import random_lora, random_reft
from preft_jax.adapters.bank import build_bank, empty_bank, set_slot
from preft_jax.adapters.config import LoraConfig, PositionPolicy, ReftConfig
from preft_jax.adapters.policy import token_adapter_index
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner, sequence_logits
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams
from reference_llama import random_params, reference_logits

pytestmark = pytest.mark.usefixtures("cheap_codegen")     # conftest: many small programs, run briefly

CFG = tiny_config()
ALL = PositionPolicy(mode="all")


@pytest.fixture(scope="module")
def base():
    params = random_params(CFG, seed=0)
    return params, ModelRunner(Llama.from_params(CFG, params))


def _policy_mask(policy, T, plen):
    t = np.arange(T)
    if policy.mode == "all":
        return np.ones(T, bool)
    m = t < plen
    if policy.first_k is None and policy.last_k is None:
        return m
    win = np.zeros(T, bool)
    if policy.first_k is not None:
        win |= t < policy.first_k
    if policy.last_k is not None:
        win |= t >= plen - policy.last_k
    return m & win


def _greedy_reference(params, prompt, slot, adapter, n_new):
    """Greedy decoding by full recompute each step, adapter masked by its policy."""
    loras = {slot: adapter} if hasattr(adapter, "A") and slot else {}
    refts = {slot: adapter} if hasattr(adapter, "R") and slot else {}
    seq, all_logits = list(prompt), []
    for _ in range(n_new):
        idx = np.where(_policy_mask(adapter.config.policy, len(seq), len(prompt)), slot, 0)[None]
        lg = reference_logits(CFG, params, np.asarray([seq]), idx, loras, refts)[0, -1]
        all_logits.append(lg)
        seq.append(int(np.argmax(lg)))
    return seq[len(prompt):], np.stack(all_logits)


def test_all_token_mixed_batch_logits_match_reference(base):
    params, runner = base
    adapters = [random_lora(CFG, 1, rank=4, policy=ALL), random_lora(CFG, 2, rank=2, targets=("q", "down"), policy=ALL),
                random_reft(CFG, 3, kind="loreft", policy=ALL), random_reft(CFG, 4, kind="direft", layers=(1,), policy=ALL)]
    bank = build_bank(CFG, adapters)
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (5, 9))
    ids = np.array([1, 2, 3, 4, 0])
    got = np.asarray(sequence_logits(runner.graphdef, runner.state, jnp.asarray(tokens), jnp.full(5, 9), bank,
                                     jnp.asarray(ids)))
    loras = {1: adapters[0], 2: adapters[1]}
    refts = {3: adapters[2], 4: adapters[3]}
    want = reference_logits(CFG, params, tokens, np.repeat(ids[:, None], 9, 1), loras, refts)
    base_logits = reference_logits(CFG, params, tokens)
    assert np.abs(want[:4] - base_logits[:4]).max() > 0.1        # adapters really change the output
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("adapter", [
    random_lora(CFG, 11, rank=4),
    random_reft(CFG, 12, kind="loreft"),
    random_reft(CFG, 13, kind="direft", policy=PositionPolicy(first_k=2, last_k=1)),
    random_reft(CFG, 14, kind="loreft", policy=PositionPolicy(last_k=3)),
    random_lora(CFG, 15, rank=4, policy=ALL),
], ids=["lora-prefill", "loreft-prefill", "direft-first2-last1", "loreft-last3", "lora-all"])
def test_generation_equals_masked_full_recompute(base, adapter):
    """Prefill-only: adapted prefill + base decode == recompute with the adapter on prompt positions."""
    params, runner = base
    bank = build_bank(CFG, [random_lora(CFG, 99, rank=2, targets=("v",)), adapter], capacity=3)
    prompts = [list(np.random.default_rng(s).integers(0, CFG.vocab_size, n)) for s, n in ((5, 7), (6, 4))]
    out = runner.generate(prompts, SamplingParams(max_new_tokens=6, stop_token_ids=(-1,)), bank=bank,
                          adapter_ids=[2, 0])
    want, _ = _greedy_reference(params, prompts[0], 2, adapter, 6)
    assert out[0].tokens == want
    base_want, _ = _greedy_reference(params, prompts[1], 0, adapter, 6)
    assert out[1].tokens == base_want
    # and the adapter matters for this prompt (else the test could not fail)
    none_want, _ = _greedy_reference(params, prompts[0], 0, adapter, 6)
    assert none_want != want


def test_prefill_only_logits_at_every_step(base):
    params, runner = base
    adapter = random_lora(CFG, 21, rank=4)
    bank = build_bank(CFG, [adapter])
    prompt = list(np.random.default_rng(8).integers(0, CFG.vocab_size, 6))
    gen = runner.generate([prompt], SamplingParams(max_new_tokens=5, stop_token_ids=(-1,)), bank=bank, adapter_ids=[1])
    seq = prompt + gen[0].tokens
    got = np.asarray(sequence_logits(runner.graphdef, runner.state, jnp.asarray([seq]), jnp.asarray([6]), bank,
                                     jnp.asarray([1])))[0]
    idx = np.where(np.arange(len(seq)) < 6, 1, 0)[None]
    want = reference_logits(CFG, params, np.asarray([seq]), idx, {1: adapter})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # the adapted model differs from the adapter applied to every token
    all_tok = reference_logits(CFG, params, np.asarray([seq]), np.ones((1, len(seq)), int), {1: adapter})[0]
    assert np.abs(all_tok[6:] - want[6:]).max() > 1e-2


def test_token_adapter_index_policies():
    bank = build_bank(CFG, [random_lora(CFG, 0, policy=PositionPolicy()),
                            random_lora(CFG, 1, policy=ALL),
                            random_reft(CFG, 2, policy=PositionPolicy(first_k=2, last_k=2))])
    pos = jnp.broadcast_to(jnp.arange(10), (4, 10))
    idx = np.asarray(token_adapter_index(bank, jnp.asarray([1, 2, 3, 0]), pos, jnp.asarray([6, 6, 7, 6])))
    assert idx[0].tolist() == [1] * 6 + [0] * 4
    assert idx[1].tolist() == [2] * 10
    assert idx[2].tolist() == [3, 3, 0, 0, 0, 3, 3, 0, 0, 0]
    assert idx[3].tolist() == [0] * 10


def test_set_slot_replaces_and_clears_at_run_time(base):
    params, runner = base
    a, b = random_lora(CFG, 31, rank=4, targets=("q", "v")), random_lora(CFG, 32, rank=2, targets=("q",))
    bank = empty_bank(CFG, 3, lora_targets=("q", "v"), lora_rank=4)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, CFG.vocab_size, (1, 8)))
    f = lambda bk: np.asarray(sequence_logits(runner.graphdef, runner.state, tokens, jnp.asarray([8]), bk, jnp.asarray([2])))
    base_logits = f(bank)
    with_b = f(set_slot(set_slot(bank, 2, a), 2, b))     # replaced: only b remains (rank 2 padded to 4)
    want = reference_logits(CFG, params, np.asarray(tokens), np.full((1, 8), 2), {2: b})
    np.testing.assert_allclose(with_b, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    np.testing.assert_allclose(f(set_slot(set_slot(bank, 2, a), 2, None)), base_logits, rtol=1e-6, atol=1e-6)


def test_bank_errors():
    bank = empty_bank(CFG, 2, lora_targets=("q",), lora_rank=2)
    with pytest.raises(ValueError, match="slot 0 is the base"):
        set_slot(bank, 0, random_lora(CFG, 0, targets=("q",), rank=2))
    with pytest.raises(ValueError, match="targets"):
        set_slot(bank, 1, random_lora(CFG, 0, targets=("k",), rank=2))
    with pytest.raises(ValueError, match="rank 4 exceeds"):
        set_slot(bank, 1, random_lora(CFG, 0, targets=("q",), rank=4))
    with pytest.raises(ValueError, match="without ReFT"):
        set_slot(bank, 1, random_reft(CFG, 0))
    with pytest.raises(ValueError, match="mode"):
        PositionPolicy(mode="decode")
    with pytest.raises(ValueError, match="first_k"):
        PositionPolicy(mode="all", first_k=2)
    with pytest.raises(ValueError, match="targets"):
        LoraConfig(rank=2, alpha=4, targets=("qkv",))
    with pytest.raises(ValueError, match="kind"):
        ReftConfig(rank=2, layers=(0,), kind="noreft")


def test_unknown_slot_in_generate_is_rejected(base):
    _, runner = base
    bank = build_bank(CFG, [random_lora(CFG, 0)])
    with pytest.raises(ValueError, match="slot indices"):
        runner.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), bank=bank, adapter_ids=[5])
