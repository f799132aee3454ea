#!/usr/bin/env bash
# Build .sglang-venv: SGLang's Python code on CPU, to judge arl's SGLang contract
# (tests/integration/test_sglang_contract.py, marker `sglang`). SGLang cannot serve a model here (its
# kernels are CUDA-only), but its command-line parser, HTTP app, tokenizer and detokenizer managers and
# request/response code run on CPU; tests/integration/sglang_judge.py serves them.
# Measured on the 2-core dev machine (2026-11-25): ~1m10s with an empty pip cache, 2.5 GB (triton 1.0 GB,
# torch 0.75 GB, sglang 0.22 GB); 1m23s on 2026-11-29 with the machine busy. Built once per machine under
# ~/.cache/arl/venvs and linked as .sglang-venv (scripts/venv_cache.sh), so a fresh clone reuses it; an
# existing, working venv is kept (a second run takes ~20 s: the import probe).
#
#   scripts/sglang_venv.sh [VENV_DIR]      (default: .sglang-venv at the repository root)
#
# How (each step found by trying, on sglang 0.5.23):
# * torch 2.13.0 first, the local CPU wheel, and every later pip call constrained to it: sglang pins
#   torch==2.14.1 and an unconstrained install replaces the CPU torch with a CUDA build.
# * sglang itself with --no-deps (its requirements pull CUDA kernels, flash-attn, nvshmem, ...), then
#   only what `sglang.srt.managers.io_struct`, `sglang.srt.server_args` and
#   `sglang.srt.entrypoints.http_server` import (DEPS below), at sglang's own pins where it has them.
# * triton: imported unconditionally; its wheel installs under the constraint (SGLang then warns that
#   triton is unsupported on this platform and falls back to CPU code).
# * torchvision: a stub module (written below). SGLang imports it at module level for image models;
#   the real wheel does not load against the CPU torch (`operator torchvision::nms does not exist`).
# * arl is not installed here: the tests run arl's own client in arl's venv and talk HTTP to the judge.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.sglang-venv}"
PYTHON="${PYTHON:-python3.11}"
SGLANG_PACKAGE="${SGLANG_PACKAGE:-sglang==0.5.23}"
TORCH="torch==2.13.0"
DEPS=(numpy orjson psutil pybase64 requests packaging pillow msgspec pydantic pyzmq tqdm IPython aiohttp
      triton "transformers==5.19.0" "tokenizers==0.23.2" dill "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1"
      "compressed-tensors==0.18.0" gguf "openai==2.8.0" partial_json_parser uvicorn uvloop fastapi
      python-multipart setproctitle einops jsonschema "xgrammar==0.2.7" "soundfile==0.13.1")
PROBE="import sglang.srt.managers.io_struct, sglang.srt.server_args, sglang.srt.entrypoints.http_server"

# shellcheck source=scripts/venv_cache.sh
source scripts/venv_cache.sh
DIR="$(venv_build_dir "$VENV" sglang scripts/sglang_venv.sh "$("$PYTHON" -V)" "$SGLANG_PACKAGE")"
if [ "$DIR" != "$VENV" ]; then
    exec 9>"$DIR.lock"
    flock 9
fi
if [ -x "$DIR/bin/python" ] && "$DIR/bin/python" -W ignore -c "$PROBE" >/dev/null 2>&1; then
    venv_link "$VENV" "$DIR"
    echo "sglang venv ready: $VENV -> $DIR ($("$DIR/bin/python" -c 'from sglang.version import __version__; print(__version__)'))"
    exit 0
fi
rm -rf "$DIR"
"$PYTHON" -m venv "$DIR"
CONSTRAINTS="$DIR/torch-constraint.txt"
echo "$TORCH" > "$CONSTRAINTS"
PIP=("$DIR/bin/pip" install --quiet --constraint "$CONSTRAINTS")
"$DIR/bin/pip" install --quiet --upgrade pip
"${PIP[@]}" "$TORCH"
"${PIP[@]}" --no-deps "$SGLANG_PACKAGE"
"${PIP[@]}" "${DEPS[@]}"
"$DIR/bin/pip" uninstall --quiet -y torchvision 2>/dev/null || true  # in case a dependency pulled it in
SITE="$("$DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$SITE/torchvision"
cat > "$SITE/torchvision/__init__.py" <<'EOF'
"""A stub of torchvision, written by arl's scripts/sglang_venv.sh: the real wheel does not load next to
the CPU torch. SGLang imports torchvision at module level for image models only; every attribute here is
an inert placeholder, so those imports succeed and nothing image-related can run."""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder

    def __call__(cls, *args, **kwargs):
        return _Placeholder

    def __getitem__(cls, item):
        return _Placeholder


class _Placeholder(metaclass=_Meta):
    pass


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())
sys.modules[__name__].__class__ = _StubModule
EOF
"$DIR/bin/python" -W ignore -c "$PROBE; import torch; from sglang.version import __version__ as v
assert torch.__version__.startswith('2.13.0'), torch.__version__
print('sglang venv built:', '$DIR', 'sglang', v, 'torch', torch.__version__)"
venv_link "$VENV" "$DIR"
