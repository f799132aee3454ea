"""docs/cli.md documents every `arl` command and every option it takes (checked against the app itself)."""

from __future__ import annotations

import re
from pathlib import Path

import typer
from typer.testing import CliRunner

from pipeline.cli import app

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def _sections() -> dict[str, str]:
    """`## \\`arl <name> ...\\`` heading -> the text up to the next heading."""
    parts = re.split(r"^(## `arl ([a-z-]+)[^`]*`)$", DOC.read_text(), flags=re.M)
    return {parts[i + 1]: parts[i] + parts[i + 2] for i in range(1, len(parts) - 2, 3)}


def test_every_command_and_option_is_documented() -> None:
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    sections = _sections()
    assert set(sections) == set(commands), "docs/cli.md has one section per command, no more"
    for name, command in commands.items():
        for flag in (max(p.opts, key=len) for p in command.params if p.opts[0].startswith("--")):
            assert flag in sections[name], f"docs/cli.md: `arl {name}` does not mention {flag}"


def test_usage_mistakes_exit_2_without_traceback(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "file").write_text("")
    result = CliRunner().invoke(app, ["make-tiny-model", str(tmp_path / "model")])
    assert result.exit_code == 2 and "error: model directory exists" in result.output
    result = CliRunner().invoke(app, ["stage", "train", "--run-dir", str(tmp_path / "typo")])
    assert result.exit_code == 2 and "no config at" in result.output
    assert not (tmp_path / "typo").exists()
