"""The `hf` server: the hf engine (`engine.py`) behind the engine app (`app.py`).

* `python -m pipeline.engine.server.hf.process --model-path DIR --port N`: one server process (what the
  inference stage starts, see `procs.py`);
* `serve_hf(config, host=, port=)`: the same, in this process, until it is stopped;
* `start_hf_server(model_path, ...)`: in a background thread of this process, returning a
  `ServerHandle` once it answers (tests and benchmarks: a real server in about a second).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from pipeline.engine.server.app import build_app
from pipeline.engine.server.serve import ServerHandle, config_from_args, serve, serve_in_thread, server_parser

if TYPE_CHECKING:  # at run time imported where used: torch must start after main() set OMP_WAIT_POLICY
    from pipeline.engine.server.hf.engine import HFEngine, HFEngineConfig


def hf_app(engine: HFEngine) -> FastAPI:
    return build_app(engine, title="arl hf engine (SGLang protocol)")


def serve_hf(config: HFEngineConfig, *, host: str, port: int, **uvicorn_options: Any) -> None:
    """Load the model and serve it until the process is told to stop."""
    from pipeline.engine.server.hf.engine import HFEngine

    engine = HFEngine(config)
    engine.start()
    try:
        serve(hf_app(engine), host=host, port=port, **uvicorn_options)
    finally:
        engine.stop()


def start_hf_server(
    model_path: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    device: str = "cpu",
    max_batch_size: int = 64,
    weight_version: int = 0,
    startup_timeout_s: float = 60.0,
    **options: Any,
) -> ServerHandle[HFEngine]:
    """An `hf` server in a background thread (extra `options` go to `HFEngineConfig`); returns once it listens.

    `handle.url` is its address, `handle.server` the `HFEngine`; `handle.stop()` (or a `with` block)
    shuts it down and joins its threads.
    """
    from pipeline.engine.server.hf.engine import HFEngine, HFEngineConfig

    config = HFEngineConfig(
        model_path=str(model_path),
        device=device,
        max_batch_size=max_batch_size,
        weight_version=weight_version,
        **options,
    )
    engine = HFEngine(config)
    engine.start()
    app = hf_app(engine)
    return serve_in_thread(app, engine, host=host, port=port, on_stop=engine.stop, startup_timeout_s=startup_timeout_s)


def main(argv: list[str] | None = None) -> int:
    """Serve one model: `python -m pipeline.engine.server.hf.process --model-path DIR --port N`."""
    from pipeline.run.logs import setup_logging

    parser = server_parser("The arl hf engine, serving SGLang's protocol", max_context=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--return-original-logprob", action="store_true")
    parser.add_argument("--incremental-streaming-output", action="store_true")
    parser.add_argument(
        "--weight-group-timeout-s",
        type=float,
        default=600.0,
        help="deadline of joining a weight-broadcast group and of each receive over it",
    )
    parser.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=256,
        help="memory for the KV cache of finished requests, reused by later requests that share their prefix (0: off)",
    )
    args = parser.parse_args(argv)
    # Before torch starts OpenMP: idle OpenMP workers must sleep, not spin. A spinning worker competes
    # with the event-loop thread for the cores (and the GIL hand-offs between them), which made CPU
    # decoding ~15x slower on a busy 2-core machine (measured: 64 tokens in 7.6 s vs 0.5 s).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    setup_logging()
    from pipeline.engine.server.hf.engine import HFEngineConfig

    config = config_from_args(HFEngineConfig, args)
    serve_hf(config, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    # Import the module proper, so its classes are the ones every other module sees (not `__main__`'s copies).
    from pipeline.engine.server.hf.process import main as _main
    from pipeline.run.logs import freeze_for_exit

    try:
        code = _main()
    finally:
        freeze_for_exit()
    raise SystemExit(code)
