"""Shapes / block sizes a variant cannot tile raise TilingError (a ValueError) at trace time with a
message naming the kernel, the variant, the shape and the constraint; nothing runs."""
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import TilingError, lora_bgmv, lora_sgmv, reft_apply

S = jax.ShapeDtypeStruct


def _lora_args(T, d_in, d_out, r, n, dtype=jnp.float32):
    return S((T, d_in), dtype), S((n, d_in, r), dtype), S((n, r, d_out), dtype), S((T,), jnp.int32)


def _trace(fn, args, **kw):
    jax.jit(lambda *a: fn(*a, interpret=False, **kw)).trace(*args)


@pytest.mark.parametrize("fn,args,kw,match", [
    (lora_sgmv, _lora_args(64, 64, 64, 8, 4), dict(platform="gpu", block_tokens=24),
     r"lora_sgmv \[gpu\]: block_tokens=24.*power of two in \[16, 128\]"),
    (lora_sgmv, _lora_args(64, 64, 64, 8, 4), dict(platform="tpu", block_tokens=12),
     r"lora_sgmv \[tpu\]: block_tokens=12.*multiple of 8"),
    (lora_sgmv, _lora_args(64, 64, 64, 8, 4, jnp.bfloat16), dict(platform="tpu", block_tokens=8),
     r"lora_sgmv \[tpu\]: block_tokens=8.*multiple of 16"),
    (lora_sgmv, _lora_args(64, 1 << 20, 64, 16, 4), dict(platform="tpu"),
     r"lora_sgmv \[tpu\]: x tile \[16, 1048576\].* MiB of VMEM; .*supports up to 48 MiB"),
    (lora_sgmv, _lora_args(64, 64, 64, 2048, 4), dict(platform="gpu"),
     r"lora_sgmv \[gpu\]: rank 2048 \(padded to 2048\) with 16-row tiles.*<= 16384"),
    (lora_sgmv, _lora_args(64, 64, 512, 8, 4), dict(platform="tpu", block_out=100),
     r"lora_sgmv \[tpu\]: block_out=100 < d_out=512.*multiple of 128"),
    (lora_sgmv, _lora_args(64, 64, 512, 8, 4), dict(platform="gpu", block_out=24),
     r"lora_sgmv \[gpu\]: block_out=24 < d_out=512.*multiple of 16"),
    # platform=None traces every variant: a shape only the TPU variant can tile still raises
    (lora_sgmv, _lora_args(64, 64, 64, 8, 4), dict(block_tokens=8),
     r"lora_sgmv \[gpu\]: block_tokens=8"),
    (lora_bgmv, _lora_args(8, 64, 64, 2048, 4), dict(platform="gpu"),
     r"lora_bgmv \[gpu\]: rank 2048"),
])
def test_untileable_lora_shapes_raise(fn, args, kw, match):
    with pytest.raises(TilingError, match=match):
        _trace(fn, args, **kw)


def test_untileable_reft_shapes_raise():
    args = (S((64, 64), jnp.float32), S((4, 8, 64), jnp.float32), S((4, 8, 64), jnp.float32),
            S((4, 8), jnp.float32), S((4,), jnp.float32), S((64,), jnp.int32))
    with pytest.raises(TilingError, match=r"reft_apply \[gpu\]: block_tokens=48"):
        _trace(reft_apply, args, platform="gpu", block_tokens=48)
    with pytest.raises(TilingError, match=r"reft_apply \[tpu\]: block_tokens=4"):
        _trace(reft_apply, args, platform="tpu", block_tokens=4)
    assert issubclass(TilingError, ValueError)


def test_other_bad_arguments_raise_value_error():
    args = _lora_args(8, 16, 16, 4, 2)
    with pytest.raises(ValueError, match="platform must be None .* \\('tpu', 'gpu'\\)"):
        _trace(lora_sgmv, args, platform="cuda")
    with pytest.raises(ValueError, match="block_tokens must be a positive int"):
        _trace(lora_sgmv, args, block_tokens=0)
    with pytest.raises(ValueError, match="shape mismatch"):
        _trace(lora_bgmv, (args[0], S((2, 8, 4), jnp.float32), args[2], args[3]))
