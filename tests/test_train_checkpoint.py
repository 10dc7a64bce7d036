"""Orbax checkpoints resume exactly; exported adapters load back and give the trained logits."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from preft_jax.adapters.bank import build_bank
from preft_jax.adapters.peft_io import load_peft_lora
from preft_jax.adapters.reft_io import load_adapter, load_reft
from preft_jax.adapters.trainable import adapter_bank
from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner, sequence_logits
from preft_jax.model import Llama
from reference_llama import random_params
from train.checkpoint import Checkpointer, export_adapter
from train.data import Tokenized, pad_batch
from train.config import AdapterSpec, CheckpointConfig, OptimizerConfig
from train.sft import SFTConfig, SFTTrainer

pytestmark = pytest.mark.usefixtures("cheap_codegen")     # conftest: many small programs, run briefly

CFG = tiny_config()
sequence_logits = jax.jit(sequence_logits, static_argnums=0)


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(Llama.from_params(CFG, random_params(CFG, seed=0)))


def _data(n=24, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [[int(x) for x in rng.integers(3, 200, rng.integers(3, 8))] for _ in range(n)]
    return Tokenized(prompts, [[p[0], (p[-1] * 7) % 200 + 3, 2] for p in prompts], [0] * n)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _resume_config(steps: int, every: int) -> SFTConfig:
    return SFTConfig(adapter=AdapterSpec(rank=2, targets=("q", "v", "down")), steps=steps, batch_size=8,
                     optimizer=OptimizerConfig(lr=1e-2, warmup_steps=1), checkpoint=CheckpointConfig(every=every),
                     log_every=0, seq_len=16)


@pytest.mark.slow
def test_resume_is_exact(runner, tmp_path):
    data = _data()
    tc = _resume_config(steps=4, every=2)
    straight, _ = SFTTrainer(CFG, runner.graphdef, runner.state, tc).fit(data)

    ck = tmp_path / "ckpt"
    part, hist = SFTTrainer(CFG, runner.graphdef, runner.state, tc).fit(data, checkpoint_dir=ck, until=2)
    assert int(part.step) == 2 and len(hist) == 2
    with Checkpointer(ck) as c:
        assert c.latest_step() == 2
    # a fresh trainer (new process in real life) resumes from the latest checkpoint
    resumed, hist2 = SFTTrainer(CFG, runner.graphdef, runner.state, tc).fit(data, checkpoint_dir=ck)
    assert [h["step"] for h in hist2] == [3, 4] and int(resumed.step) == 4
    for a, b in zip(_leaves(straight.params), _leaves(resumed.params)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_leaves(straight.opt_state), _leaves(resumed.opt_state)):
        np.testing.assert_array_equal(a, b)
    with Checkpointer(ck) as c:
        assert c.all_steps() == [2, 4]
        state, meta = c.restore(SFTTrainer(CFG, runner.graphdef, runner.state, tc).setup.abstract_state)
    assert meta["step"] == 4 and meta["data_position"] == 4
    assert SFTConfig.from_json(meta["config"]) == tc
    for a, b in zip(_leaves(straight), _leaves(state)):
        np.testing.assert_array_equal(a, b)


class _NaNAtStep(SFTTrainer):
    """An SFT trainer whose update reports a NaN loss at optimizer step `at` (what a diverged run,
    an infinite learning rate or a NaN reward gives)."""
    at = 2

    def update(self, ts, batch, global_batch_size=None):
        ts, m = super().update(ts, batch, global_batch_size)
        return ts, ({**m, "loss": jnp.float32(jnp.nan)} if int(ts.step) == self.at else m)


def test_run_guards_nan_loss_torn_metrics_and_steps(runner, tmp_path, caplog):
    """The loop stops at a NaN loss before checkpointing that step (the metrics row is kept); a
    torn last line of metrics.jsonl (a crash mid-write) is dropped with a warning when the run
    resumes; a checkpoint past --steps is refused by name instead of exporting it untrained."""
    from train.trainer import NonFiniteLossError, ResumeError
    data = _data(8)
    tc = SFTConfig(adapter=AdapterSpec(rank=2, targets=("q",)), steps=3, batch_size=4, log_every=0, seq_len=16,
                   optimizer=OptimizerConfig(lr=1e-2), checkpoint=CheckpointConfig(every=1))
    ck, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    with pytest.raises(NonFiniteLossError, match=r"step 2: loss nan; the run stopped before saving this step "
                                                  r"\(last checkpoint: step 1\)"):
        _NaNAtStep(CFG, runner.graphdef, runner.state, tc).fit(data, checkpoint_dir=ck, metrics_path=metrics)
    with Checkpointer(ck) as c:
        assert c.latest_step() == 1
    assert [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()] == [1, 2]
    with metrics.open("a") as f:
        f.write('{"step": 3, "loss": 10.8')                 # torn by a crash
    with caplog.at_level("WARNING", logger="train"):
        _, hist = SFTTrainer(CFG, runner.graphdef, runner.state, tc).fit(data, checkpoint_dir=ck, metrics_path=metrics)
    assert [h["step"] for h in hist] == [2, 3]
    assert [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()] == [1, 2, 3]
    assert "dropped 1 line(s) that are not JSON rows" in caplog.text and str(metrics) in caplog.text
    short = dataclasses.replace(tc, steps=2)
    with pytest.raises(ResumeError, match=r"is at step 3, past this run's --steps 2; give --steps 3 or more"):
        SFTTrainer(CFG, runner.graphdef, runner.state, short).fit(data, checkpoint_dir=ck)


def test_sft_rows_longer_than_the_context_are_named(runner):
    cfg = dataclasses.replace(CFG, max_seq_len=24)
    data = _data(8)
    data.responses[5] = data.responses[5] + [7] * 30           # row 6: past the model's 24 positions
    tc = SFTConfig(adapter=AdapterSpec(rank=2, targets=("q",)), steps=1, batch_size=8, log_every=0)
    with pytest.raises(ValueError, match=r"row 6 of the train split is \d+ tokens \(prompt \d+ \+ response 33, "
                                         r"end of turn included\); the model's context is 24 tokens"):
        SFTTrainer(cfg, runner.graphdef, runner.state, tc).fit(data)
    with pytest.raises(ValueError, match=r"row 6 of the train split .* --seq-len is 16 tokens: .* or raise --seq-len"):
        SFTTrainer(CFG, runner.graphdef, runner.state, dataclasses.replace(tc, seq_len=16)).fit(data)


def test_checkpointer_interval_and_retention(runner, tmp_path):
    tc = SFTConfig(adapter=AdapterSpec(rank=2, targets=("q",)), steps=10, log_every=0)
    trainer = SFTTrainer(CFG, runner.graphdef, runner.state, tc)
    st = trainer.init_state()
    c = Checkpointer(tmp_path, save_every=3, max_to_keep=2)
    saved = [s for s in range(1, 11) if c.save(s, st, s, tc.to_json(), extra={"note": "x"})]
    assert saved == [3, 6, 9] and c.all_steps() == [6, 9]
    assert c.save(10, st, 10, tc.to_json(), force=True) and c.latest_step() == 10
    _, meta = c.restore(st, step=9)
    assert meta["note"] == "x" and meta["data_position"] == 9
    c.close()
    with pytest.raises(FileNotFoundError):
        Checkpointer(tmp_path / "empty").restore(st)


def test_a_damaged_checkpoint_is_one_error_naming_its_folder(runner, tmp_path):
    """A truncated array file or a garbled meta used to surface as Orbax / TensorStore's own exception
    (150 lines ending in a TensorStore spec); now a CheckpointReadError naming the step folder. The
    step before it still restores."""
    import shutil

    from train.checkpoint import CheckpointReadError
    tc = SFTConfig(adapter=AdapterSpec(rank=2, targets=("q",)), steps=4, log_every=0)
    st = SFTTrainer(CFG, runner.graphdef, runner.state, tc).init_state()
    with Checkpointer(tmp_path / "good", max_to_keep=None) as c:
        for step in (1, 2):
            c.save(step, st, step, tc.to_json(), force=True)
    for damage in ("truncate", "garble", "meta"):
        ck = tmp_path / damage
        shutil.copytree(tmp_path / "good", ck)
        if damage in ("truncate", "garble"):
            files = [p for p in (ck / "2" / "state").rglob("*") if p.is_file() and "d" in p.parent.name]
            big = max(files, key=lambda p: p.stat().st_size)
            data = big.read_bytes()
            big.write_bytes(data[: len(data) // 3] if damage == "truncate" else
                            np.random.default_rng(0).integers(0, 256, len(data), dtype=np.uint8).tobytes())
        else:
            [meta] = [p for p in (ck / "2" / "meta").rglob("*") if p.is_file() and p.name == "metadata"]
            meta.write_text('{"step": 2, "data\x01')
        with Checkpointer(ck) as c:
            with pytest.raises(CheckpointReadError) as e:
                c.restore(st) if damage != "meta" else c.read_meta()
            assert str(e.value).startswith(f"cannot read checkpoint {ck.absolute() / '2'} ("), damage
            assert str(e.value).endswith("); it may be damaged (an interrupted save, a truncated or edited file): "
                                         "move it away to resume from the step before it, or use another output "
                                         "folder")
            assert "\n" not in str(e.value)
            _, meta = c.restore(st, step=1)
            assert meta["step"] == 1
    # another optimizer (--grad-clip 0 drops a transform): the state's tree differs - not "damaged"
    other = SFTTrainer(CFG, runner.graphdef, runner.state, SFTConfig(
        adapter=AdapterSpec(rank=2, targets=("q",)), steps=4, log_every=0,
        optimizer=dataclasses.replace(tc.optimizer, grad_clip=0.0))).init_state()
    with Checkpointer(tmp_path / "good") as c:
        with pytest.raises(CheckpointReadError) as e:
            c.restore(other)
    assert str(e.value).startswith(f"cannot restore checkpoint {(tmp_path / 'good').absolute() / '2'} into this run's "
                                   f"state (ValueError: ")
    assert str(e.value).endswith("it was written with other flags (the optimizer's --grad-clip / --weight-decay, the "
                                 "adapter's targets or layers): resume with the flags it was trained with, or use "
                                 "another output folder") and "\n" not in str(e.value)


def _trained(runner, adapter, mode, steps=3):
    where = dict(targets=("q", "k", "o", "up")) if adapter == "lora" else dict(layers=(0, 2))
    tc = SFTConfig(adapter=AdapterSpec(kind=adapter, rank=3, mode=mode, **where),
                   steps=steps, batch_size=8, optimizer=OptimizerConfig(lr=5e-2), log_every=0, seq_len=16)
    trainer = SFTTrainer(CFG, runner.graphdef, runner.state, tc)
    state, _ = trainer.fit(_data())
    return trainer, state


@pytest.mark.slow
@pytest.mark.parametrize("adapter,mode", [("lora", "prefill"), ("lora", "all"), ("reft", "prefill")])
def test_export_loads_back_with_same_logits(runner, tmp_path, adapter, mode):
    trainer, state = _trained(runner, adapter, mode)
    # all finite (LoReFT on a layer subset: unused layers get a zero, never NaN, gradient)
    assert all(np.all(np.isfinite(x)) for x in _leaves(state.params))
    weights = export_adapter(tmp_path / "adapter", CFG, trainer.adapter_config, state.params)
    if adapter == "lora":
        loaded = load_peft_lora(tmp_path / "adapter", CFG)
        assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    else:
        loaded = load_reft(tmp_path / "adapter", CFG)
    assert type(load_adapter(tmp_path / "adapter", CFG)) is type(weights)
    assert loaded.config.policy == trainer.adapter_config.policy
    b = pad_batch([[5, 6, 7, 8], [9, 10]], [[11, 12, 2], [13, 14, 15, 2]], length=12)
    tokens, plen = jnp.asarray(b.tokens), jnp.asarray(b.prompt_lengths)
    trained = sequence_logits(runner.graphdef, runner.state, tokens, plen,
                              adapter_bank(CFG, trainer.adapter_config, state.params), jnp.ones(2, jnp.int32))
    served = sequence_logits(runner.graphdef, runner.state, tokens, plen, build_bank(CFG, [loaded]),
                             jnp.ones(2, jnp.int32))
    base = sequence_logits(runner.graphdef, runner.state, tokens, plen)
    assert float(jnp.abs(trained - base).max()) > 1e-3           # the adapter did learn something
    np.testing.assert_allclose(np.asarray(served), np.asarray(trained), rtol=1e-4, atol=1e-4)


def test_a_sigterm_ends_the_run_at_the_next_step_saved_and_resume_is_exact(runner, tmp_path):
    import os
    import signal

    from train.preemption import Preempted
    data = _data()
    tc = _resume_config(steps=5, every=100)                 # no regular checkpoint before the end
    straight, _ = SFTTrainer(CFG, runner.graphdef, runner.state, tc).fit(data)
    ck, before = tmp_path / "ckpt", signal.getsignal(signal.SIGTERM)

    def notice(row, state):
        if row["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)          # a scheduler's notice, mid-run
    with pytest.raises(Preempted, match=rf"^preempted \(SIGTERM\) after step 3 of 5: checkpoint of step 3 saved in "
                                        rf"{ck}; the same command resumes from it$") as e:
        SFTTrainer(CFG, runner.graphdef, runner.state, tc).fit(data, checkpoint_dir=ck, callbacks=[notice])
    assert e.value.step == 3 and signal.getsignal(signal.SIGTERM) is before     # the handler is put back
    with Checkpointer(ck) as c:
        assert c.all_steps() == [3]
    resumed, hist = SFTTrainer(CFG, runner.graphdef, runner.state, tc).fit(data, checkpoint_dir=ck)
    assert [h["step"] for h in hist] == [4, 5]
    for a, b in zip(_leaves(straight.params), _leaves(resumed.params)):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
