"""`arl doctor`: a tiny real run, then a pass/fail table of what it must have produced.

It runs the demo's pipeline (examples/demo.yaml: inference server, rollout with the demo agent,
torch trainer, weight publication) for a few steps in a fresh run dir, with the launcher's own
local executor (`plan_run`, `start_stage`, `supervise`, `stop_stages`). The one difference from
`arl launch --executor local`: when the trainer has finished, the inference server is still up,
so the checks can ask it which version and which weights it serves before every stage is stopped.

`--gpu` is the acceptance run of a GPU node (docs/gpu-acceptance.md): an SGLang (or vLLM) server,
bf16, NCCL broadcast publication, a small model already on the node. Without it, the same checks
run on CPU with the hf engine and the tiny model, which is how the tests cover this harness.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

from rich.table import Table

from pipeline.demo.demo_run import DEMO_CONFIG, demo_file_overrides, ensure_tiny_model
from pipeline.demo.doctor_checks import (
    Check,
    check_checkpoints,
    check_publication,
    check_served_version,
    check_served_weights,
    check_shards,
    check_stages,
)
from pipeline.engine.registry import read_entries
from pipeline.errors import ArlError
from pipeline.run.console import people_console
from pipeline.run.paths import RunPaths
from schemas.config import ArlConfig

console = people_console()
BACKENDS = ("sglang", "vllm", "hf")


@dataclass
class DoctorOptions:
    gpu: bool = False
    backend: str | None = None
    """None = sglang with --gpu, hf without."""
    model: str | None = None
    steps: int = 3
    workdir: Path | None = None
    """None = a fresh temp dir."""
    overrides: list[str] = field(default_factory=list)

    @property
    def chosen_backend(self) -> str:
        return self.backend or ("sglang" if self.gpu else "hf")

    @property
    def weight_sync(self) -> str:
        return _override(self.overrides, "trainer.weight_sync") or "nccl"


def run_doctor(opts: DoctorOptions) -> int:
    """0 = every check passed, 1 = one failed; usage errors raise `ArlError` before anything starts."""
    preflight(opts)
    workdir = (opts.workdir or Path(_tempdir())).resolve()
    model = resolve_model(opts, workdir)
    trial = datetime.now().strftime("doctor-%Y%m%d-%H%M%S")
    from pipeline.launch.rundir import prepare_run_dir

    config, paths = prepare_run_dir(
        DEMO_CONFIG, doctor_overrides(opts, model, workdir, trial), resume=False, clean=False
    )
    where = "GPU" if opts.gpu else "CPU"
    console.print(
        f"[bold]arl doctor[/] ({where}, {opts.chosen_backend}, {config.model.dtype}): {opts.steps} steps "
        f"of {model}\nrun dir [cyan]{paths.root}[/]"
    )
    checks = run_and_check(config, paths, model, gpu=opts.gpu)
    print_table(checks)
    failed = [c.name for c in checks if not c.ok]
    summary = f"[red]FAILED: {', '.join(failed)}[/] (logs: {paths.logs})" if failed else "[green]all checks passed[/]"
    console.print(summary)
    return 1 if failed else 0


def preflight(opts: DoctorOptions) -> None:
    """Every usage error, as one line, before a process starts."""
    if opts.steps < 1:
        raise ArlError(f"--steps must be >= 1, got {opts.steps}")
    backend = opts.chosen_backend
    if backend not in BACKENDS:
        raise ArlError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if not opts.gpu:
        if backend != "hf":
            raise ArlError(f"--backend {backend} needs a GPU: add --gpu (on a GPU node) or use --backend hf")
        return
    import torch

    if not torch.cuda.is_available():
        raise ArlError(
            "--gpu: no CUDA device is visible (torch.cuda.is_available() is False); run it on a GPU "
            "node, or drop --gpu for the CPU check"
        )
    if opts.model is None:
        raise ArlError("--gpu needs --model: a small HF model directory or hub name already on this node")
    if opts.weight_sync == "nccl" and torch.cuda.device_count() < 2:
        raise ArlError(
            f"--gpu needs 2 GPUs for NCCL publication ({torch.cuda.device_count()} visible): NCCL refuses "
            "two ranks on one device; pass trainer.weight_sync=disk to check one GPU"
        )
    if backend != "hf":
        _require_importable(backend, _override(opts.overrides, "inference.python"))


def _require_importable(module: str, python: str | None) -> None:
    if python is None:
        if importlib.util.find_spec(module) is None:
            raise ArlError(
                f"--backend {module}: `import {module}` fails in {sys.executable}; install it (pip "
                f"install -e '.[{module}]') or pass inference.python=<its venv's python>"
            )
        return
    probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        raise ArlError(f"--backend {module}: `import {module}` fails in inference.python={python}")


def resolve_model(opts: DoctorOptions, workdir: Path) -> Path:
    """A local model directory: --model as a path, or a hub name already in the local cache (no download)."""
    if opts.model is None:
        return ensure_tiny_model(workdir / "tiny-model").resolve()
    path = Path(opts.model).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ArlError(f"--model {path}: no config.json there (an HF model directory is needed)")
        return path.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(opts.model, local_files_only=True))
    except Exception:  # any failure means the same to the user: not on this node
        raise ArlError(
            f"--model {opts.model}: no such directory, and not in the local Hugging Face cache "
            "(download it first; the doctor never downloads)"
        ) from None


def doctor_overrides(opts: DoctorOptions, model: Path, workdir: Path, trial: str) -> list[str]:
    """examples/demo.yaml (its agent and data by absolute path, so any directory works), made into the doctor's
    run; the user's own overrides come last and win."""
    base = [
        *demo_file_overrides(),
        f"fileroot={workdir}",
        "experiment_name=doctor",
        f"trial_name={trial}",
        f"num_steps={opts.steps}",
        f"model.path={model}",
        f"inference.backend={opts.chosen_backend}",
        "trainer.weight_sync=nccl",
        f"trainer.keep_checkpoints={opts.steps}",
        "trainer.publish_timeout_s=300",
    ]
    if opts.gpu:
        base += [
            "model.dtype=bfloat16",
            "inference.device=cuda",
            "trainer.device=cuda",
            "trainer.bf16=true",
            "inference.mem_fraction=0.4",
            "trainer.optimizer.lr=1e-4",
        ]
    return base + list(opts.overrides)


def run_and_check(config: ArlConfig, paths: RunPaths, initial: Path, *, gpu: bool) -> list[Check]:
    """Start the stages, wait for the trainer, check the live server, stop everything, check the run dir."""
    from pipeline.launch.local import start_stage, stop_stages, supervise
    from pipeline.launch.plan import plan_run

    steps = config.num_steps
    running = []
    live: list[Check] = []
    started = time.monotonic()
    try:
        for plan in plan_run(config, paths.root):
            plan = replace(plan, argv=["env", *stage_gpus(plan.stage, config), *plan.argv]) if gpu else plan
            running.append(start_stage(plan, paths, paths.next_attempt(plan.stage), workdir=Path.cwd()))
        code = supervise(running, paths, console)
        elapsed = time.monotonic() - started
        if code == 0:
            live = live_checks(config, paths, initial, gpu=gpu)
    finally:
        stop_stages(running, paths)
    checks = [check_stages(code, elapsed), check_shards(paths, steps), check_checkpoints(paths, steps)]
    want_nccl = gpu and config.trainer.weight_sync == "nccl"
    return checks + live + [check_publication(paths, config.trainer.weight_sync, want_nccl=want_nccl)]


def stage_gpus(stage: str, config: ArlConfig) -> list[str]:
    """`CUDA_VISIBLE_DEVICES` of each stage: the server on GPU 0, the trainer on GPU 1 when they share an NCCL
    group (NCCL refuses two ranks on one device), else on GPU 0 too; the rollout on none."""
    nccl = config.trainer.weight_sync == "nccl"
    return [f"CUDA_VISIBLE_DEVICES={ {'inference': '0', 'train': '1' if nccl else '0'}.get(stage, '') }"]


def live_checks(config: ArlConfig, paths: RunPaths, initial: Path, *, gpu: bool) -> list[Check]:
    """The checks that need the inference server still running (after the trainer's last publication)."""
    urls = [entry.url for entry in read_entries(paths).values()]
    if not urls:
        return [Check("served version", False, f"no server registered under {paths.inference_registry}")]
    url, steps = urls[0], config.num_steps
    checks = [check_served_version(url, paths, steps)]
    checks += check_served_weights(
        url,
        paths.weights_dir(steps),
        initial,
        temperature=config.rollout.temperature,
        dtype=config.model.dtype,
        device="cuda" if gpu else "cpu",
    )
    return checks


def print_table(checks: list[Check]) -> None:
    table = Table(title="arl doctor", expand=False)
    for column, justify in (("check", "left"), ("result", "center"), ("time", "right"), ("detail", "left")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for check in checks:
        result = "[green]PASS[/]" if check.ok else "[red]FAIL[/]"
        table.add_row(check.name, result, f"{check.seconds:.1f}s", check.detail)
    console.print(table)


def _override(overrides: list[str], key: str) -> str | None:
    values = [item.split("=", 1)[1] for item in overrides if item.startswith(f"{key}=")]
    return values[-1] if values else None


def _tempdir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="arl-doctor-")
