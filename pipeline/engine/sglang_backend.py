"""The `sglang` backend: launch a real SGLang server (`python -m sglang.launch_server`) from the config.

SGLang serves the protocol the rest of arl speaks (SPEC §5), so there is no adapter: the engine
client talks to it directly. Argument names are SGLang's `ServerArgs` flags (`--model-path`,
`--tokenizer-path`, `--host`, `--port`, `--tp-size`, `--mem-fraction-static`, `--dtype`,
`--context-length`, `--weight-version`). `--weight-version` makes `meta_info.weight_version`
the arl version from the first request on (without it SGLang reports "default").

SGLang is not installable on the CPU machines arl is developed on (CUDA-only kernels), so this
module is tested by its command line, and the protocol by running the engine client against our
`hf` server (see docs/inference.md).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field


@dataclass
class SGLangArgs:
    model_path: str
    host: str
    port: int
    tokenizer_path: str | None = None
    tp_size: int = 1
    mem_fraction: float = 0.85
    dtype: str = "auto"
    context_length: int | None = None
    weight_version: int = 0
    python: str | None = None
    extra_args: list[str] = field(default_factory=list)


def sglang_command(args: SGLangArgs) -> list[str]:
    """argv that starts one SGLang server; `extra_args` go last, so they can override anything."""
    argv = [
        args.python or sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        args.model_path,
        "--tokenizer-path",
        args.tokenizer_path or args.model_path,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--tp-size",
        str(args.tp_size),
        "--mem-fraction-static",
        str(args.mem_fraction),
        "--dtype",
        args.dtype,
        "--weight-version",
        str(args.weight_version),
    ]
    if args.context_length is not None:
        argv += ["--context-length", str(args.context_length)]
    return argv + list(args.extra_args)


def sglang_dtype(dtype: str) -> str:
    """arl's `model.dtype` as SGLang's `--dtype` value (the same names)."""
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(dtype, "auto")
