"""RL parity study runner: resumable units that refuse a changed config, a diverging arm reported as
diverged (not dropped), a resumed run equal to an uninterrupted one, and the report rendered from logs."""
import dataclasses
import json

import numpy as np
import pytest

from preft_jax.config import tiny_config
from preft_jax.generation import ModelRunner
from preft_jax.model import Llama
from reference_llama import random_params
from experiments.rl_folder import Arm, StudyConfig, StudyConfigError, config_diff
from experiments.rl_report import write_report
from experiments.rl_study import StudyData, run_study
from train.config import OptimizerConfig
from train.grpo import GRPOConfig

pytestmark = pytest.mark.usefixtures("cheap_codegen")     # conftest: many small programs, run briefly

CFG = tiny_config()


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(Llama.from_params(CFG, random_params(CFG, seed=0)))


def _reward(ids, answer):
    return float(np.mean([t % 2 == answer for t in ids])) if ids else 0.0


def _data():
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, 200, rng.integers(4, 9))] for _ in range(10)]
    return StudyData(prompts[:6], [0, 1, 0, 1, 0, 1], prompts[6:], [0, 1, 0, 1], _reward, (2,), 0)


def _config(**kw):
    grpo = GRPOConfig(prompts_per_step=2, group_size=2, max_new_tokens=4, temperature=1.0, log_every=0,
                      optimizer=OptimizerConfig(lr=1e-2))
    arms = (Arm("all-r4", rank=4, mode="all"), Arm("pre-r4", rank=4))
    return StudyConfig(**{**dict(arms=arms, seeds=(0,), steps=3, eval_every=2, n_train=6, n_eval=4, grpo=grpo), **kw})


@pytest.mark.slow
def test_resume_refuses_changed_config_and_continues_same(runner, tmp_path):
    sc = _config()
    st = run_study(tmp_path, sc, CFG, runner, _data(), chunk=2, stop_after=0.0)     # claims, base eval only
    assert all(s["steps_done"] == 0 for s in st.values())
    changed = dataclasses.replace(sc, grpo=dataclasses.replace(sc.grpo, kl_coef=0.5), steps=4)
    with pytest.raises(StudyConfigError) as e:
        run_study(tmp_path, changed, CFG, runner, _data(), chunk=2)
    assert "grpo.kl_coef: 0.04 -> 0.5" in str(e.value) and "steps: 3 -> 4" in str(e.value)
    assert config_diff(sc.to_json(), sc.to_json()) == []
    # the refused run wrote nothing: the original config resumes and finishes every unit
    st = run_study(tmp_path, sc, CFG, runner, _data(), chunk=2)
    assert {k: (s["state"], s["steps_done"]) for k, s in st.items()} == {"all-r4-s0": ("done", 3),
                                                                         "pre-r4-s0": ("done", 3)}
    rows = [json.loads(x) for x in (tmp_path / "units" / "pre-r4-s0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    evals = [json.loads(x) for x in (tmp_path / "units" / "pre-r4-s0" / "evals.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [2, 3]


@pytest.mark.slow
def test_chunked_run_equals_one_pass(runner, tmp_path):
    """Units interleaved in chunks of 1 step (resumed from checkpoints) = one uninterrupted pass."""
    sc = _config(arms=(Arm("pre-r4", rank=4),))
    run_study(tmp_path / "a", sc, CFG, runner, _data(), chunk=1)
    run_study(tmp_path / "b", sc, CFG, runner, _data(), chunk=3)
    ra, rb = ([json.loads(x) for x in (tmp_path / k / "units" / "pre-r4-s0" / "metrics.jsonl").read_text().splitlines()]
              for k in ("a", "b"))
    for x, y in zip(ra, rb, strict=True):
        for key in ("reward_mean", "response_len", "loss", "kl"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_diverging_arm_is_reported_not_dropped(runner, tmp_path):
    sc = _config(arms=(Arm("pre-r4", rank=4), Arm("boom", rank=4, mode="all", lr=1e35)), steps=4)
    st = run_study(tmp_path, sc, CFG, runner, _data(), chunk=2)
    assert st["pre-r4-s0"]["state"] == "done"
    assert st["boom-s0"]["state"] == "diverged" and 1 <= st["boom-s0"]["diverged_at"] <= 4
    assert st["boom-s0"]["steps_done"] == st["boom-s0"]["diverged_at"]
    # a rerun leaves the diverged unit alone
    assert run_study(tmp_path, sc, CFG, runner, _data(), chunk=2)["boom-s0"] == st["boom-s0"]
    md = write_report(tmp_path, tmp_path / "rep")
    assert f"diverged at step {st['boom-s0']['diverged_at']}" in md
    assert "| boom (" in md and "| pre-r4 (" in md


def test_report_from_fake_logs(tmp_path):
    """The report renders from logs alone (no model): partial progress, seed spread, eval table, PNGs."""
    sc = _config(arms=(Arm("a", mode="all"), Arm("b")), seeds=(0, 1), steps=40, eval_every=20)
    from experiments.rl_folder import claim_folder, write_status
    claim_folder(tmp_path, sc)
    (tmp_path / "base_eval.json").write_text(json.dumps({"greedy_acc": 0.125, "greedy_len": 9.0}))
    rng = np.random.default_rng(0)
    done = {("a", 0): 40, ("a", 1): 40, ("b", 0): 30, ("b", 1): 25}
    for (arm, seed), n in done.items():
        d = tmp_path / "units" / f"{arm}-s{seed}"
        d.mkdir(parents=True)
        rows = [{"step": k, "reward_mean": float(rng.uniform()), "kl": 0.01 * k, "response_len": 10.0,
                 "loss": 0.1, "batch_s": 1.0, "update_s": 2.0} for k in range(1, n + 1)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        evals = [{"step": k, "greedy_acc": 0.25 + 0.25 * seed} for k in (20, 40) if k <= n]
        (d / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
        write_status(d, {"state": "done" if n == 40 else "running", "steps_done": n, "seconds": 60.0 * n})
    md = write_report(tmp_path, tmp_path / "rep")
    assert "PARTIAL" in md and "135 of 160 unit-steps" in md
    row_b = next(ln for ln in md.splitlines() if ln.startswith("| b ("))
    assert "30/25 of 40" in row_b and "partial" in row_b
    assert "steps 1-25 (all units)" in md      # the common step range of a partial run
    # the last-25-steps reward of seed 1 of arm b covers its steps 1..25
    r = [json.loads(x)["reward_mean"] for x in (tmp_path / "units" / "b-s1" / "metrics.jsonl").read_text().splitlines()]
    r0 = [json.loads(x)["reward_mean"] for x in (tmp_path / "units" / "b-s0" / "metrics.jsonl").read_text().splitlines()]
    lo, hi = sorted([np.mean(r0[5:30]), np.mean(r)])
    assert f"{(lo + hi) / 2:.3f} [{lo:.3f}, {hi:.3f}]" in row_b
    row_a = next(ln for ln in md.splitlines() if ln.startswith("| a ("))
    assert "0.375 [0.250, 0.500] (step 40)" in row_a and "| done |" in row_a
    assert row_a.endswith("| 2.0 [2.0, 2.0] |") and row_b.endswith("| 1.4 [1.2, 1.5] |")   # 3 s per step, minutes
    assert "| a | 0.125 | 0.375 [0.250, 0.500] | 0.375 [0.250, 0.500] |" in md
    for png in ("rl_reward.png", "rl_curves.png"):
        assert (tmp_path / "rep" / png).stat().st_size > 10_000
        assert f"]({png})" in md
