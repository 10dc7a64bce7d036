"""Serving straight from Orbax training checkpoints: `load_adapter` on a run folder, its checkpoints
folder or one step gives exactly the weights of the exported PEFT / ReFT folder, and an engine serving
both gives the same greedy outputs; a checkpoint of another model / adapter shape is refused clearly."""
import jax
import numpy as np
import pytest

from preft_jax.adapters.config import LoraWeights
from preft_jax.adapters.orbax_io import checkpoint_identity, is_orbax_checkpoint, resolve_step
from preft_jax.adapters.peft_io import AdapterFormatError
from preft_jax.adapters.reft_io import adapter_kind, load_adapter
from preft_jax.adapters.trainable import init_adapter
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams
from reference_llama import random_params
from serve.engine import Engine, EngineConfig
from serve.errors import AdapterLoadError
from serve.registry import AdapterRegistry
from train.checkpoint import Checkpointer, export_adapter
from train.config import AdapterSpec, CheckpointConfig, OptimizerConfig
from train.data import Tokenized
from train.sft import SFTConfig, SFTTrainer
from train.trainer import ResumeError

pytestmark = pytest.mark.usefixtures("cheap_codegen")     # conftest: many small programs, run briefly

CFG = tiny_config()


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(Llama.from_params(CFG, random_params(CFG, seed=0)))


def _data(n=16, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [[int(x) for x in rng.integers(3, 200, rng.integers(3, 8))] for _ in range(n)]
    return Tokenized(prompts, [[p[0], (p[-1] * 7) % 200 + 3, 2] for p in prompts], [0] * n)


def _config(kind, rank=3, steps=3):
    where = dict(targets=("q", "k", "o", "up")) if kind == "lora" else dict(layers=(0, 2))
    return SFTConfig(adapter=AdapterSpec(kind=kind, rank=rank, **where),
                     steps=steps, batch_size=8, optimizer=OptimizerConfig(lr=5e-2),
                     checkpoint=CheckpointConfig(every=2), log_every=0, seq_len=16)


@pytest.fixture(scope="module")
def runs(runner, tmp_path_factory):
    """kind -> (run folder, trainer): 3 SFT steps, checkpoints at 2 and 3, the adapter exported."""
    out = {}
    for kind in ("lora", "reft"):
        run = tmp_path_factory.mktemp(f"run-{kind}")
        tr = SFTTrainer(CFG, runner.graphdef, runner.state, _config(kind))
        state, _ = tr.fit(_data(), checkpoint_dir=run / "checkpoints")
        export_adapter(run / "adapter", CFG, tr.adapter_config, state.params)
        out[kind] = (run, tr)
    return out


def _leaves(w):
    if isinstance(w, LoraWeights):
        return [w.A[t] for t in sorted(w.A)] + [w.B[t] for t in sorted(w.B)]
    return [w.R, w.W, w.b]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "reft"])
def test_checkpoint_loads_exactly_as_the_exported_folder(runs, kind):
    run, tr = runs[kind]
    exported = load_adapter(run / "adapter", CFG)
    assert resolve_step(run).name == "3" and is_orbax_checkpoint(run) and not is_orbax_checkpoint(run / "adapter")
    assert adapter_kind(run) == kind
    for path in (run, run / "checkpoints", run / "checkpoints" / "3"):
        got = load_adapter(path, CFG)
        assert type(got) is type(exported) and got.config == exported.config
        for a, b in zip(_leaves(got), _leaves(exported)):
            assert a.dtype == b.dtype == np.float32
            np.testing.assert_array_equal(a, b)
    assert max(float(np.abs(x).max()) for x in _leaves(exported)) > 0
    # an older step is a different adapter
    older = load_adapter(run / "checkpoints" / "2", CFG)
    assert any(not np.array_equal(a, b) for a, b in zip(_leaves(older), _leaves(exported)))


@pytest.mark.slow
def test_engine_serves_the_checkpoint_like_the_exported_folder(runner, runs):
    reg = AdapterRegistry(CFG, capacity=4, lora_rank=4, reft_rank=4)
    for kind, (run, _) in runs.items():
        reg.load(f"{kind}-ckpt", str(run))                  # the run folder: its latest checkpoint
        reg.load(f"{kind}-peft", str(run / "adapter"))
    eng = Engine(runner, reg, EngineConfig(max_num_seqs=4, max_model_len=48, mode="prefill", max_prefill_seqs=2, max_num_batched_tokens=32, block_size=8))
    sp = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(-1,))
    prompts = [[5, 6, 7, 8, 9], [11, 3, 40], [100, 101, 102, 103, 104, 105, 7]]
    reqs = [(p, name, sp) for p in prompts for name in (None, "lora-ckpt", "lora-peft", "reft-ckpt", "reft-peft")]
    res = eng.generate(reqs)
    by = {(tuple(r[0]), r[1]): out.tokens for r, out in zip(reqs, res)}
    changed = 0
    for p in prompts:
        for kind in ("lora", "reft"):
            assert by[(tuple(p), f"{kind}-ckpt")] == by[(tuple(p), f"{kind}-peft")]
            changed += by[(tuple(p), f"{kind}-ckpt")] != by[(tuple(p), None)]
    assert changed > 0                                      # the trained adapters change generations


def test_checkpoint_of_another_model_or_adapter_is_refused(runner, runs, tmp_path):
    run, tr = runs["lora"]
    other = tiny_config(n_layers=2)
    with pytest.raises(AdapterFormatError, match=r"trained on another model: n_layers=3 \(this model: 2\)"):
        load_adapter(run, other)
    with pytest.raises(AdapterLoadError, match="another model"):
        AdapterRegistry(other, capacity=1).load("x", str(run))
    # params whose shapes do not match the adapter config the checkpoint claims
    acfg = AdapterSpec(rank=3, targets=("q", "k", "o", "up")).build(CFG)
    wrong = AdapterSpec(rank=2, targets=("q", "k", "o", "up")).build(CFG)
    params = init_adapter(CFG, wrong, jax.random.key(0))
    with Checkpointer(tmp_path / "bad") as c:
        c.save(1, {"params": params}, 1, {}, extra=checkpoint_identity(CFG, acfg), force=True)
    with pytest.raises(AdapterFormatError, match=r"shapes do not fit.*A/q: \(3, 64, 2\) \(expected \(3, 64, 3\)\)"):
        load_adapter(tmp_path / "bad", CFG)
    # a checkpoint without the identity (not written by a trainer)
    with Checkpointer(tmp_path / "bare") as c:
        c.save(1, {"params": params}, 1, {}, force=True)
    with pytest.raises(AdapterFormatError, match="not a preft_jax training checkpoint"):
        load_adapter(tmp_path / "bare", CFG)

    # resuming a run with another adapter or model is refused before anything is restored or written
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    tr2 = SFTTrainer(CFG, runner.graphdef, runner.state, _config("lora", rank=2, steps=4))
    with pytest.raises(ResumeError, match=r"holds another adapter: .*rank=3 \(this run: 2\)"):
        tr2.fit(_data(), checkpoint_dir=run / "checkpoints", metrics_path=tmp_path / "m.jsonl")
    runner2 = ModelRunner(Llama.from_params(other, random_params(other, seed=0)))
    tr3 = SFTTrainer(other, runner2.graphdef, runner2.state, _config("lora", steps=4))
    with pytest.raises(ResumeError, match="trained on another model"):
        tr3.fit(_data(), checkpoint_dir=run / "checkpoints")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    assert not (tmp_path / "m.jsonl").exists()


def test_reading_a_checkpoint_logs_no_orbax_warning(runs, caplog):
    """The reader opens a step as the composite checkpoint CheckpointManager wrote (the current Orbax
    API), so Orbax finds the step's metadata: no "Metadata file does not exist" warning per load."""
    import logging
    run, _ = runs["lora"]
    with caplog.at_level(logging.WARNING):
        load_adapter(run, CFG)
        load_adapter(run / "checkpoints" / "2", CFG)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
