"""preft_jax/lowering.py: a cuda lowering on this GPU-less host targets an abstract H100 without
changing the program - no sharding constraint where the function has no mesh, the caller's mesh
kept (its size, its constraints) where it has one - and the probe answers "" or why not."""
import functools

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels
from preft_jax import sharding
from preft_jax.lowering import CROSS_GPU, lower_for, lowering_platform, lowers

S = jax.ShapeDtypeStruct


def _scaled(x):
    return sharding.constrain(x * 2.0, ("batch", "embed"))     # a constraint only under a mesh


def test_cuda_lowering_targets_an_abstract_gpu_and_adds_no_constraint():
    assert lowering_platform("gpu") == "cuda" and lowering_platform("tpu") == "tpu"
    seen = []

    def f(x):
        seen.append(jax.sharding.get_abstract_mesh().abstract_device)
        return _scaled(x)

    text = lower_for(jax.jit(f), S((8, 16), jnp.float32), platform="cuda").as_text()
    assert seen[-1] is not None and seen[-1].device_kind == CROSS_GPU and seen[-1].platform == "gpu"
    assert "sharding_constraint" not in text and "sdy.mesh" not in text
    assert jax.sharding.get_abstract_mesh().abstract_device is None          # nothing left behind
    cpu = lower_for(jax.jit(f), S((8, 16), jnp.float32), platform="cpu").as_text()
    assert seen[-1] is None and "sharding_constraint" not in cpu


def test_cuda_lowering_keeps_the_callers_mesh():
    mesh = jax.make_mesh((1, 1, 1), sharding.AXES)
    with jax.set_mesh(mesh):
        shapes = []

        def f(x):
            shapes.append(tuple(jax.sharding.get_abstract_mesh().axis_sizes))
            return _scaled(x)

        cuda = lower_for(jax.jit(f), S((8, 16), jnp.float32), platform="cuda").as_text()
        tpu = lower_for(jax.jit(f), S((8, 16), jnp.float32), platform="tpu").as_text()
        assert shapes == [(1, 1, 1), (1, 1, 1)]
        assert ("sharding_constraint" in cuda) == ("sharding_constraint" in tpu)
        assert jax.sharding.get_abstract_mesh().axis_sizes == (1, 1, 1)


def test_lowers_answers_why_not():
    x, A, B, idx = S((32, 128), jnp.float32), S((3, 128, 8), jnp.float32), S((3, 8, 128), jnp.float32), \
        S((32,), jnp.int32)
    kernel = jax.jit(functools.partial(pallas_kernels.lora_sgmv, interpret=False))
    assert lowers(kernel, x, A, B, idx, platform="cuda") == ""
    assert lowers(kernel, x, A, B, idx, platform="tpu") == ""

    def broken(x):
        raise NotImplementedError("no lowering rule for frobnicate\nsecond line")

    assert lowers(jax.jit(broken), x, platform="cuda") == "NotImplementedError: no lowering rule for frobnicate"
    with pytest.raises(NotImplementedError):
        lower_for(jax.jit(broken), x, platform="cuda")


def test_error_line_is_the_type_and_first_line_cut_to_the_limit():
    from preft_jax.lowering import error_line
    assert error_line(ValueError("first line\nsecond")) == "ValueError: first line"
    assert error_line(RuntimeError("  ")) == "RuntimeError: RuntimeError"
    assert error_line(KeyError("x" * 300), 10) == "KeyError: 'xxxxxxxxx"
