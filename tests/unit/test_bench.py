"""`arl bench` writes RESULTS.md: flat RESULT objects still show their figures, and a partial run
(`--only`) replaces its own sections while keeping the others."""

from __future__ import annotations

from pathlib import Path

from pipeline.analysis.bench import write_results


def _result(name: str, **extra: object) -> dict:
    return {"name": name, "script": f"benchmarks/{name}.py", "seconds": 1.0, **extra}


def test_flat_and_structured_results_render_their_figures(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS.md"
    write_results([_result("flat", read_speedup=34.2, size_ratio=0.153, nested={"x": 1}),
                   _result("structured", figures={"tok/s": 1200.0}, ratios={"a/b": 0.9}, targets={"a/b": "met"})],
                  [], out)  # fmt: skip
    text = out.read_text()
    assert "| read_speedup | 34.200 |" in text and "| size_ratio | 0.153 |" in text
    assert "nested" not in text
    assert "| tok/s | 1,200 |" in text and "| ratio: a/b | 0.900 |" in text and "| target: a/b | met |" in text


def test_a_partial_run_keeps_the_other_sections(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS.md"
    write_results([_result("alpha", figures={"v": 1.0}), _result("beta", figures={"v": 2.0})], [], out)
    write_results([_result("beta", figures={"v": 3.0})], ["gamma"], out)
    text = out.read_text()
    assert "## alpha" in text and "| v | 1.000 |" in text
    assert text.count("## beta") == 1 and "| v | 3.000 |" in text and "| v | 2.000 |" not in text
    assert "## gamma" in text and "Failed" in text


def test_each_section_names_the_machine_of_its_own_run(tmp_path: Path) -> None:
    """A partial run on another machine must not relabel the sections measured elsewhere."""
    out = tmp_path / "RESULTS.md"
    old = (
        "# Benchmark results\n\nMachine: Old Xeon, 2 cores  \nLatest run: 2026-01-01 00:00 UTC  \nnote\n\n"
        "## alpha\n\n`benchmarks/alpha.py` (1.0 s, 2026-01-01 00:00 UTC). Reference: -\n\n| figure | value |\n"
    )
    out.write_text(old)
    write_results([_result("beta", figures={"v": 3.0})], [], out)
    sections = out.read_text().split("\n## ")
    alpha = next(s for s in sections if s.startswith("alpha"))
    beta = next(s for s in sections if s.startswith("beta"))
    assert "measured on Old Xeon, 2 cores)" in alpha
    assert "measured on " in beta and "Old Xeon" not in beta
    write_results([_result("beta", figures={"v": 4.0})], [], out)  # a second partial run changes nothing else
    assert out.read_text().count("measured on Old Xeon") == 1


def test_small_figures_keep_their_digits() -> None:
    from pipeline.analysis.bench import _fmt

    assert _fmt(9.5e-7) == "9.5e-07" and _fmt(0.0) == "0.000" and _fmt(0.25) == "0.250" and _fmt(1234.5) == "1,234"


def test_a_benchmark_past_its_time_limit_fails_and_one_in_time_counts(tmp_path: Path, capsys) -> None:
    """`--timeout-min` is each script's limit: the slow one is stopped and reported, the quick one's RESULT kept."""
    from pipeline.analysis.bench import _run_one

    slow, quick = tmp_path / "slow.py", tmp_path / "quick.py"
    slow.write_text("import time\ntime.sleep(30)\n")
    quick.write_text('print(\'RESULT {"figures": {"v": 1.5}}\')\n')
    assert _run_one(slow, timeout_s=1.0) is None
    assert "timed out after 1s" in capsys.readouterr().out
    result = _run_one(quick, timeout_s=30.0)
    assert result is not None and result["figures"] == {"v": 1.5} and result["name"] == "quick"
