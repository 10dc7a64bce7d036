"""Prefill-only (PreFT) vs all-token adapters on SmolLM2-135M-Instruct: a CPU-sized experiment.

1. SFT: response-token eval loss of LoRA at ranks 4, 16, 64 and one LoReFT row, each trained in
   prefill-only and in all-token mode with identical data, steps and optimizer.
2. GRPO: a short run per mode on single-operation arithmetic with the verifiable reward; reward
   mean per step, plus greedy accuracy on held-out prompts before and after.

Results go to `<out>/results.json` (updated after every run) and, with --doc, to a markdown
report. `--quick` shrinks everything (smoke test).

    python -m experiments.prefill_vs_all --out runs/experiment --doc docs/experiments.md

The resumable GRPO parity study is `python -m experiments.rl_study` (experiments/rl_study.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import pathlib
import platform
import time

import jax
import numpy as np

from preft_jax.generation import ModelRunner
from preft_jax.loading import load_model
from preft_jax.model import Llama
from preft_jax.progress import progress, set_quiet
from preft_jax.sampling import SamplingParams
from train.data import encode_prompt, eval_batches, load_split, tokenize_dataset, write_dataset
from train.config import AdapterSpec, JsonConfig, OptimizerConfig
from train.grpo import GRPOConfig, GRPOTrainer, text_reward_fn
from train.sft import SFTConfig, SFTTrainer
from train.tasks import reward

log = logging.getLogger("experiments.prefill_vs_all")

SFT_ROWS = (("lora", 4), ("lora", 16), ("lora", 64), ("reft", 8))
MODES = ("prefill", "all")
READING_MARKER = "<!-- reading: kept when the report is regenerated -->"


@dataclasses.dataclass(frozen=True)
class ExperimentConfig(JsonConfig):
    """The datasets, and one SFT and one GRPO config that every run varies (adapter kind, rank, mode, lr)."""
    n_train: int = 320
    n_eval: int = 48
    sft: SFTConfig = SFTConfig(steps=24, batch_size=8, eval_batch_size=16, seq_len=96, log_every=5,
                               optimizer=OptimizerConfig(lr=1e-3, warmup_steps=2))
    reft_lr: float = 2e-3                 # the LoReFT rows' lr (LoRA rows: sft.optimizer.lr)
    grpo: GRPOConfig = GRPOConfig(adapter=AdapterSpec(kind="lora", rank=8), steps=16, prompts_per_step=4,
                                  group_size=4, max_new_tokens=24, temperature=0.7, kl_coef=0.04,
                                  optimizer=OptimizerConfig(lr=1e-3))
    grpo_n_train: int = 64
    grpo_n_eval: int = 32
    # extra GRPO runs as (mode, lr): prefill-only with a larger step size (its KL moves ~5x slower)
    grpo_extra: tuple[tuple[str, float], ...] = (("prefill", 3e-3),)
    seed: int = 0                         # dataset generation

    @classmethod
    def quick(cls) -> "ExperimentConfig":
        d = cls()
        return cls(n_train=32, n_eval=16, grpo_n_train=8, grpo_n_eval=8,
                   sft=dataclasses.replace(d.sft, steps=2, optimizer=dataclasses.replace(d.sft.optimizer,
                                                                                         warmup_steps=1)),
                   grpo=dataclasses.replace(d.grpo, steps=2, max_new_tokens=8))

    def sft_run(self, adapter: str, rank: int, mode: str) -> SFTConfig:
        lr = self.sft.optimizer.lr if adapter == "lora" else self.reft_lr
        return dataclasses.replace(self.sft, adapter=dataclasses.replace(self.sft.adapter, kind=adapter, rank=rank,
                                                                         mode=mode),
                                   optimizer=dataclasses.replace(self.sft.optimizer, lr=lr))

    def grpo_run(self, mode: str, lr: float) -> GRPOConfig:
        return dataclasses.replace(self.grpo, adapter=dataclasses.replace(self.grpo.adapter, mode=mode),
                                   optimizer=dataclasses.replace(self.grpo.optimizer, lr=lr))


def greedy_accuracy(runner, tok, bank, prompts, answers, max_new_tokens) -> float:
    ids = None if bank is None else [1] * len(prompts)
    gens = runner.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                                                   stop_token_ids=tok.eos_token_ids), bank, ids)
    return float(np.mean([reward(tok.decode(g.tokens), a) for g, a in zip(gens, answers)]))


def run(out: pathlib.Path, ec: ExperimentConfig, only: str = "all") -> dict:
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    results["config"] = ec.to_json()
    results["host"] = {"platform": platform.platform(), "devices": [str(d) for d in jax.devices()],
                       "jax": jax.__version__}

    def save():
        results_path.write_text(json.dumps(results, indent=1))

    t_all = time.time()
    cfg, params, tok = load_model()
    runner = ModelRunner(Llama.from_params(cfg, params))

    # ------------------------------------------------------------------------------------- SFT
    if only in ("all", "sft"):
        write_dataset(out / "data", ec.n_train, ec.n_eval, ec.seed)
        seq_len = ec.sft.seq_len
        train = tokenize_dataset(tok, load_split(out / "data", "train"), max_len=seq_len)
        evald = tokenize_dataset(tok, load_split(out / "data", "eval"), max_len=seq_len)
        results["sft_data"] = {"train": len(train), "eval": len(evald),
                               "mean_prompt_tokens": float(np.mean([len(p) for p in train.prompts])),
                               "mean_response_tokens": float(np.mean([len(r) for r in train.responses]))}
        sft = results.setdefault("sft", {})
        bar = progress(None, "SFT runs", total=len(SFT_ROWS) * len(MODES), unit="run")
        for adapter, rank in SFT_ROWS:
            for mode in MODES:
                name = f"{adapter}-r{rank}-{mode}"
                bar.update(1)
                if name in sft:
                    continue
                tc = ec.sft_run(adapter, rank, mode)
                t0 = time.time()
                trainer = SFTTrainer(cfg, runner.graphdef, runner.state, tc)
                if "base_eval_loss" not in results:
                    results["base_eval_loss"] = trainer.eval_loss(
                        trainer.init_state().params, eval_batches(evald, tc.eval_batch_size, tok.pad_token_id,
                                                                  seq_len))
                state, hist = trainer.fit(train, evald, tok.pad_token_id, metrics_path=out / f"sft-{name}.jsonl")
                n_params = int(sum(np.size(x) for x in jax.tree.leaves(state.params)))
                sft[name] = {"adapter": adapter, "rank": rank, "mode": mode, "eval_loss": hist[-1]["eval_loss"],
                             "train_loss_last5": float(np.mean([h["loss"] for h in hist[-5:]])),
                             "params": n_params, "seconds": time.time() - t0}
                log.info("SFT %s: eval loss %.4f (%.0fs)", name, sft[name]["eval_loss"], sft[name]["seconds"])
                save()

    # ------------------------------------------------------------------------------------ GRPO
    if only in ("all", "grpo"):
        write_dataset(out / "grpo_data", ec.grpo_n_train, ec.grpo_n_eval, ec.seed + 1, tasks=("arithmetic",),
                      max_ops=1)
        rows_train, rows_eval = load_split(out / "grpo_data", "train"), load_split(out / "grpo_data", "eval")
        prompts = [encode_prompt(tok, r["question"]) for r in rows_train]
        answers = [int(r["answer"]) for r in rows_train]
        eprompts = [encode_prompt(tok, r["question"]) for r in rows_eval]
        eanswers = [int(r["answer"]) for r in rows_eval]
        grpo = results.setdefault("grpo", {})
        if "base_greedy_acc" not in results:
            results["base_greedy_acc"] = greedy_accuracy(runner, tok, None, eprompts, eanswers,
                                                         ec.grpo.max_new_tokens)
        runs = [(m, m, ec.grpo.optimizer.lr) for m in MODES] + [(f"{m}-lr{lr:g}", m, lr) for m, lr in ec.grpo_extra]
        for name, mode, lr in runs:
            if name in grpo:
                continue
            gc = ec.grpo_run(mode, lr)
            t0 = time.time()
            trainer = GRPOTrainer(cfg, runner, gc, text_reward_fn(tok), tok.eos_token_ids, tok.pad_token_id,
                                  decode=tok.decode)
            state, hist = trainer.fit(prompts, answers, metrics_path=out / f"grpo-{name}.jsonl")
            from preft_jax.adapters.trainable import adapter_bank
            acc = greedy_accuracy(trainer.runner, tok, adapter_bank(cfg, trainer.adapter_config, state.params),
                                  eprompts, eanswers, gc.max_new_tokens)
            grpo[name] = {"mode": mode, "lr": lr, "reward": [h["reward_mean"] for h in hist],
                          "kl": [h["kl"] for h in hist], "response_len": [h["response_len"] for h in hist],
                          "greedy_acc_after": acc, "seconds": time.time() - t0}
            log.info("GRPO %s: rewards %s, greedy acc %.3f (%.0fs)", name, grpo[name]["reward"], acc,
                     grpo[name]["seconds"])
            save()
    results["seconds_this_invocation"] = time.time() - t_all
    save()
    return results


# ------------------------------------------------------------------------------------- report
def _fmt(x, nd=4):
    return "-" if x is None else f"{x:.{nd}f}"


def report(results: dict, command: str) -> str:
    ec = results["config"]
    sft, grpo = ec["sft"], ec["grpo"]
    lines = ["# Experiments: prefill-only (PreFT) vs all-token adapters", "",
             "Generated by `experiments/prefill_vs_all.py` on " + results["host"]["platform"] + f" ({len(results['host']['devices'])} "
             f"CPU device(s), jax {results['host']['jax']}). Model: the embedded SmolLM2-135M-Instruct "
             "(Q4_1 GGUF dequantized to float32).", "", "Command:", "", "```", command, "```", ""]
    if "sft" in results:
        d = results.get("sft_data", {})
        lines += ["## SFT: response-token eval loss", "",
                  f"Generated arithmetic + word problems (`train.tasks`), {d.get('train')} train / {d.get('eval')} eval "
                  f"examples (chat template; mean {d.get('mean_prompt_tokens', 0):.1f} prompt and "
                  f"{d.get('mean_response_tokens', 0):.1f} response tokens), padded to {sft['seq_len']}. "
                  f"{sft['steps']} steps of batch {sft['batch_size']} (AdamW, warmup + cosine, clip 1.0; LoRA lr "
                  f"{sft['optimizer']['lr']}, alpha = 2 * rank, targets q,k,v,o,gate,up,down in all 30 layers; LoReFT lr "
                  f"{ec['reft_lr']}, all 30 layers). Eval loss = token-mean cross-entropy of the eval responses "
                  f"(the adapter evaluated in the mode it was trained in). Base model (no adapter): "
                  f"**{results.get('base_eval_loss', float('nan')):.4f}**.", "",
                  "| adapter | rank | trainable params | prefill-only eval loss | all-token eval loss | gap (prefill - all) |",
                  "|---|---|---|---|---|---|"]
        for adapter, rank in SFT_ROWS:
            p = results["sft"].get(f"{adapter}-r{rank}-prefill")
            a = results["sft"].get(f"{adapter}-r{rank}-all")
            if not p and not a:
                continue
            gap = None if not (p and a) else p["eval_loss"] - a["eval_loss"]
            lines.append(f"| {'LoRA' if adapter == 'lora' else 'LoReFT'} | {rank} | {(p or a)['params']:,} | "
                         f"{_fmt(p and p['eval_loss'])} | {_fmt(a and a['eval_loss'])} | {_fmt(gap)} |")
        secs = sum(r["seconds"] for r in results["sft"].values())
        lines += ["", f"SFT wall time: {secs / 60:.1f} min for {len(results['sft'])} runs.", ""]
    if "grpo" in results:
        g = results["grpo"]
        names = [m for m in MODES if m in g] + [k for k in g if k not in MODES]

        def label(k):
            return {"prefill": "prefill-only", "all": "all-token"}.get(k, k)
        lines += ["## GRPO: reward per step", "",
                  f"Single-operation arithmetic prompts (`tasks=('arithmetic',), max_ops=1`), {ec['grpo_n_train']} "
                  f"train prompts, the same prompts per step for every run. LoRA rank {grpo['adapter']['rank']} (all seven "
                  f"projections) from the identity init (no SFT warm start), {grpo['prompts_per_step']} prompts x "
                  f"{grpo['group_size']} rollouts per step, temperature {grpo['temperature']}, up to "
                  f"{grpo['max_new_tokens']} new tokens, lr {grpo['optimizer']['lr']} unless the run name says otherwise "
                  f"(cosine decay to 0.1x, no warmup), clip 0.2, k3 KL coefficient {grpo['kl_coef']}, one "
                  "optimizer step per rollout batch. Reward = 1 if the completion's final number is the answer. "
                  "Rollouts are `ModelRunner.generate` (prefill-only: adapted prefill, base decode).", "",
                  "| step | " + " | ".join(f"reward {label(k)}" for k in names) + " | "
                  + " | ".join(f"KL {label(k)}" for k in names) + " |",
                  "|---|" + "---|" * (2 * len(names))]
        n = max(len(v["reward"]) for v in g.values())

        def cell(k, key, i, nd):
            return _fmt(g[k][key][i], nd) if i < len(g[k][key]) else "-"
        for i in range(n):
            lines.append(f"| {i + 1} | " + " | ".join(cell(k, "reward", i, 3) for k in names) + " | "
                         + " | ".join(cell(k, "kl", i, 4) for k in names) + " |")
        half = max(1, n // 2)
        lines += ["", f"Summary (greedy accuracy on {ec['grpo_n_eval']} held-out prompts; base model "
                  f"{results.get('base_greedy_acc', float('nan')):.3f}):", "",
                  f"| run | mean reward steps 1-{half} | mean reward steps {half + 1}-{n} | "
                  "mean response tokens, last 4 steps | "
                  "greedy accuracy after |", "|---|---|---|---|---|"]
        for k in names:
            r = g[k]["reward"]
            lines.append(f"| {label(k)} | {np.mean(r[:half]):.3f} | {np.mean(r[half:]):.3f} | "
                         f"{np.mean(g[k]['response_len'][-4:]):.1f} | {g[k]['greedy_acc_after']:.3f} |")
        lines += ["", f"GRPO wall time: {sum(v['seconds'] for v in g.values()) / 60:.1f} min for {len(g)} runs.", ""]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/experiment")
    p.add_argument("--doc", default=None, help="write the markdown report here (e.g. docs/experiments.md)")
    p.add_argument("--only", choices=("all", "sft", "grpo"), default="all")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="only render the SFT loss curves from --out's saved metrics to PNG (experiments/sft_plots.py)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    set_quiet(a.quiet)
    if a.plot:
        from experiments.sft_plots import sft_loss_plot
        print(sft_loss_plot(a.out, a.plot))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ec = ExperimentConfig.quick() if a.quick else ExperimentConfig()
    results = run(pathlib.Path(a.out), ec, a.only)
    text = report(results, "JAX_PLATFORMS=cpu python -m experiments.prefill_vs_all --out " + a.out +
                  (" --doc " + a.doc if a.doc else "") + (" --quick" if a.quick else ""))
    if a.doc:
        doc = pathlib.Path(a.doc)
        old = doc.read_text() if doc.is_file() else ""
        if READING_MARKER in old:          # keep the hand-written reading below the marker
            text = text + "\n" + old[old.index(READING_MARKER):].rstrip("\n")
        doc.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
