#!/usr/bin/env bash
# The GPU acceptance run in one command, on a GPU node with SGLang (or vLLM) installed:
#
#   scripts/gpu_acceptance.sh --model /path/to/small-hf-model [--backend vllm] [--steps N] [KEY=VALUE ...]
#
# Runs `arl doctor --gpu "$@"` (docs/gpu-acceptance.md) with the repository's venv (.venv, or
# $ARL_PYTHON) and keeps what it printed in runs/gpu_acceptance-<time>.log (or $ARL_DOCTOR_LOG).
# Exits with arl doctor's status: 0 every check passed, 1 a check failed, 2 a usage error.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${ARL_PYTHON:-.venv/bin/python}"
if ! command -v "$PYTHON" >/dev/null; then
    echo "error: $PYTHON not found: run scripts/install.sh first (or set ARL_PYTHON)" >&2
    exit 2
fi
LOG="${ARL_DOCTOR_LOG:-runs/gpu_acceptance-$(date +%Y%m%d-%H%M%S).log}"
mkdir -p "$(dirname "$LOG")"
PYTHONUNBUFFERED=1 "$PYTHON" -m pipeline.cli doctor --gpu "$@" 2>&1 | tee "$LOG"
code=${PIPESTATUS[0]}
echo "log kept in $LOG"
exit "$code"
