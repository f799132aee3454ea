"""The client side of the engine protocol: what the proxy, the rollout and the trainer import.

`EngineClient` (routing, failover, aborts, admin fan-out) in `engine_client.py` and `admin.py`;
the SGLang response shapes it parses in `wire.py`. The contract it speaks is docs/inference.md.
"""

from pipeline.engine.client.engine_client import EngineClient
from pipeline.engine.client.wire import (
    EngineError,
    GenerateChunk,
    GenerateResult,
    parse_finish_reason,
    parse_weight_version,
)

__all__ = [
    "EngineClient",
    "EngineError",
    "GenerateChunk",
    "GenerateResult",
    "parse_finish_reason",
    "parse_weight_version",
]
