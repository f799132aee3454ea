"""The SGLang venv's one-shot judgements (`sglang_judge.py answer`) from one process, for every module that asks
(the `judge_json` fixture, conftest.py): it imports SGLang once (~6 s on 2 cores) and runs each job in a fork
of itself."""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pipeline.engine.inference.procs import REPO_ROOT

SGLANG_PYTHON = REPO_ROOT / ".sglang-venv" / "bin" / "python"
JUDGE = Path(__file__).with_name("sglang_judge.py")
JudgeJson = Callable[..., dict[str, Any]]


@contextlib.contextmanager
def sglang_answers(log: Path) -> Iterator[JudgeJson]:
    """`ask(mode, "--", *argv, stdin=None)`: a one-shot judge mode (`routes`, `parse-args`, `check-bodies` with
    `stdin`) and its JSON answer, from one `sglang_judge.py answer` process (its stderr goes to `log`)."""
    with log.open("w") as stderr:
        server = subprocess.Popen([str(SGLANG_PYTHON), "-W", "ignore", str(JUDGE), "answer"], text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)  # fmt: skip
    assert server.stdin is not None and server.stdout is not None

    def ask(*args: str, stdin: Any = None) -> dict[str, Any]:
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(json.dumps({"args": list(args), "stdin": stdin}) + "\n")
        server.stdin.flush()
        line = server.stdout.readline()
        assert line, f"judge {args[:1]}: the judge exited {server.poll()}:\n{log.read_text()[-4000:]}"
        answer: dict[str, Any] = json.loads(line)
        assert "judge_error" not in answer, f"judge {args[:1]}: {answer['judge_error']}\n{log.read_text()[-4000:]}"
        return answer

    try:
        yield ask
    finally:
        server.stdin.close()
        server.kill()  # every job is answered; its interpreter's own exit (SGLang's modules) took ~1.5 s
        server.wait(timeout=60)
