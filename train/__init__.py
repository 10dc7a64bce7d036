"""Adapter training for preft_jax: SFT (`train.sft`) and GRPO (`train.grpo`), prefill-only or all-token.

Modules: `config` (nested frozen configs shared by both trainers), `trainer` (the one training loop;
SFT and GRPO subclass it with their loss and batch source), `distributed` (jax.distributed start-up,
global mesh, per-process batches), `cli` (flags shared by both CLIs), `tasks` (generated math tasks +
verifier), `data` (jsonl via `datasets`, tokenization, batching), `common` (teacher-forced log-probs,
sharded train state), `checkpoint` (Orbax + PEFT/ReFT export). See docs/training.md. The experiments
that drive it (prefill-only vs all-token, the RL parity study, bf16 vs f32) live in `experiments/`.
"""
