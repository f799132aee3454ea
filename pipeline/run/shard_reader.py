"""Read one published step of trajectories: its manifest, its Parquet parts, checked before they are trusted.

The writing side and the contracts are in `pipeline.run.shards` (which re-exports these readers, the names
callers import). Only a step with a manifest is read (`StepNotFound` otherwise); each part's sha256 is checked
against the manifest, because a shared file system can hand back a truncated or stale file long after the
writer is gone; the schema version and the column types are checked against `schemas.trajectory`.
"""

from __future__ import annotations

import functools
import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError

from pipeline.errors import ArlError, SchemaError
from pipeline.run.paths import MANIFEST, RunPaths
from schemas.manifest import Manifest
from schemas.trajectory import SCHEMA, SCHEMA_VERSION, check_file_metadata, schema_with_metadata


class StepNotFound(ArlError, FileNotFoundError):
    """The step has no manifest: its writer has not finished (or was killed before publishing)."""


def list_complete_steps(paths: RunPaths) -> list[int]:
    """Steps whose manifest exists (ascending): the only ones a reader may touch."""
    return paths.complete_steps()


def read_manifest(paths: RunPaths, step: int) -> Manifest:
    return _load_manifest(paths.step_dir(step), paths)


def read_step(paths: RunPaths, step: int, *, verify: bool = True, columns: list[str] | None = None) -> pa.Table:
    """One complete step as a table (all parts, in order); `columns` reads only those."""
    table, _ = read_step_dir(paths.step_dir(step), verify=verify, columns=columns, paths=paths)
    return table


def read_step_dir(
    step_dir: Path, *, verify: bool = True, columns: list[str] | None = None, paths: RunPaths | None = None
) -> tuple[pa.Table, Manifest]:
    """Read a step dir anywhere (not necessarily inside a run dir): its table and manifest."""
    manifest = _load_manifest(step_dir, paths)
    _check_columns(columns)
    tables = []
    for part in manifest.parts:
        path = step_dir / part.file
        if not path.exists():
            raise _missing_part(path, step_dir, manifest)
        table = read_part(path, columns=columns, expected_sha256=part.sha256 if verify else None)
        if table.num_rows != part.rows:
            raise SchemaError(f"{path}: holds {table.num_rows} rows, the manifest says {part.rows}")
        tables.append(table)
    if not tables:
        empty = schema_with_metadata(manifest.tokenizer).empty_table()
        return (empty.select(columns) if columns is not None else empty), manifest
    return pa.concat_tables(tables), manifest


def read_part(path: str | Path, *, columns: list[str] | None = None, expected_sha256: str | None = None) -> pa.Table:
    """One Parquet part: checksum (if given), schema version and column types checked."""
    path = Path(path)
    _check_columns(columns)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SchemaError(f"{path}: cannot read: {exc.strerror or exc}") from None
    # Hash on a second thread while Arrow decodes (both release the GIL): without SHA CPU
    # instructions sha256 runs at ~200 MB/s and would otherwise add a third to every read.
    hasher = _hash_pool().submit(_sha256, data) if expected_sha256 is not None else None
    parse_error: Exception | None = None
    try:
        reader = pq.ParquetFile(pa.BufferReader(data))
        check_file_metadata(reader.schema_arrow.metadata, where=str(path))
        table = reader.read(columns=columns)
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError, SchemaError) as exc:
        parse_error = exc  # reported after the checksum: a bad checksum is the better explanation
    if hasher is not None and (actual := hasher.result()) != expected_sha256:
        raise _checksum_mismatch(path, actual, str(expected_sha256))
    if isinstance(parse_error, SchemaError):
        raise parse_error
    if parse_error is not None:
        raise SchemaError(f"{path}: not a readable Parquet file: {parse_error}") from None
    expected = pa.schema([SCHEMA.field(name) for name in table.column_names])
    if not table.schema.remove_metadata().equals(expected):
        raise SchemaError(f"{path}: column types differ from trajectory schema v{SCHEMA_VERSION}:\n{table.schema}")
    return table


def step_part_files(
    step_dir: Path,
    *,
    verify: bool = True,
    paths: RunPaths | None = None,
) -> tuple[Manifest, list[Path]]:
    """A complete step's manifest and part files, each present and (`verify`) matching its manifest checksum,
    without decoding them: for readers that hand the files to another engine (`arl query` gives them to DuckDB).
    Raises what `read_step_dir` raises for a step without a manifest, a missing part or a bad checksum."""
    manifest = _load_manifest(step_dir, paths)
    files = []
    for part in manifest.parts:
        path = step_dir / part.file
        if not verify:
            if not path.is_file():
                raise _missing_part(path, step_dir, manifest)
            files.append(path)
            continue
        try:
            with path.open("rb") as handle:
                actual = hashlib.file_digest(handle, "sha256").hexdigest()
        except FileNotFoundError:
            raise _missing_part(path, step_dir, manifest) from None
        except OSError as exc:
            raise SchemaError(f"{path}: cannot read: {exc.strerror or exc}") from None
        if actual != part.sha256:
            raise _checksum_mismatch(path, actual, part.sha256)
        files.append(path)
    return manifest, files


def _missing_part(path: Path, step_dir: Path, manifest: Manifest) -> SchemaError:
    return SchemaError(f"{path}: listed in {step_dir / MANIFEST} but missing; re-write step {manifest.step}")


def _checksum_mismatch(path: Path, actual: str, expected: str) -> SchemaError:
    return SchemaError(
        f"{path}: sha256 {actual[:16]}… does not match the manifest's {expected[:16]}…: "
        "the file is corrupt or was replaced; re-write the step"
    )


@functools.cache
def _hash_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="arl-sha256")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_columns(columns: list[str] | None) -> None:
    unknown = [c for c in columns or [] if c not in SCHEMA.names]
    if unknown:
        raise SchemaError(f"unknown columns {unknown}; the shard columns are {SCHEMA.names}")


def _load_manifest(step_dir: Path, paths: RunPaths | None) -> Manifest:
    path = step_dir / MANIFEST
    if not path.exists():
        done = f"; complete steps: {paths.complete_steps()}" if paths is not None else ""
        raise StepNotFound(
            f"{step_dir} is not a complete step: no {MANIFEST} (its writer has not finished, or "
            f"was killed before publishing){done}"
        )
    try:
        manifest = Manifest.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        raise SchemaError(f"{path}: not a valid step manifest: {exc}") from None
    if manifest.schema_version != SCHEMA_VERSION:
        raise SchemaError(
            f"{path}: trajectory schema version {manifest.schema_version}, this arl reads version {SCHEMA_VERSION}"
        )
    return manifest
