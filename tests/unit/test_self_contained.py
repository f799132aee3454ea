"""The repository is self-contained: every contract is in docs/, and nothing points outside the repo.

A user who clones arl has only the repository, so no file may cite a specification, a note or an
issue that lives elsewhere, and every relative link of the docs must lead to a file (and heading)
that exists.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()
FORBIDDEN = {
    "a section of an outside specification": re.compile(r"SPEC §"),
    "an outside specification file": re.compile(r"SPEC\.md"),
    "a path outside the repository": re.compile(r"\.\./shared|/work/shared"),
    "an issue number": re.compile(r"issue #\d+", re.IGNORECASE),
}
_WALKED = ("pipeline", "stages", "schemas", "slurm", "scripts", "tests", "examples", "docs", "benchmarks")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_DOC_CITATION = re.compile(r"docs/([\w-]+\.md)(?:[,;]? \(?\"([^\"\n]+)\")?")
"""`docs/proxy.md`, optionally followed by a quoted section: `docs/proxy.md, "Keys"`."""


def repo_files() -> list[Path]:
    """Tracked files plus new ones not ignored (a checkout without git: the source directories)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, check=True).stdout.decode()  # fmt: skip
        names = [REPO / name for name in out.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        names = [p for top in _WALKED for p in (REPO / top).rglob("*")] + list(REPO.glob("*"))
    return [p for p in names if p.is_file()]


def text_of(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None  # binary (images, parquet fixtures)
    return data.decode("utf-8", errors="replace")


def test_no_file_points_outside_the_repository() -> None:
    found = []
    for path in repo_files():
        if path.resolve() == THIS or (text := text_of(path)) is None:
            continue
        for what, pattern in FORBIDDEN.items():
            for match in pattern.finditer(text):
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{path.relative_to(REPO)}:{line}: {what} ({match.group(0)!r})")
    assert not found, "cite the doc in docs/ that holds the contract instead:\n" + "\n".join(found)


def test_every_cited_doc_and_section_exists() -> None:
    """Code and docs cite contracts as `docs/<file>.md` (and a section by the start of its heading)."""
    missing = []
    for path in repo_files():
        if path.resolve() == THIS or (text := text_of(path)) is None:
            continue
        for match in _DOC_CITATION.finditer(text):
            doc, section = REPO / "docs" / match.group(1), match.group(2)
            where = f"{path.relative_to(REPO)}:{text.count(chr(10), 0, match.start()) + 1}"
            if not doc.exists():
                missing.append(f"{where}: no such doc {match.group(0)}")
            elif section and not any(h.startswith(section) for h in headings(doc)):
                missing.append(f"{where}: {doc.name} has no section starting {section!r}")
    assert not missing, "\n".join(missing)


def headings(path: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return [m.group(1).replace("`", "").strip() for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)]


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = _without_code(path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def _without_code(text: str) -> str:
    """Fenced blocks and inline code spans: their brackets are code, not links or headings."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


MARKDOWN = sorted([*(REPO / "docs").glob("*.md"), REPO / "README.md"])


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc: Path) -> None:
    broken = []
    for match in _LINK.finditer(_without_code(doc.read_text())):
        target = match.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (doc.parent / file_part).resolve() if file_part else doc
        if not resolved.exists():
            broken.append(f"{target}: no such file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor} in {resolved.name}")
    assert not broken, f"{doc.relative_to(REPO)}:\n" + "\n".join(broken)
