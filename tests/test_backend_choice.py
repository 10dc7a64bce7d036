"""Which kernel the `pallas` adapter backend (what `auto` resolves to on GPU and TPU) uses where:
decode LoRA (gather layout) is XLA's per-token gather on GPUs and BGMV on TPU; prefill LoRA
(grouped) is SGMV on both. Checked by lowering for each platform; on CPU the interpreted BGMV
still matches the gather reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from preft_jax.adapters import apply
from preft_jax.adapters.context import GATHER_LORA_XLA_PLATFORMS, AdapterContext
from preft_jax.lowering import lower_for

MARKERS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
T, D, R, N = 32, 128, 16, 5


def _lowered(mode, platform):
    S = jax.ShapeDtypeStruct
    args = (S((T, D), jnp.bfloat16), S((N, D, R), jnp.bfloat16), S((N, R, D), jnp.bfloat16), S((T,), jnp.int32))

    def f(x, A, B, slots):
        return AdapterContext.build(slots, N, "pallas", mode).lora(x, A, B)
    return lower_for(jax.jit(f), *args, platform=platform).as_text()


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_decode_gather_uses_xla_on_gpu_and_bgmv_on_tpu(platform):
    text = _lowered("gather", platform)
    if platform == "cuda":
        assert "cuda" in GATHER_LORA_XLA_PLATFORMS
        assert MARKERS["cuda"] not in text            # no Triton kernel: XLA's gather
        assert "gather" in text
    else:
        assert MARKERS["tpu"] in text                 # the BGMV Mosaic kernel


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_prefill_grouped_uses_sgmv_everywhere(platform):
    assert MARKERS[platform] in _lowered("grouped", platform)


def test_gather_on_cpu_is_interpreted_bgmv_matching_the_reference():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    A = jnp.asarray(rng.normal(size=(N, D, R)) * 0.1, jnp.float32)
    B = jnp.asarray(rng.normal(size=(N, R, D)) * 0.1, jnp.float32)
    slots = jnp.asarray(rng.integers(0, N, T), jnp.int32)
    got = jax.jit(lambda *a: AdapterContext.build(a[3], N, "pallas", "gather").lora(*a[:3]))(x, A, B, slots)
    np.testing.assert_allclose(np.asarray(got), np.asarray(apply.lora_gather(x, A, B, slots)), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(got)).max() > 0.1
