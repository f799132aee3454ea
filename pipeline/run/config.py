"""Load the YAML config with `key.sub=value` overrides; freeze it into and read it from a run dir.

Unknown or mistyped keys are errors naming the key and the valid choices, because a silently
ignored `trainer.lrr=1e-6` costs a user a whole cluster run.
"""

from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from pipeline.errors import ConfigError
from schemas.config import ArlConfig
from schemas.config.base import RENAMED_KEY, UNSUPPORTED


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> ArlConfig:
    """Read `path` (or start from the defaults), apply `key.sub=value` overrides, and validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path))
    for item in overrides:
        key, value = _parse_override(item)
        _check_key(key)
        _set_dotted(raw, key, value)
    return validate_config(raw, source=str(path) if path else "defaults")


def validate_config(raw: dict[str, Any], source: str = "config") -> ArlConfig:
    """Validate a plain dict; turn pydantic's errors into one readable message."""
    try:
        return ArlConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None


def dump_config(config: ArlConfig) -> str:
    """The resolved config as YAML (every field, defaults included) for the run dir."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def config_from_run_dir(run_dir: str | Path) -> ArlConfig:
    """The frozen config a stage runs with (written by `arl launch`)."""
    from pipeline.run.paths import RunPaths

    path = RunPaths(Path(run_dir)).config
    if not path.exists():
        raise ConfigError(f"no config at {path}: is {run_dir} a run dir? (create one with `arl launch`)")
    return load_config(path)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping at the top level, got {type(data).__name__}")
    return data


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.sub=value")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text  # not YAML: keep the literal string (e.g. a path with a colon)
    return key, value


def _check_key(dotted: str) -> None:
    """Walk the models so an override with a typo fails before anything else."""
    model: type[BaseModel] | None = ArlConfig
    walked: list[str] = []
    for part in dotted.split("."):
        if model is None:
            raise ConfigError(f"override key {dotted!r}: {'.'.join(walked)} has no sub-keys")
        fields = model.model_fields
        renamed = getattr(model, "renamed_keys", {})
        if part in renamed:
            raise ConfigError(f"config key {'.'.join([*walked, part])!r} was replaced: {renamed[part]}")
        if part not in fields:
            raise ConfigError(_unknown_key_message(".".join([*walked, part]), part, list(fields)))
        walked.append(part)
        model = _block_of(fields[part].annotation)


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    node = raw
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _unknown_key_message(path: str, name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown config key {path!r}{hint}; valid keys here: {', '.join(sorted(valid))}"


def _block_of(annotation: Any) -> type[BaseModel] | None:
    """The block a field holds: `Block` itself, or the block of an optional one (`Block | None`, e.g.
    `metrics.wandb`, so `metrics.wandb.mode=offline` is a valid override that turns the block on)."""
    candidates = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    blocks = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
    return blocks[0] if len(blocks) == 1 else None


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = ArlConfig
    for part in loc:
        field = model.model_fields.get(str(part)) if model is not None else None
        if field is None:
            return None
        model = _block_of(field.annotation)
    return model


def _format_errors(exc: ValidationError, source: str) -> str:
    """One line for one problem (`invalid config (f.yaml): ...`), else one line per problem."""
    lines = [f"invalid config ({source}):"]
    for err in exc.errors():
        loc = tuple(err["loc"])
        path = ".".join(str(p) for p in loc)
        if err["type"] == UNSUPPORTED:
            lines.append(f"  {err['msg']}")
            continue
        if err["type"] == RENAMED_KEY:
            ctx = err.get("ctx", {})
            lines.append(f"  {'.'.join([*map(str, loc), str(ctx.get('old'))])} was replaced: {ctx.get('hint')}")
            continue
        if err["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            valid = list(parent.model_fields) if parent else []
            lines.append("  " + _unknown_key_message(path, str(loc[-1]), valid))
            continue
        msg = err["msg"]
        expected = err.get("ctx", {}).get("expected")
        if expected:
            msg = f"{msg} (valid choices: {expected})"
        lines.append(f"  {path}: {msg}; got {err.get('input')!r}")
    return f"{lines[0]} {lines[1].strip()}" if len(lines) == 2 else "\n".join(lines)
