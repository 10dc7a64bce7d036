"""The real SmolLM2-135M weights: logits match HF transformers; cached greedy == no-cache greedy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from preft_jax.generation import ModelRunner, sequence_logits
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams

pytestmark = [pytest.mark.real_model, pytest.mark.hf_reference]


@pytest.fixture(scope="module")
def runner(default_model):
    cfg, params, _ = default_model
    return ModelRunner(Llama.from_params(cfg, params))


_logits = jax.jit(sequence_logits, static_argnums=0)


def test_logits_match_transformers(runner, default_model, hf_reference):
    import torch
    _, _, tok = default_model
    hf_model, _ = hf_reference
    chat = tok.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}])
    rand = np.random.default_rng(0).integers(0, runner.cfg.vocab_size, 30).tolist()
    for ids in (chat, rand):
        got = np.asarray(_logits(runner.graphdef, runner.state, jnp.asarray([ids]), jnp.asarray([len(ids)])))[0]
        with torch.no_grad():
            want = hf_model(torch.tensor([ids])).logits[0].numpy()
        rel = np.abs(got - want).max() / np.abs(want).max()
        assert rel < 1e-3, rel
        assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.98


@pytest.mark.slow
def test_greedy_generation_matches_no_cache_recompute_and_hf(runner, default_model, hf_reference):
    import torch
    _, _, tok = default_model
    hf_model, _ = hf_reference
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = runner.generate([prompt], SamplingParams(max_new_tokens=12))[0]
    assert "Paris" in tok.decode(out.tokens)
    seq = list(prompt) + out.tokens
    full = np.asarray(_logits(runner.graphdef, runner.state, jnp.asarray([seq]), jnp.asarray([len(prompt)])))[0]
    assert full[len(prompt) - 1:len(seq) - 1].argmax(-1).tolist() == out.tokens
    with torch.no_grad():
        hf_out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=len(out.tokens), do_sample=False)
    hf_tokens = hf_out[0, len(prompt):].tolist()
    assert hf_tokens[:len(out.tokens)] == out.tokens
