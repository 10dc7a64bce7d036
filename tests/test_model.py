"""The base model: float64 reference parity, KV-cache decode == no-cache recompute, bad input."""
import jax.numpy as jnp
import numpy as np
import pytest

from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner, sequence_logits
from preft_jax.kv_cache import KVCache
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams
from reference_llama import random_params, reference_logits

pytestmark = pytest.mark.usefixtures("cheap_codegen")     # conftest: many small programs, run briefly

CFG = tiny_config()


@pytest.fixture(scope="module")
def tiny():
    params = random_params(CFG, seed=0)
    return params, ModelRunner(Llama.from_params(CFG, params))


def test_logits_match_float64_reference(tiny):
    params, runner = tiny
    tokens = np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 11))
    got = np.asarray(sequence_logits(runner.graphdef, runner.state, jnp.asarray(tokens), jnp.asarray([11, 11])))
    want = reference_logits(CFG, params, tokens)
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_untied_head_and_llama3_rope_match_reference():
    from preft_jax.config import RopeScaling
    cfg = tiny_config(tie_embeddings=False, rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=16))
    params = random_params(cfg, seed=3)
    runner = ModelRunner(Llama.from_params(cfg, params))
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 40))
    got = np.asarray(sequence_logits(runner.graphdef, runner.state, jnp.asarray(tokens), jnp.asarray([40])))
    want = reference_logits(cfg, params, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_decode_through_cache_equals_recompute(tiny):
    """Prefill 2 ragged prompts into slots (reversed order), decode step by step, compare to full recompute."""
    params, runner = tiny
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, CFG.vocab_size, 7), rng.integers(0, CFG.vocab_size, 4)]
    tokens = np.zeros((2, 8), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    cache = KVCache.create(CFG, n_slots=3, max_len=24)
    slots = jnp.asarray([2, 0])
    lengths = jnp.asarray([7, 4])
    logits, cache = runner.prefill(jnp.asarray(tokens), lengths, slots, cache)
    seqs = [list(p) for p in prompts]
    step_logits = [[np.asarray(logits[0])], [np.asarray(logits[1])]]
    for step in range(6):
        nxt = [int(np.argmax(step_logits[b][-1])) for b in range(2)]
        for b in range(2):
            seqs[b].append(nxt[b])
        toks = np.zeros(3, np.int32)
        pos = np.zeros(3, np.int32)
        for b, slot in enumerate([2, 0]):
            toks[slot], pos[slot] = nxt[b], len(seqs[b]) - 1
        out, cache = runner.decode(jnp.asarray(toks), jnp.asarray(pos), cache)
        for b, slot in enumerate([2, 0]):
            step_logits[b].append(np.asarray(out[slot]))
    for b in range(2):
        want = reference_logits(CFG, params, np.asarray([seqs[b]]))[0]
        got = np.stack(step_logits[b])
        np.testing.assert_allclose(got, want[len(prompts[b]) - 1:], rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_greedy_generate_equals_no_cache_greedy(tiny):
    params, runner = tiny
    prompt = list(np.random.default_rng(5).integers(0, CFG.vocab_size, 5))
    out = runner.generate([prompt, prompt[:3]], SamplingParams(max_new_tokens=8, stop_token_ids=(-5,)))
    for p, g in zip([prompt, prompt[:3]], out):
        seq = list(p)
        for _ in range(8):
            seq.append(int(np.argmax(reference_logits(CFG, params, np.asarray([seq]))[0, -1])))
        assert g.tokens == seq[len(p):]
        assert g.finish_reason == "length"


def test_sampling_is_seeded_and_respects_top_p(tiny):
    import jax
    _, runner = tiny
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=6, stop_token_ids=(-5,))
    a = runner.generate([[3, 4, 5]], sp, key=jax.random.key(7))
    b = runner.generate([[3, 4, 5]], sp, key=jax.random.key(7))
    assert a[0].tokens == b[0].tokens


def test_repeated_generate_calls_compile_nothing_new(tiny):
    """ModelRunner.generate of the same shapes compiles once: its first-token draw used to trace
    `sample`'s lax.cond anew on every call (a backend compile per call, and memory maps that ran out
    after ~650 calls)."""
    import jax
    import jax.monitoring
    _, runner = tiny
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=4, stop_token_ids=(-5,))
    for i in range(2):                                        # warm: every shape compiled
        runner.generate([[3, 4, 5]], sp, key=jax.random.key(i))
    compiles = []

    def listen(name, _dur, **_kw):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for i in range(3):
            runner.generate([[3, 4, 5]], sp, key=jax.random.key(10 + i))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []


def test_top_p_and_top_k_masks():
    import jax
    from preft_jax.sampling import sample
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 2))
    keys = jax.random.split(jax.random.key(0), 200)
    jsample = jax.jit(sample)       # compiled once: eager, each call retraces its lax.cond branches (minutes)
    picks = np.stack([np.asarray(jsample(logits, k, jnp.ones(2), jnp.asarray([0.7, 1.0]), jnp.asarray([0, 1])))
                      for k in keys])
    assert set(picks[:, 0].tolist()) == {0, 1}      # top-p 0.7 keeps 0.5 + 0.3
    assert set(picks[:, 1].tolist()) == {0}         # top-k 1


def test_prompt_longer_than_context_is_a_clear_error(tiny):
    _, runner = tiny
    with pytest.raises(ValueError, match="exceeds the context length"):
        runner.generate([[1] * (CFG.max_seq_len - 2)], SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="empty"):
        runner.generate([[]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        KVCache.create(CFG, 1, CFG.max_seq_len + 1)


def test_missing_model_file_is_a_clear_error(tmp_path):
    from preft_jax.loading import load_model
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(tmp_path / "nope.gguf")


def test_from_params_rejects_wrong_shapes():
    params = random_params(CFG, seed=0)
    params["wq"] = params["wq"][:, :, :8]
    with pytest.raises(ValueError, match="wq"):
        Llama.from_params(CFG, params)
