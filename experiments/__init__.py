"""Drivers beside the library: experiments, studies, plots and the serving benchmark.

They import the public API of `preft_jax`, `train` and `serve`; nothing in the library imports them
(checked by the import-linter contracts in pyproject.toml, tests/test_layering.py).

    python -m experiments.prefill_vs_all     prefill-only vs all-token SFT rank sweep + GRPO (docs/experiments.md)
    python -m experiments.rl_study           the resumable GRPO parity study (+ --report; docs/experiments.md)
    python -m experiments.precision_check    bf16 vs float32 base SFT loss curves (docs/training.md)
    python -m experiments.sft_plots          SFT loss curves from an experiment folder, as PNG
    python -m experiments.serve_benchmark    serving throughput, base / PreFT / all-token (docs/benchmarks.md)
    python -m experiments.serve_plots        the throughput plot from docs/benchmarks.md's tables

`rl_folder` owns the RL study's config and folder layout; `rl_study` runs it and `rl_report` renders it.
"""
