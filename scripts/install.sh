#!/usr/bin/env bash
# Install arl into ./.venv on a fresh machine. torch goes in FIRST and pinned to the CPU build
# (2.13.0, a local wheel on our machines): any other torch would pull a multi-GB CUDA build.
# Idempotent: re-running only installs what changed. Usage: scripts/install.sh [extras, default: dev]
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
python_bin="${PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null 2>&1 || python_bin=python3
venv=.venv
if [ ! -x "$venv/bin/python" ]; then
    "$python_bin" -m venv "$venv"
fi
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
torch_version="${ARL_TORCH_VERSION:-2.13.0}"
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$torch_version') else 1)" 2>/dev/null; then
    echo "installing torch==$torch_version (CPU build) first"
    "$py" -m pip install -q "torch==$torch_version"
fi
# Every later resolution must keep this torch: a constraints file makes pip refuse to swap it.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"$py" -c "import torch; print('torch==' + torch.__version__)" > "$constraints"
echo "installing arl[$extras]"
"$py" -m pip install -q -c "$constraints" -e ".[$extras]"
"$py" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "arl installed in $venv ($("$venv/bin/arl" --help >/dev/null && echo ok))"
