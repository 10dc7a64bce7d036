"""Optional (needs the `triton` package, e.g. the GPU extra; skipped otherwise): every Triton module
the GPU variants lower to, forward and gradient, at SmolLM2 and Llama-3.1-8B layer shapes in f32 and
bf16, compiles with Triton's own NVIDIA pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin) for sm_90
on the CPU, no GPU needed. This catches what lowering alone does not (dot shape minimums, layout
conversion failures, shared-memory overflow)."""
import jax
import jax.numpy as jnp
import pytest

from preft_jax.lowering import lower_for
from test_lowering import MODELS, _lora_problem, _reft_problem

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")


@pytest.fixture
def triton_asm(monkeypatch):
    from jax._src.pallas.triton import lowering
    modules = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", capture)
    return modules


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("kernel", ["sgmv", "bgmv", "reft"])
def test_gpu_kernels_compile_to_cubin_for_sm90(kernel, model, dtype, triton_asm, tmp_path):
    from triton.backends.compiler import GPUTarget
    m = MODELS[model]
    f, args, _ = _reft_problem(m, dtype) if kernel == "reft" else _lora_problem(kernel, m, dtype)
    lower_for(jax.jit(f), *args, platform="cuda")
    assert triton_asm
    for i, asm in enumerate(dict.fromkeys(triton_asm)):
        path = tmp_path / f"kernel{i}.ttir"
        path.write_text(asm)
        compiled = triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=4, num_stages=2))
        assert compiled.asm["cubin"] and compiled.metadata.shared <= 227 * 1024
