"""The loop both contract judges (`vllm_judge.py serve`, `sglang_judge.py answer`) answer their jobs with.

Standard library only: it runs inside the vLLM and the SGLang venvs, imported as a sibling script module. The
caller imports the heavy package first; each JSON job on stdin then runs in a fork of that process (no state
shared between jobs) and its answer is one JSON line on the original stdout, while whatever the package prints
goes to stderr. An exception in a job becomes `{"judge_error": ...}`, which the test fails with.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any


def answer_each_in_a_fork(run: Callable[[dict[str, Any]], Any]) -> None:
    """`run(job)` for every job line on stdin, each in its own fork; one answer line per job, in order."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        job = json.loads(line)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the job
            os.close(read)
            try:
                payload = json.dumps(run(job))
            except BaseException as exc:  # reported to the test, which fails with it
                payload = json.dumps({"judge_error": f"{type(exc).__name__}: {exc}"})
            with os.fdopen(write, "w") as out:
                out.write(payload)
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as result:
            payload = result.read()
        _, status = os.waitpid(pid, 0)
        if not payload:
            payload = json.dumps({"judge_error": f"the job's process ended with status {status} and no answer"})
        answers.write(payload + "\n")
        answers.flush()
