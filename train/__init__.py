"""Adapter training for preft_jax: SFT (`train.sft`) and GRPO (`train.grpo`), prefill-only or all-token.

Modules: `tasks` (generated math tasks + verifier), `data` (jsonl via `datasets`, tokenization,
batching), `common` (teacher-forced log-probs, optimizer, sharded train state), `checkpoint`
(Orbax + PEFT/ReFT export), `experiment` (the SmolLM2 prefill-only vs all-token comparison).
See docs/training.md.
"""
