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
.venv/bin/ruff check .
.venv/bin/mypy pipeline stages schemas
.venv/bin/python -m pytest "$@"
