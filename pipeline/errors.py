"""Exceptions that carry a message meant for a person (the CLI prints them without a traceback)."""

from __future__ import annotations


class ArlError(Exception):
    """Base class: the message says what is wrong, with the values involved and the fix."""


class ConfigError(ArlError):
    """The config file or an override is invalid."""


class WaitTimeout(ArlError, TimeoutError):
    """A cross-job wait passed its deadline."""


class SchemaError(ArlError, ValueError):
    """Data does not match a contract in `schemas/` (wrong version, broken invariant, bad checksum)."""
