"""Every kernel, forward and gradient (wrt activations and weights), lowers with interpret=False for
both "cuda" (Pallas Triton) and "tpu" (Mosaic) at SmolLM2-135M and Llama-3.1-8B layer shapes, in
float32 and bfloat16. Abstract arguments only (jax.ShapeDtypeStruct): nothing large is allocated.

Each Triton module produced is also run through the MLIR verifier (power-of-two tensor sizes etc.),
and the number of kernels per projection is checked (SGMV/ReFT: forward, input-gradient and two
weight-gradient kernels; BGMV: forward and input-gradient), so no gradient silently falls back to
XLA. Lowering for a platform never touches the other platform's kernels.
"""
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import lora_bgmv, lora_sgmv, make_group_metadata, reft_apply
from preft_jax.lowering import lower_for

S = jax.ShapeDtypeStruct

# (d_in, d_out, rank) per distinct projection: q/o, k/v, gate/up, down
MODELS = {
    "smollm2_135m": dict(tokens=256, decode=64, slots=8, d=576, reft_rank=8,
                         proj=[(576, 576, 8), (576, 192, 16), (576, 1536, 8), (1536, 576, 16)]),
    "llama31_8b": dict(tokens=2048, decode=128, slots=64, d=4096, reft_rank=16,
                       proj=[(4096, 4096, 16), (4096, 1024, 16), (4096, 14336, 16),
                             (14336, 4096, 16)]),
}
KERNELS_PER_CALL = {"sgmv": 4, "bgmv": 2, "reft": 4}
MARKERS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


@pytest.fixture
def triton_modules(monkeypatch):
    """Counts (and MLIR-verifies) the Triton modules built while lowering."""
    from jax._src.pallas.triton import lowering
    built = []
    original = lowering.lower_jaxpr_to_triton_module

    def verified(*args, **kwargs):
        result = original(*args, **kwargs)
        assert result.module.operation.verify()
        built.append(result)
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", verified)
    return built


def _lora_problem(kernel, m, dtype):
    T = m["tokens"] if kernel == "sgmv" else m["decode"]
    d_ins = sorted({p[0] for p in m["proj"]})
    xs = [S((T, d), dtype) for d in d_ins]
    As = [S((m["slots"], di, r), dtype) for di, _, r in m["proj"]]
    Bs = [S((m["slots"], r, do), dtype) for _, do, r in m["proj"]]

    def loss(xs, As, Bs, idx):
        md = make_group_metadata(idx, m["slots"]) if kernel == "sgmv" else None
        x_of = dict(zip(d_ins, xs))
        total = 0.0
        for A, B in zip(As, Bs):
            x = x_of[A.shape[1]]
            if kernel == "sgmv":
                y = lora_sgmv(x, A, B, idx, interpret=False, metadata=md)
            else:
                y = lora_bgmv(x, A, B, idx, interpret=False)
            total = total + jnp.sum(y.astype(jnp.float32) ** 2)
        return total

    f = jax.value_and_grad(loss, argnums=(0, 1, 2))
    return f, (xs, As, Bs, S((T,), jnp.int32)), len(m["proj"])


def _reft_problem(m, dtype):
    T, n, d, r = m["tokens"], m["slots"], m["d"], m["reft_rank"]

    def loss(h, R, W, b, subtract, idx):
        y = reft_apply(h, R, W, b, subtract, idx, interpret=False)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    f = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
    args = (S((T, d), dtype), S((n, r, d), dtype), S((n, r, d), dtype), S((n, r), dtype),
            S((n,), jnp.float32), S((T,), jnp.int32))
    return f, args, 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("kernel", sorted(KERNELS_PER_CALL))
def test_forward_and_gradient_lower_for_cuda_and_tpu(kernel, model, dtype, triton_modules):
    m = MODELS[model]
    f, args, calls = _reft_problem(m, dtype) if kernel == "reft" else _lora_problem(kernel, m, dtype)
    expected = KERNELS_PER_CALL[kernel] * calls
    for platform in ("cuda", "tpu"):
        text = lower_for(jax.jit(f), *args, platform=platform).as_text()
        assert text.count(MARKERS[platform]) == expected, platform
        other = MARKERS["tpu" if platform == "cuda" else "cuda"]
        assert other not in text
    assert len(triton_modules) == expected


def test_default_selection_follows_the_lowering_platform(triton_modules):
    x, A, B, idx = (S((64, 64), jnp.float32), S((4, 64, 8), jnp.float32),
                    S((4, 8, 64), jnp.float32), S((64,), jnp.int32))
    f = jax.jit(lambda *a: lora_sgmv(*a))                                # platform=None, interpret=None
    cpu = lower_for(f, x, A, B, idx, platform="cpu").as_text()
    assert not any(marker in cpu for marker in MARKERS.values())        # interpreted on CPU
    assert lower_for(f, x, A, B, idx, platform="cuda").as_text().count(MARKERS["cuda"]) == 1
    assert lower_for(f, x, A, B, idx, platform="tpu").as_text().count(MARKERS["tpu"]) == 1
