"""The model on every adapter backend (jnp, xla, pallas in interpret mode on CPU) equals the jnp backend:
teacher-forced logits, generation with mixed adapters in one batch (LoRA and ReFT, prefill-only and
all-token slots side by side, and a prefill-only batch whose decode is the base model), and adapter
gradients; and on every backend a bank slot holding NaN/Inf changes no other row's output."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from adapter_factory import random_lora, random_reft
from preft_jax.adapters.bank import build_bank
from preft_jax.adapters.config import PositionPolicy
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner, sequence_logits
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams
from reference_llama import random_params

pytestmark = pytest.mark.usefixtures("cheap_codegen")     # conftest: many small programs, run briefly

CFG = tiny_config(n_layers=2)
ALL = PositionPolicy(mode="all")
BACKENDS = ("jnp", "xla", "pallas")
# The in-model equality runs over xla too, marked slow: the fast loop keeps pallas here, and the xla
# backend's ops are compared with jnp by test_adapter_context.py's fast tests.
IN_MODEL = [pytest.param("xla", marks=pytest.mark.slow), "pallas"]
IDS = [1, 2, 3, 4, 0]                   # one row per slot: LoRA all, LoRA prefill, LoReFT all, DiReFT prefill, base
PLEN = [5, 3, 8, 2, 6]
_logits = jax.jit(sequence_logits, static_argnums=0)


@pytest.fixture(scope="module")
def runners():
    params = random_params(CFG, seed=0)
    return {b: ModelRunner(Llama.from_params(CFG, params, adapter_backend=b)) for b in BACKENDS}


@pytest.fixture(scope="module")
def bank():
    return build_bank(CFG, [random_lora(CFG, 1, rank=4, policy=ALL),
                            random_lora(CFG, 2, rank=2, targets=("q", "v", "down")),
                            random_reft(CFG, 3, layers=(1,), policy=ALL),
                            random_reft(CFG, 4, kind="direft", layers=(0, 1))])


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in PLEN]


def _tokens(prompts, T=8):
    out = np.zeros((len(prompts), T), np.int32)
    for i, p in enumerate(prompts):
        out[i, :len(p)] = np.asarray(p)[:T]
        out[i, len(p):] = np.arange(T - len(p)) + 7          # non-pad "response" tokens
    return jnp.asarray(out)


def _seq_logits(runner, bank, prompts):
    return np.asarray(_logits(runner.graphdef, runner.state, _tokens(prompts), jnp.asarray(PLEN), bank,
                              jnp.asarray(IDS)))


def _generate(runner, bank, prompts, ids=IDS):
    return [g.tokens for g in runner.generate(prompts, SamplingParams(max_new_tokens=5, stop_token_ids=(-1,)),
                                              bank=bank, adapter_ids=ids)]


def _poison(bank, slot=2):
    """The bank with slot `slot`'s LoRA and ReFT weights replaced by NaN / Inf."""
    nan_at = lambda x, v: x.at[:, slot].set(v)
    return dataclasses.replace(
        bank, lora_A={t: nan_at(a, jnp.nan) for t, a in bank.lora_A.items()},
        lora_B={t: nan_at(b, jnp.inf) for t, b in bank.lora_B.items()},
        reft_R=nan_at(bank.reft_R, jnp.inf), reft_W=nan_at(bank.reft_W, jnp.nan), reft_b=nan_at(bank.reft_b, jnp.nan))


@pytest.mark.parametrize("backend", IN_MODEL)
def test_logits_and_generation_equal_jnp_backend(runners, bank, prompts, backend):
    want = _seq_logits(runners["jnp"], bank, prompts)
    got = _seq_logits(runners[backend], bank, prompts)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    base = _seq_logits(runners["jnp"], None, prompts)
    assert all(np.abs(want[i] - base[i]).max() > 1e-2 for i in range(4))      # every adapter matters
    # mixed batch, prefill-only and all-token slots together: adapted prefill, decode with the bank
    assert _generate(runners[backend], bank, prompts) == _generate(runners["jnp"], bank, prompts)
    # prefill-only slots only: decode is the base model
    ids = [2, 4, 0, 2, 4]
    assert _generate(runners[backend], bank, prompts, ids) == _generate(runners["jnp"], bank, prompts, ids)


@pytest.mark.parametrize("backend", IN_MODEL)
def test_adapter_gradients_equal_jnp_backend(runners, bank, prompts, backend):
    tokens = _tokens(prompts)

    def loss(weights, runner):
        A, B, R, W, b = weights
        bk = dataclasses.replace(bank, lora_A=A, lora_B=B, reft_R=R, reft_W=W, reft_b=b)
        lg = sequence_logits(runner.graphdef, runner.state, tokens, jnp.asarray(PLEN), bk, jnp.asarray(IDS))
        return jnp.mean(jax.nn.log_softmax(lg)[..., 5])

    weights = (bank.lora_A, bank.lora_B, bank.reft_R, bank.reft_W, bank.reft_b)
    grad = lambda r: jax.jit(jax.grad(loss), static_argnums=1)(weights, r)
    want, got = grad(runners["jnp"]), grad(runners[backend])
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        w, g = np.asarray(w), np.asarray(g)
        assert np.abs(w).max() > 0
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_slot_does_not_corrupt_other_rows(runners, bank, prompts, backend):
    """NaN/Inf weights in slot 2 (LoRA and ReFT): rows on slots 0, 1, 3, 4 are bitwise unchanged,
    in teacher-forced logits (grouped layout) and in generation (grouped prefill, gathered decode)."""
    runner, bad = runners[backend], _poison(bank)
    others = [i for i, s in enumerate(IDS) if s != 2]
    clean, dirty = _seq_logits(runner, bank, prompts), _seq_logits(runner, bad, prompts)
    np.testing.assert_array_equal(dirty[others], clean[others])
    assert not np.isfinite(dirty[IDS.index(2)]).all()
    g_clean, g_dirty = _generate(runner, bank, prompts), _generate(runner, bad, prompts)
    assert [g_dirty[i] for i in others] == [g_clean[i] for i in others]
