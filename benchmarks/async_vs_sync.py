"""Wall time of the demo with asynchronous (`max_staleness: 1`) vs synchronous (`0`) RL.

Runs `arl demo --steps N` twice in the same session on the same machine; with staleness 1 the
rollout of step k+1 overlaps the training of step k, so it should take less wall time.
Usage: python benchmarks/async_vs_sync.py [--steps N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(steps: int, staleness: int, workdir: Path) -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "pipeline.cli", "demo", "--steps", str(steps), "--workdir", str(workdir),
                    "--max-staleness", str(staleness)], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        sync_s = run(args.steps, 0, workdir)
        async_s = run(args.steps, 1, workdir)
    print(f"{args.steps} demo steps: synchronous {sync_s:.1f}s, asynchronous (staleness 1) {async_s:.1f}s, "
          f"speed-up {sync_s / async_s:.2f}x")  # fmt: skip
    result = {
        "name": "async_vs_sync",
        "reference": "the same demo run synchronously (max_staleness 0)",
        "figures": {"steps": args.steps, "sync wall s": round(sync_s, 1), "async wall s": round(async_s, 1)},
        "ratios": {"sync / async wall time": round(sync_s / async_s, 3)},
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
