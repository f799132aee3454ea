#!/usr/bin/env bash
# The whole test suite, as CI runs it: install, bring up the local Slurm clusters (1-node, and the 2-node
# one in network namespaces), the vLLM CPU venv and the SGLang venv (for the `slurm`, `vllm` and `sglang`
# tests), then ruff, mypy and pytest. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh dev
if [ "${ARL_SKIP_SLURM:-0}" != 1 ] && [ -x scripts/local_slurm.sh ]; then
    scripts/local_slurm.sh up || echo "warning: local Slurm cluster did not come up; slurm tests will skip"
fi
if [ "${ARL_SKIP_SLURM:-0}" != 1 ] && [ "${ARL_SKIP_SLURM2:-0}" != 1 ] && [ -x scripts/local_slurm.sh ]; then
    scripts/local_slurm.sh up --nodes 2 ||
        echo "warning: 2-node Slurm cluster (network namespaces) did not come up; 2-node slurm tests will skip"
fi
if [ "${ARL_SKIP_VLLM:-0}" != 1 ] && [ -x scripts/vllm_venv.sh ]; then
    scripts/vllm_venv.sh || echo "warning: vLLM CPU venv not built; vllm tests will skip"
fi
if [ "${ARL_SKIP_SGLANG:-0}" != 1 ] && [ -x scripts/sglang_venv.sh ]; then
    scripts/sglang_venv.sh || echo "warning: SGLang venv not built; sglang tests will skip"
fi
# The trajectory viewer's browser test drives Debian's chromium (tests/e2e/test_inspect_viewer.py).
if [ "${ARL_SKIP_BROWSER:-0}" != 1 ] && [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null ||
            echo "warning: chromium not installed; the trajectory viewer's browser test will skip"
    else
        echo "warning: no /usr/bin/chromium (install it as root: apt-get install chromium); the browser test will skip"
    fi
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy pipeline stages schemas
.venv/bin/python -m pytest "$@"
