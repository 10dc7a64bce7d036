"""Config validation and JSON round trips; distributed flags / environment; single-process mesh and batch
placement (the multi-process paths run in tests/test_train_multiprocess.py)."""
import dataclasses

import jax
import numpy as np
import pytest

from train import distributed as dist
from train.config import AdapterSpec, CheckpointConfig, MeshConfig, OptimizerConfig, TrainerConfig
from train.grpo import GRPOConfig
from train.grpo import _parse as grpo_parse
from train.grpo import config_from_args as grpo_config
from train.sft import SFTConfig
from train.sft import _parse as sft_parse
from train.sft import config_from_args as sft_config


def test_nested_configs_round_trip_and_share_groups():
    s = SFTConfig(adapter=AdapterSpec(kind="reft", rank=4, layers=(0, 2), reft_kind="direft"),
                  optimizer=OptimizerConfig(lr=3e-4, grad_clip=None), mesh=MeshConfig(2, 1, 2),
                  checkpoint=CheckpointConfig(every=5, max_to_keep=None), seq_len=64)
    g = GRPOConfig(adapter=AdapterSpec(mode="all", targets=("q", "v")), inner_steps=2, temperature=0.7)
    for c in (s, g):
        assert type(c).from_json(c.to_json()) == c
        assert isinstance(c, TrainerConfig)
    assert SFTConfig().optimizer == OptimizerConfig(lr=1e-3, warmup_steps=10)       # per-trainer defaults
    assert GRPOConfig().optimizer == OptimizerConfig(lr=1e-4, warmup_steps=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.optimizer.lr = 1.0
    with pytest.raises(ValueError, match="unknown field"):
        SFTConfig.from_json({**s.to_json(), "rnak": 3})


@pytest.mark.parametrize("make,match", [
    (lambda: AdapterSpec(kind="dora"), "adapter kind must be one of"),
    (lambda: AdapterSpec(mode="decode"), "mode must be one of"),
    (lambda: AdapterSpec(targets=("q", "qkv")), "LoRA targets"),
    (lambda: AdapterSpec(rank=0), "rank must be >= 1"),
    (lambda: OptimizerConfig(lr=0), "lr must be a finite number > 0, got 0"),
    (lambda: OptimizerConfig(lr=float("inf")), "lr must be a finite number > 0, got inf"),
    (lambda: OptimizerConfig(weight_decay=float("nan")), "weight_decay must be a finite number >= 0, got nan"),
    (lambda: OptimizerConfig(grad_clip=float("inf")), "grad_clip must be a finite number >= 0, got inf"),
    (lambda: AdapterSpec(alpha=0.0), "alpha must be a finite number > 0, got 0.0"),
    (lambda: AdapterSpec(alpha=float("nan")), "alpha must be a finite number > 0, got nan"),
    (lambda: AdapterSpec(kind="reft", alpha=8.0), "alpha is a LoRA setting; a reft adapter has none"),
    (lambda: AdapterSpec(kind="reft", targets=("q",)), r"a reft adapter acts on the residual stream .* targets=\('q',\)"),
    (lambda: SFTConfig(seed=-1), r"SFTConfig.seed must be an integer in \[0, 2\*\*31\), got -1"),
    (lambda: SFTConfig(seed=2 ** 32 + 5), r"seed must be an integer in \[0, 2\*\*31\), got 4294967301"),
    (lambda: MeshConfig(2, 0, 1), "fsdp must be >= 1"),
    (lambda: MeshConfig.parse("2,2"), "three integers"),
    (lambda: CheckpointConfig(every=-1), "every must be >= 0"),
    (lambda: SFTConfig(steps=0), "steps must be >= 1"),
    (lambda: SFTConfig(adapter={"kind": "lora"}), "must be a AdapterSpec"),
    (lambda: GRPOConfig(temperature=0.0), "temperature must be a finite number > 0, got 0.0"),
    (lambda: GRPOConfig(temperature=float("inf")), "temperature must be a finite number > 0, got inf"),
    (lambda: GRPOConfig(group_size=0), "group_size must be >= 1"),
    (lambda: GRPOConfig(group_size=1), "group_size must be >= 2: .* a group of 1 has advantage 0"),
    (lambda: GRPOConfig(kl_coef=float("nan")), "kl_coef must be a finite number >= 0, got nan"),
    (lambda: GRPOConfig(clip_eps=float("nan")), "clip_eps must be a finite number > 0, got nan"),
])
def test_bad_values_name_the_field(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_adapter_spec_builds_preft_configs():
    from preft_jax.config import tiny_config
    cfg = tiny_config()
    lora = AdapterSpec(rank=4, targets=("q", "v")).build(cfg)
    assert (lora.rank, lora.alpha, lora.targets, lora.layers, lora.policy.mode) == (4, 8.0, ("q", "v"), None, "prefill")
    reft = AdapterSpec(kind="reft", rank=2, mode="all").build(cfg)
    assert reft.layers == (0, 1, 2) and reft.kind == "loreft" and reft.policy.mode == "all"
    with pytest.raises(ValueError, match="out of range"):
        AdapterSpec(layers=(5,)).build(cfg)


def test_cli_flags_build_the_configs():
    a = sft_parse(["--adapter", "reft", "--layers", "0,2", "--rank", "4", "--mesh", "2,1,2", "--lr", "0.01",
                   "--checkpoint-every", "3", "--seq-len", "64", "--batch-size", "16"])
    c = sft_config(a)
    assert c.adapter == AdapterSpec(kind="reft", rank=4, layers=(0, 2))
    assert (c.mesh, c.checkpoint.every, c.optimizer.lr, c.seq_len, c.batch_size) == (MeshConfig(2, 1, 2), 3, 0.01,
                                                                                       64, 16)
    g = grpo_config(grpo_parse(["--group-size", "4", "--inner-steps", "2", "--mode", "all"]))
    assert (g.group_size, g.inner_steps, g.adapter.mode, g.optimizer.lr) == (4, 2, "all", 1e-4)
    with pytest.raises(ValueError, match="three integers"):
        sft_config(sft_parse(["--mesh", "2x2"]))


def test_distributed_config_from_flags_and_environment():
    env = {"PREFT_COORDINATOR": "10.0.0.2:1234", "PREFT_NUM_PROCESSES": "4", "PREFT_PROCESS_ID": "3"}
    c = dist.DistributedConfig.from_env(env)
    assert (c.coordinator, c.num_processes, c.process_id, c.multi_process) == ("10.0.0.2:1234", 4, 3, True)
    assert c.address() == ("10.0.0.2", 1234)
    assert dist.DistributedConfig.from_env(env, process_id=1).process_id == 1          # a flag wins
    assert not dist.DistributedConfig.from_env({}).multi_process
    with pytest.raises(ValueError, match="PREFT_NUM_PROCESSES must be an integer"):
        dist.DistributedConfig.from_env({"PREFT_NUM_PROCESSES": "two"})
    with pytest.raises(ValueError, match="needs a coordinator"):
        dist.DistributedConfig(num_processes=2)
    with pytest.raises(ValueError, match="HOST:PORT"):
        dist.DistributedConfig(coordinator="localhost", num_processes=2)
    with pytest.raises(ValueError, match=r"process_id must be in \[0, 2\)"):
        dist.DistributedConfig(coordinator="h:1", num_processes=2, process_id=2)
    assert dist.DistributedConfig(coordinator="auto").multi_process


def test_single_process_mesh_and_batch_placement():
    n = len(jax.devices())
    with pytest.raises(dist.DistributedError, match=f"needs {n + 1} devices, {n} available"):
        dist.build_mesh(MeshConfig(n + 1, 1, 1))
    mesh = dist.build_mesh(MeshConfig())
    assert dist.local_rows(mesh, 6) == slice(0, 6)
    batch = {"tokens": np.arange(12, dtype=np.int32).reshape(6, 2)}
    placed = dist.put_batch(batch, mesh)
    np.testing.assert_array_equal(np.asarray(placed["tokens"]), batch["tokens"])
    assert dist.global_max(7) == 7
    host = dist.gather_to_host({"a": placed["tokens"]})
    assert isinstance(host["a"], np.ndarray)


def test_remat_takes_a_policy_name():
    from train.sft import SFTConfig
    assert SFTConfig(remat="save_projections").remat == "save_projections"
    assert SFTConfig.from_json(SFTConfig(remat="save_qkvo").to_json()).remat == "save_qkvo"
    with pytest.raises(ValueError, match=r"^SFTConfig\.remat must be true, false or one of \('full', 'save_qkvo', "
                                         r"'save_projections'\), got 'some'$"):
        SFTConfig(remat="some")


def test_model_options_attention():
    from train.config import ModelOptions
    assert ModelOptions(attention="flash").attention == "flash"
    with pytest.raises(ValueError, match=r"^attention must be one of \('auto', 'xla', 'flash', 'flash:gpu', "
                                         r"'flash:tpu'\) or None, got 'fast'$"):
        ModelOptions(attention="fast")


def test_a_bad_attention_is_refused_before_the_model_loads():
    from train.cli import load_base
    from train.config import ModelOptions
    # a path that does not exist: the refusal comes first, nothing is read
    with pytest.raises(ValueError, match=r"^--attention flash: chunk_attention='flash' needs a GPU or a TPU "
                                         r"\(this is 'cpu'\); use 'xla'"):
        load_base(ModelOptions(path="/nonexistent/model.gguf", attention="flash"))
