"""The trainer backend factory: `trainer.backend` -> a `TrainBackend` (interface in `backend.py`).

A module of its own because the backends import the interface module: a factory there would make
the interface and its implementations import each other.
"""

from __future__ import annotations

from pipeline.trainer.backend import TrainBackend
from schemas.config import ArlConfig


def make_backend(config: ArlConfig, total_updates: int) -> TrainBackend:
    """The backend named by `trainer.backend`."""
    name = config.trainer.backend
    if name == "torch":
        from pipeline.trainer.torch_backend import TorchBackend

        return TorchBackend(config, total_updates)
    if name == "megatron":
        try:
            from pipeline.trainer.megatron.megatron_backend import MegatronBackend
        except ImportError as exc:
            from pipeline.errors import ConfigError

            raise ConfigError(
                f"trainer.backend=megatron is not available in this install ({exc}); use trainer.backend=torch"
            ) from exc
        return MegatronBackend(config, total_updates)  # type: ignore[no-any-return]
    raise ValueError(f"unknown trainer.backend {name!r}; valid: torch, megatron")
