"""The RL parity study's report: a markdown table and PNG plots from the unit logs (experiments.rl_study).

Reads `<out>/study.json`, `<out>/base_eval.json` and every unit's `metrics.jsonl`, `evals.jsonl` and
`status.json`; writes `results.md`, `rl_reward.png` (rollout reward per step, moving average, mean
over seeds with a min-max band) and `rl_curves.png` (KL to base, response length, held-out greedy
accuracy). Partial runs render too: the table says how many steps each seed finished, and a
diverged seed is listed as "diverged at step k" (its curve stops there).
"""
from __future__ import annotations

import json
import pathlib

import numpy as np

from experiments.rl_folder import load_study, read_jsonl, read_status, unit_name

WINDOW = 10          # moving-average window of the per-step curves (steps)


def _unit(out: pathlib.Path, arm, seed) -> dict:
    folder = out / "units" / unit_name(arm, seed)
    return {"seed": seed, "rows": read_jsonl(folder / "metrics.jsonl"), "evals": read_jsonl(folder / "evals.jsonl"),
            "status": read_status(folder)}


def _series(rows: list[dict], key: str) -> np.ndarray:
    return np.array([r.get(key, np.nan) for r in rows], np.float64)


def _smooth(x: np.ndarray, w: int = WINDOW) -> np.ndarray:
    """Trailing moving average (shorter window at the start)."""
    c = np.cumsum(np.insert(x, 0, 0.0))
    n = np.arange(1, len(x) + 1)
    lo = np.maximum(0, n - w)
    return (c[n] - c[lo]) / (n - lo)


def _window_mean(rows: list[dict], key: str, lo: int, hi: int) -> float:
    v = [r[key] for r in rows if lo < r["step"] <= hi and key in r]
    return float(np.mean(v)) if v else float("nan")


def _fmt_seeds(vals: list[float], nd: int = 3) -> str:
    v = [x for x in vals if x is not None and np.isfinite(x)]
    if not v:
        return "-"
    if len(v) == 1:
        return f"{v[0]:.{nd}f}"
    return f"{np.mean(v):.{nd}f} [{min(v):.{nd}f}, {max(v):.{nd}f}]"


def summarize(out: pathlib.Path) -> dict:
    sc, meta = load_study(out)
    base_path = out / "base_eval.json"
    base = json.loads(base_path.read_text()) if base_path.is_file() else {}
    arms = {a.name: {"arm": a, "units": [_unit(out, a, s) for s in sc.seeds]} for a in sc.arms}
    return {"config": sc, "meta": meta, "base": base, "arms": arms}


def _arm_label(a) -> str:
    kind = "LoRA" if a.kind == "lora" else a.reft_kind.replace("reft", "ReFT").replace("di", "Di").replace("lo", "Lo")
    mode = "all-token" if a.mode == "all" else "prefill-only"
    return f"{mode} {kind} r{a.rank}, lr {a.lr:g}"


def steps_logged(u: dict) -> int:
    """Steps with a metrics row (a pass in flight included; a diverged unit: its last step)."""
    return u["rows"][-1]["step"] if u["rows"] else 0


def common_steps(s: dict) -> int:
    """The number of steps every unit has logged (the fair comparison point of a partial run)."""
    n = [steps_logged(u) for d in s["arms"].values() for u in d["units"] if u["status"]["state"] != "diverged"]
    return min(n) if n else 0


def unit_wall_s(u: dict) -> float:
    """Rollouts + updates of every logged step + held-out evals."""
    return float(sum(r.get("batch_s", 0.0) + r.get("update_s", 0.0) for r in u["rows"])
                 + sum(e.get("seconds", 0.0) for e in u["evals"]))


def table(s: dict) -> str:
    sc = s["config"]
    W = 25
    c = common_steps(s)
    lo_c = max(0, c - W)
    lines = ["| arm | steps done (per seed) | status | rollout reward, steps 1-25 | rollout reward, steps "
             f"{lo_c + 1}-{c} (all units) | rollout reward, last 25 steps "
             "| held-out greedy acc (last eval) | KL to base, last 25 | response tokens, last 25 | wall min / seed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, d in s["arms"].items():
        us = d["units"]
        done = [steps_logged(u) for u in us]
        stat = []
        for u in us:
            st = u["status"]
            if st["state"] == "diverged":
                stat.append(f"s{u['seed']}: **diverged at step {st['diverged_at']}** ({st.get('diverged_metric')})")
        state = "; ".join(stat) or ("done" if all(u["status"]["state"] == "done" for u in us) else "partial")
        first = [_window_mean(u["rows"], "reward_mean", 0, W) for u in us]
        last = [_window_mean(u["rows"], "reward_mean", max(0, n - W), n) for u, n in zip(us, done)]
        common = [_window_mean(u["rows"], "reward_mean", lo_c, c) for u in us] if c else []
        acc = [u["evals"][-1]["greedy_acc"] if u["evals"] else None for u in us]
        acc_steps = sorted({u["evals"][-1]["step"] for u in us if u["evals"]})
        kl = [_window_mean(u["rows"], "kl", max(0, n - W), n) for u, n in zip(us, done)]
        ln = [_window_mean(u["rows"], "response_len", max(0, n - W), n) for u, n in zip(us, done)]
        wall = [unit_wall_s(u) / 60 for u in us]
        acc_txt = _fmt_seeds(acc) + (f" (step {'/'.join(map(str, acc_steps))})" if acc_steps else "")
        lines.append(f"| {name} ({_arm_label(d['arm'])}) | {'/'.join(map(str, done))} of {sc.steps} | {state} | "
                     f"{_fmt_seeds(first)} | {_fmt_seeds(common)} | {_fmt_seeds(last)} | {acc_txt} | {_fmt_seeds(kl, 4)} | "
                     f"{_fmt_seeds(ln, 1)} | {_fmt_seeds(wall, 1)} |")
    return "\n".join(lines)


def eval_table(s: dict) -> str:
    sc = s["config"]
    steps = sorted({e["step"] for d in s["arms"].values() for u in d["units"] for e in u["evals"]})
    if not steps:
        return "(no held-out evaluation yet)"
    base = s["base"].get("greedy_acc")
    lines = ["| arm | step 0 (base) | " + " | ".join(f"step {k}" for k in steps) + " |",
             "|---|---|" + "---|" * len(steps)]
    for name, d in s["arms"].items():
        cells = []
        for k in steps:
            cells.append(_fmt_seeds([next((e["greedy_acc"] for e in u["evals"] if e["step"] == k), None)
                                     for u in d["units"]]))
        lines.append(f"| {name} | {'-' if base is None else f'{base:.3f}'} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\nCells: mean over seeds [min, max], greedy decoding, {sc.n_eval} held-out prompts."


def _band(ax, curves: list[np.ndarray], label: str, color):
    n = max((len(c) for c in curves), default=0)
    if n == 0:
        return
    M = np.full((len(curves), n), np.nan)
    for i, c in enumerate(curves):
        M[i, :len(c)] = c
    x = np.arange(1, n + 1)
    with np.errstate(all="ignore"):
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean, lo, hi = np.nanmean(M, 0), np.nanmin(M, 0), np.nanmax(M, 0)
    ax.plot(x, mean, label=label, color=color, lw=1.6)
    ax.fill_between(x, lo, hi, color=color, alpha=0.18, lw=0)


def plots(s: dict, folder: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sc = s["config"]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    paths = []
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, (name, d) in enumerate(s["arms"].items()):
        _band(ax, [_smooth(_series(u["rows"], "reward_mean")) for u in d["units"] if u["rows"]], name,
              colors[i % len(colors)])
        for u in d["units"]:
            if u["status"]["state"] == "diverged":
                ax.axvline(u["status"]["diverged_at"], color=colors[i % len(colors)], ls=":", lw=1)
    ax.set(xlabel="GRPO step", ylabel=f"rollout reward ({WINDOW}-step moving average)", xlim=(0, sc.steps),
           title=f"Rollout reward, mean over {len(sc.seeds)} seeds, band = min-max over seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(folder / "rl_reward.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, (name, d) in enumerate(s["arms"].items()):
        c = colors[i % len(colors)]
        _band(axes[0], [_smooth(_series(u["rows"], "kl")) for u in d["units"] if u["rows"]], name, c)
        _band(axes[1], [_smooth(_series(u["rows"], "response_len")) for u in d["units"] if u["rows"]], name, c)
        steps = sorted({e["step"] for u in d["units"] for e in u["evals"]})
        if steps:
            base = s["base"].get("greedy_acc", np.nan)
            vals = [[next((e["greedy_acc"] for e in u["evals"] if e["step"] == k), np.nan) for u in d["units"]]
                    for k in steps]
            mean = [np.nanmean(v) for v in vals]
            axes[2].plot([0] + steps, [base] + mean, marker="o", color=c, label=name)
            axes[2].fill_between([0] + steps, [base] + [np.nanmin(v) for v in vals],
                                 [base] + [np.nanmax(v) for v in vals], color=c, alpha=0.15, lw=0)
    axes[0].set(xlabel="GRPO step", ylabel="k3 KL to base (per response token)", title="KL to the base model")
    axes[1].set(xlabel="GRPO step", ylabel="tokens", title=f"Rollout response length (cap {sc.grpo.max_new_tokens})")
    axes[2].set(xlabel="GRPO step", ylabel="accuracy", title=f"Held-out greedy accuracy ({sc.n_eval} prompts)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    paths.append(folder / "rl_curves.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def write_report(out: str | pathlib.Path, folder: str | pathlib.Path) -> str:
    """Writes results.md + the PNGs into `folder`; returns the markdown."""
    out, folder = pathlib.Path(out), pathlib.Path(folder)
    if not (out / "study.json").is_file():
        raise FileNotFoundError(f"{out} holds no study (no study.json); "
                                f"run `python -m experiments.rl_study --out {out}` first")
    folder.mkdir(parents=True, exist_ok=True)
    s = summarize(out)
    sc = s["config"]
    g = sc.grpo
    units = [u for d in s["arms"].values() for u in d["units"]]
    done = sum(steps_logged(u) for u in units)
    total = sc.steps * len(units)
    partial = done < total and not all(u["status"]["state"] in ("done", "diverged") for u in units)
    pngs = plots(s, folder)
    base = s["base"]
    md = ["# RL parity study (GRPO): results" + (" - PARTIAL" if partial else ""), "",
          f"{done} of {total} unit-steps done ({len(sc.arms)} arms x {len(sc.seeds)} seeds x {sc.steps} steps)"
          + (": **partial results**, every number below is at the step each seed reached." if partial else "."), "",
          f"Task: generated arithmetic with {'one operation' if sc.max_ops == 1 else f'1..{sc.max_ops} operations'} "
          f"(`train.tasks`, chat template), "
          f"{sc.n_train} train prompts, {sc.n_eval} held-out prompts. Base model (no adapter) held-out greedy "
          f"accuracy: **{base.get('greedy_acc', float('nan')):.3f}** (mean length {base.get('greedy_len', float('nan')):.1f} "
          f"tokens). GRPO: {g.prompts_per_step} prompts x {g.group_size} rollouts per step, temperature "
          f"{g.temperature}, up to {g.max_new_tokens} new tokens, clip {g.clip_eps}, k3 KL coefficient {g.kl_coef}, "
          f"{g.inner_steps} optimizer step per batch, AdamW, cosine decay to {g.optimizer.end_lr_ratio}x over "
          f"{sc.steps} steps, no warmup; adapters start at the identity (LoRA B = 0, DiReFT W = b = 0). "
          f"Config hash `{s['meta']['config_hash']}`.", "",
          "Cells with several seeds: mean [min, max] over seeds. Reward = 1 when the completion's final number is "
          "the answer; KL = mean k3 estimate per response token against the base model. Steps done = steps "
          "logged (a pass in flight included). Wall = rollouts + updates + held-out evals of one seed on a shared "
          "2-core CPU (other jobs ran alongside: compare arms, not absolute times).", "",
          table(s), "", "Held-out greedy accuracy over training:", "", eval_table(s), ""]
    md += [f"![{p.stem}]({p.name})" for p in pngs]
    text = "\n".join(md) + "\n"
    (folder / "results.md").write_text(text)
    return text
