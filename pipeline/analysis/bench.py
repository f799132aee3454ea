"""`arl bench`: run every script under benchmarks/ and write benchmarks/RESULTS.md.

Each benchmark is a standalone script that prints its figures for people and ends with one line
`RESULT {json}` for this runner: `{"name": ..., "figures": {label: value}, "ratios": {label: value},
"reference": "what the ratios compare against", "targets": {label: "met"|"missed ..."}}`.
The runner adds the machine and the date, so every figure in RESULTS.md says where it came from.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipeline.errors import ArlError
from pipeline.run.handoff import write_text_atomic

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO_ROOT / "benchmarks"
SKIP = {"__init__", "instant_engine", "megatron_gpu"}  # harnesses and GPU-only scripts


def discover() -> list[Path]:
    return sorted(p for p in BENCH_DIR.glob("*.py") if p.stem not in SKIP and not p.stem.startswith("_"))


def run_benchmarks(only: list[str], timeout_s: float = 3600.0) -> int:
    """Run the benchmarks (all, or those named in `only`), print their output, write RESULTS.md."""
    scripts = discover()
    if only:
        unknown = sorted(set(only) - {p.stem for p in scripts})
        if unknown:
            raise ArlError(f"unknown benchmark(s) {unknown}; available: {[p.stem for p in scripts]}")
        scripts = [p for p in scripts if p.stem in only]
    results, failures = [], []
    for script in scripts:
        print(f"== {script.stem}", flush=True)
        result = _run_one(script, timeout_s)
        if result is None:
            failures.append(script.stem)
        else:
            results.append(result)
    out = write_results(results, failures)
    print(f"wrote {out}")
    return 1 if failures else 0


def _run_one(script: Path, timeout_s: float) -> dict[str, Any] | None:
    started = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(
            [sys.executable, str(script)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        print(f"   timed out after {timeout_s:.0f}s")
        return None
    sys.stdout.write(proc.stdout)
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    if proc.returncode != 0 or result is None:
        sys.stdout.write(proc.stderr[-4000:])
        print(f"   failed (exit {proc.returncode}, RESULT line {'found' if result else 'missing'})")
        return None
    result.setdefault("name", script.stem)
    result["script"] = f"benchmarks/{script.name}"
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        torch_version = str(torch.__version__)
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except ImportError:
        torch_version, gpu = "absent", "no GPU"
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem_gb:.0f} GiB RAM, {gpu}; Python {platform.python_version()}, "
        f"torch {torch_version}"
    )


_STRUCTURED = {"name", "script", "seconds", "reference", "figures", "ratios", "targets"}


def write_results(results: list[dict[str, Any]], failures: list[str], path: Path | None = None) -> Path:
    """Write RESULTS.md; sections of benchmarks not run this time (`arl bench --only`) are kept as they were."""
    path = path or BENCH_DIR / "RESULTS.md"
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    sections = _existing_sections(path)
    machine = machine_description()
    for result in results:
        sections[result["name"]] = _section(result, now, machine)
    for name in failures:
        sections[name] = f"## {name}\n\nFailed in the run of {now} (see its output).\n"
    note = (
        "Written by `arl bench`; every ratio compares against a reference measured in the same run. Each "
        "section names the machine and the date of its own run (`arl bench --only` reruns some sections)."
    )
    header = f"# Benchmark results\n\nLatest run: {now} on {machine}  \n{note}\n"
    write_text_atomic(path, "\n".join([header, *(sections[k] for k in sorted(sections))]))
    return path


def _section(result: dict[str, Any], date: str, machine: str) -> str:
    # Scripts may print flat RESULT objects: every top-level scalar beyond the structured keys is a figure.
    figures = dict(result.get("figures", {}))
    figures.update({k: v for k, v in result.items() if k not in _STRUCTURED and not isinstance(v, dict | list)})
    run = f"{result['seconds']} s, {date}, {_MEASURED_ON}{machine}"
    lines = [
        f"## {result['name']}",
        "",
        f"`{result['script']}` ({run}). Reference: {result.get('reference', '-')}",
        "",
        "| figure | value |",
        "| --- | --- |",
    ]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in figures.items()]
    lines += [f"| ratio: {k} | {_fmt(v)} |" for k, v in result.get("ratios", {}).items()]
    lines += [f"| target: {k} | {v} |" for k, v in result.get("targets", {}).items()]
    return "\n".join(lines) + "\n"


_MEASURED_ON = "measured on "


def _existing_sections(path: Path) -> dict[str, str]:
    """The sections of an existing RESULTS.md; one written before sections named their machine gets the
    machine of that file's header (the machine of its run then)."""
    if not path.exists():
        return {}
    text = path.read_text()
    old_machine = next(
        (line.removeprefix("Machine:").strip() for line in text.splitlines() if line.startswith("Machine:")), None
    )
    sections: dict[str, str] = {}
    for chunk in text.split("\n## ")[1:]:
        name = chunk.split("\n", 1)[0].strip()
        section = "## " + chunk.rstrip("\n") + "\n"
        if old_machine and _MEASURED_ON not in section:
            head, sep, rest = section.partition(")")
            section = f"{head}, {_MEASURED_ON}{old_machine}{sep}{rest}" if sep else section
        sections[name] = section
    return sections


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and abs(value) < 0.01:
            return f"{value:.3g}"  # a tolerance or a log-prob difference, not a zero
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)
