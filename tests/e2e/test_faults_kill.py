"""`kill -9` of the rollout, trainer and inference stages at random points, over repeated trials.

Every trial starts the real stage (`arl stage ...` as a subprocess), kills it by pid after a seeded
random delay or the moment it starts staging output (so some kills land mid-publish), and the next
trial resumes. Meanwhile a *watcher* process reads everything published in the run dir, over and over:
every complete step (manifest present) must pass sha256 verification and schema validation, every
complete checkpoint must load, every complete trainer state must unpickle, `LATEST`,
`weight_version.json` and the rollout cursor must parse. A final uninterrupted run must then finish
with every step exactly once (and, for the trainer, weights bitwise equal to an uninterrupted run).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.run.paths import RunPaths

# Each trial set starts several stages (tens of seconds each on a busy 2-core machine).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"


# -- the watcher (runs in its own process: `python -c "... watch(...)"`) ---------------------------
def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def _checked(directory: Path, marker: Path, check: Any) -> str | None:
    """'ok', None (unpublished or replaced while being read: not a torn view), or the problem."""
    before = _inode(directory)
    if before is None or not marker.exists():
        return None
    try:
        check()
    except Exception as exc:
        if not marker.exists() or _inode(directory) != before:
            return None
        return f"{directory.name}: {type(exc).__name__}: {exc}"
    return "ok"


def _load_state_file(path: Path) -> None:
    import pickle

    import torch

    if path.suffix == ".json":
        json.loads(path.read_text())
    elif path.suffix == ".pkl":
        with open(path, "rb") as handle:
            pickle.load(handle)
    elif path.suffix == ".pt":
        torch.load(path, weights_only=False)


def _scan(paths: RunPaths, checks: Counter[str], problems: list[str], names: dict[str, set[str]]) -> None:
    from safetensors.torch import load_file

    from pipeline.run.shards import read_step
    from schemas.trajectory import validate_table

    for step in paths.complete_steps():
        result = _checked(paths.step_dir(step), paths.step_manifest(step),
                          lambda s=step: validate_table(read_step(paths, s)))  # fmt: skip
        _tally("step", result, checks, problems)
    for version in paths.complete_checkpoints():
        directory = paths.checkpoint_dir(version)

        def load_checkpoint(d: Path = directory) -> None:
            json.loads((d / "config.json").read_text())
            keys = set(load_file(str(d / "model.safetensors")))
            expected = names.setdefault("weights", keys)
            if keys != expected:
                raise ValueError(f"tensor names differ from the first checkpoint: {sorted(keys ^ expected)[:5]}")

        _tally("checkpoint", _checked(directory, paths.checkpoint_marker(version), load_checkpoint), checks, problems)
    state_root = paths.state / "trainer"
    for directory in sorted(state_root.iterdir()) if state_root.exists() else []:
        if directory.name.endswith(".tmp"):
            continue

        def load_state(d: Path = directory) -> None:
            for file in d.iterdir():
                _load_state_file(file)

        _tally("state", _checked(directory, directory / "_COMPLETE", load_state), checks, problems)
    for small in (paths.latest, paths.weight_version, paths.rollout_state):
        try:
            text = small.read_text()
        except FileNotFoundError:
            continue
        try:
            value = int(text) if small == paths.latest else json.loads(text)
            if small == paths.latest and not paths.checkpoint_dir(value).exists():
                problems.append(f"LATEST names {value}, which does not exist")
            checks["small_file"] += 1
        except ValueError as exc:
            problems.append(f"{small.name} is torn: {text!r} ({exc})")


def _tally(kind: str, result: str | None, checks: Counter[str], problems: list[str]) -> None:
    if result == "ok":
        checks[kind] += 1
    elif result is not None:
        problems.append(f"{kind} {result}")


def watch(root: str, stop_file: str, out_file: str) -> None:
    """Scan `root` until `stop_file` exists; write {"checks": {...}, "problems": [...]} to `out_file`."""
    from pipeline.run.handoff import write_json_atomic

    paths = RunPaths(Path(root))
    checks: Counter[str] = Counter()
    problems: list[str] = []
    names: dict[str, set[str]] = {}
    while not Path(stop_file).exists():
        _scan(paths, checks, problems, names)
        time.sleep(0.02)
    _scan(paths, checks, problems, names)
    write_json_atomic(out_file, {"checks": dict(checks), "problems": problems[:50]})


@contextlib.contextmanager
def watcher(paths: RunPaths, work: Path) -> Iterator[dict[str, Any]]:
    """Run the watcher beside the trials; the yielded dict is filled with its findings at exit."""
    stop, out = work / "watch.stop", work / "watch.json"
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); from e2e.test_faults_kill import watch; " \
           f"watch({str(paths.root)!r}, {str(stop)!r}, {str(out)!r})"  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    found: dict[str, Any] = {}
    try:
        yield found
    finally:
        stop.touch()
        proc.wait(timeout=120)
    assert proc.returncode == 0, "the watcher crashed"
    found.update(json.loads(out.read_text()))


# -- stages and kills ----------------------------------------------------------------------------
def start_stage(name: str, paths: RunPaths, log: Path) -> subprocess.Popen[bytes]:
    handle = open(log, "ab")  # noqa: SIM115 - kept by the child
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", "stage", name, "--run-dir", str(paths.root)],
                            cwd=REPO, stdout=handle, stderr=subprocess.STDOUT)  # fmt: skip


def staging(*parents: Path) -> bool:
    return any(p.name.endswith(".tmp") for parent in parents if parent.exists() for p in parent.iterdir())


def kill_at_random(proc: subprocess.Popen[bytes], rng: random.Random, trial: int, staged: list[Path],
                   children: bool = False, settled: Callable[[], bool] | None = None) -> str:  # fmt: skip
    """SIGKILL `proc` (and, like a Slurm job kill, its children) at a random point; say where it landed.

    Even trials: after a random delay. Odd trials: as soon as a temp dir appears under `staged`
    (the stage is publishing), after a random delay of a few milliseconds; or at once when `settled()` says no
    staging dir can appear any more.
    """
    import psutil

    delay = rng.uniform(1.0, 12.0) if trial % 2 == 0 else rng.uniform(0.0, 0.05)
    deadline = time.monotonic() + (delay if trial % 2 == 0 else 240.0)
    while time.monotonic() < deadline and proc.poll() is None:
        if trial % 2 == 1 and staging(*staged):
            time.sleep(delay)
            break
        if trial % 2 == 1 and settled is not None and settled():
            delay = -1.0
            break
        time.sleep(0.002)
    if proc.poll() is not None:
        return f"exited {proc.returncode} before the kill"
    victims = psutil.Process(proc.pid).children(recursive=True) if children else []
    os.kill(proc.pid, signal.SIGKILL)
    for child in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    proc.wait(timeout=60)
    if trial % 2 == 0:
        return f"killed after {delay:.2f}s"
    return "killed with nothing left to stage" if delay < 0 else "killed while staging"


def rollout_run(tmp_path: Path, model_dir: Path, num_steps: int, engine_url: str | None) -> RunPaths:
    from pipeline.engine.registry import write_entry
    from pipeline.run.config import dump_config, validate_config
    from schemas.engine_api import InferenceEntry

    (tmp_path / "agent.py").write_text(AGENT)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"q": f"q{i}", "i": i}) + "\n" for i in range(7)))
    config = validate_config({
        "fileroot": str(tmp_path / "runs"), "num_steps": num_steps, "model": {"path": str(model_dir)},
        "inference": {"backend": "hf", "device": "cpu", "request_timeout_s": 60},
        "rollout": {"agent": f"{tmp_path / 'agent.py'}:OneCall", "dataset": {"path": str(data), "seed": 3},
                    "batch_size": 2, "group_size": 2, "max_staleness": 1000, "run_timeout_s": 60,
                    "max_error_rate": 0.5, "export_style": "individual"},
    })  # fmt: skip
    paths = RunPaths.from_config(config.fileroot, config.experiment_name, config.trial_name)
    paths.root.mkdir(parents=True)
    paths.config.write_text(dump_config(config))
    if engine_url is not None:
        write_entry(paths, "hf-0", InferenceEntry(url=engine_url, backend="hf", model_path=str(model_dir),
                                                   weight_version=0, host=socket.gethostname(), pid=os.getpid(),
                                                   started_at=time.time()))  # fmt: skip
    return paths


AGENT = """
from openai import AsyncOpenAI

class OneCall:
    async def run(self, data, base_url, api_key, http_client, temperature):
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0)
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": data["q"]}],
                                             max_tokens=3)
        return float(data["i"] % 2)
"""


def assert_rollout_steps_exactly_once(paths: RunPaths, num_steps: int) -> None:
    from pipeline.rollout.loop import build_schedule
    from pipeline.run.config import config_from_run_dir
    from pipeline.run.shards import read_step

    assert paths.complete_steps() == list(range(num_steps))
    schedule = build_schedule(config_from_run_dir(paths.root))
    seen: set[str] = set()
    for step in range(num_steps):
        rows = read_step(paths, step).to_pylist()
        ids = {r["sample_id"] for r in rows}
        assert len(ids) == len(rows) and not ids & seen, f"step {step} has duplicated samples"
        seen |= ids
        positions = Counter(json.loads(r["metadata"])["position"] for r in
                            {r["session_id"]: r for r in rows}.values())  # fmt: skip
        assert positions == dict.fromkeys((p.position for p in schedule.prompts(step)), 2), f"step {step}: {positions}"
    steps = [json.loads(line)["step"] for line in paths.rollout_metrics.read_text().splitlines()]
    assert max(Counter(steps).values()) == 1, f"a step was produced twice: {steps}"
    leftovers = [p.name for p in paths.trajectories.iterdir() if not (p / "_MANIFEST.json").exists()]
    assert leftovers == [], f"unpublished leftovers after the final run: {leftovers}"


def run_to_completion(name: str, paths: RunPaths, log: Path, timeout: float = 400) -> None:
    proc = start_stage(name, paths, log)
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text(errors="replace")[-4000:]


# -- the trials ----------------------------------------------------------------------------------
def test_rollout_killed_at_random_points(tmp_path: Path, tiny_model_dir: Path) -> None:
    from pipeline.engine.server.hf.process import start_hf_server

    rng = random.Random(20261122)
    with start_hf_server(tiny_model_dir) as engine:
        paths = rollout_run(tmp_path, tiny_model_dir, 6, engine.url)
        outcomes = []
        with watcher(paths, tmp_path) as found:
            for trial in range(4):
                proc = start_stage("rollout", paths, tmp_path / "rollout.log")
                outcomes.append(kill_at_random(proc, rng, trial, [paths.trajectories]))
            run_to_completion("rollout", paths, tmp_path / "rollout.log")
    print("rollout trials:", outcomes, found)
    assert found["problems"] == [], found
    assert found["checks"].get("step", 0) > 0
    assert_rollout_steps_exactly_once(paths, 6)


TRAIN_OVERRIDES = ["num_steps=4", "trainer.deterministic=true", "trainer.keep_checkpoints=10",
                   "trainer.minibatches=2", "rollout.max_staleness=10", "trainer.wait_timeout_s=30"]  # fmt: skip


def test_trainer_killed_at_random_points(make_train_run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import shutil

    import torch
    from safetensors.torch import load_file

    from pipeline.run.sinks import read_jsonl

    reference = make_train_run(steps=[0, 1, 2, 3], overrides=TRAIN_OVERRIDES, name="reference")
    run_to_completion("train", reference, tmp_path / "reference.log")
    paths = make_train_run(steps=[], overrides=TRAIN_OVERRIDES, name="killed")
    shutil.copytree(reference.trajectories, paths.trajectories)
    rng = random.Random(7)
    outcomes = []
    with watcher(paths, tmp_path) as found:
        for trial in range(4):
            proc = start_stage("train", paths, tmp_path / "train.log")
            outcomes.append(kill_at_random(proc, rng, trial, [paths.checkpoints, paths.state / "trainer"]))
        run_to_completion("train", paths, tmp_path / "train.log")
    print("trainer trials:", outcomes, found)
    assert found["problems"] == [], found
    assert found["checks"].get("checkpoint", 0) > 0 and found["checks"].get("state", 0) > 0
    final, expected = (load_file(str(p.checkpoint_dir(4) / "model.safetensors")) for p in (paths, reference))
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in final), "resumed weights differ from an uninterrupted run"
    steps = [r["step"] for r in read_jsonl(paths.train_metrics)]
    assert sorted(set(steps)) == [0, 1, 2, 3]
    assert max(Counter(steps).values()) == 1, f"a step was trained (and logged) twice: {steps}"


def drop_dead_entries(paths: RunPaths) -> None:
    """What an operator does today after a SIGKILLed inference job: delete its registry entries. A
    killed stage cannot deregister, and a restarted one does not clean up after its predecessor
    (xfail `test_a_stale_registry_entry_does_not_stop_the_rollout` in test_faults_failover.py)."""
    import httpx

    for entry in paths.inference_registry.glob("*.json"):
        url = json.loads(entry.read_text())["url"]
        try:
            httpx.get(f"{url}/health", timeout=2)
        except httpx.HTTPError:
            entry.unlink(missing_ok=True)


def test_inference_stage_killed_at_random_points(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The inference job dies (with its servers, as a Slurm job kill does) and is restarted; the
    rollout rides through it or fails and is rerun; every step ends up published exactly once."""
    rng = random.Random(99)
    paths = rollout_run(tmp_path, tiny_model_dir, 5, None)
    inf_log, ro_log = tmp_path / "inference.log", tmp_path / "rollout.log"
    outcomes, rollout = [], None
    try:
        with watcher(paths, tmp_path) as found:
            for trial in range(3):
                inference = start_stage("inference", paths, inf_log)
                if rollout is None or rollout.poll() is not None:
                    rollout = start_stage("rollout", paths, ro_log)
                # even trials: a random delay; odd: when the rollout starts publishing a step
                # Nothing will stage once the rollout has exited (it fails when the servers die under it) or has
                # published every step (the tiny agent is fast): waiting for it then only ran out the 240 s.
                settled = lambda proc=rollout: proc.poll() is not None or len(paths.complete_steps()) >= 5  # noqa: E731
                outcomes.append(kill_at_random(inference, rng, trial, [paths.trajectories], children=True,
                                               settled=settled))  # fmt: skip
                drop_dead_entries(paths)
            inference = start_stage("inference", paths, inf_log)
            try:
                deadline = time.monotonic() + 400
                while len(paths.complete_steps()) < 5:
                    assert time.monotonic() < deadline, ro_log.read_text(errors="replace")[-4000:]
                    if rollout is None or rollout.poll() is not None:
                        rollout = start_stage("rollout", paths, ro_log)
                    time.sleep(0.5)
                assert rollout is not None
                rollout.wait(timeout=120)
            finally:
                inference.send_signal(signal.SIGTERM)
                inference.wait(timeout=60)
    finally:
        if rollout is not None and rollout.poll() is None:
            rollout.kill()
            rollout.wait()
    print("inference trials:", outcomes, found)
    assert found["problems"] == [], found
    assert_rollout_steps_exactly_once(paths, 5)


def test_inference_servers_die_with_a_killed_supervisor(tmp_path: Path, tiny_model_dir: Path) -> None:
    import psutil

    paths = rollout_run(tmp_path, tiny_model_dir, 1, None)
    supervisor = start_stage("inference", paths, tmp_path / "inference.log")
    servers: list[Any] = []
    try:
        deadline = time.monotonic() + 300
        while not list(paths.inference_registry.glob("*.json")):
            assert supervisor.poll() is None and time.monotonic() < deadline, "the inference stage never registered"
            time.sleep(0.2)
        servers = psutil.Process(supervisor.pid).children(recursive=True)
        assert servers
        os.kill(supervisor.pid, signal.SIGKILL)  # only the supervisor, by pid
        supervisor.wait(timeout=60)
        _, alive = psutil.wait_procs(servers, timeout=30)
        running = [p.pid for p in alive if _running(p)]  # a zombie waits for a reaper: it is dead
        assert running == [], f"inference servers {running} outlived their killed supervisor"
    finally:
        for server in servers:
            with contextlib.suppress(psutil.NoSuchProcess):
                server.kill()
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()


def _running(process: Any) -> bool:
    import psutil

    try:
        return bool(process.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
