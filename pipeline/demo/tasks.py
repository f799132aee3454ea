"""The demo's tasks: what `arl demo` (the copy task) and `arl demo --task tools` (a tool agent) run and make.

A task is a config, an agent, its data, and the recipe of its tiny model: layers plus a warm start that teaches
the task's format and nothing of its answers (pipeline/demo/warm_start.py). Everything lives in `examples/`,
shipped in the wheel as package data, and is passed to the launcher as absolute paths, so the demo works from any
directory after a plain `pip install`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline.errors import ArlError
from pipeline.run.console import people_console

EXAMPLES = (Path(__file__).parents[1] / "examples").resolve()
"""The demo's files: the repository's `examples/` in a checkout, package data in an installed wheel."""
console = people_console()


@dataclass(frozen=True)
class Series:
    """A per-step figure of `metrics/rollout.jsonl` the demo draws besides the reward and the exact-correct rate."""

    key: str
    label: str
    unit: bool
    """Whether it is a rate in [0, 1] (drawn on the reward's axis) or a count (drawn on its own)."""


@dataclass(frozen=True)
class DemoTask:
    name: str
    config: Path
    agent: Path
    agent_class: str
    warm_corpus: Path
    layers: int
    warm_steps: int
    warm_lr: float
    recipe: str
    """Bumped when the model's recipe changes, so an old model under --out is not reused."""
    goal: str
    """What RL teaches, for the demo's first line."""
    warm_note: str
    """What the warm start taught (and did not), for the line after the model is made."""
    series: tuple[Series, ...] = ()

    @property
    def model_name(self) -> str:
        """The task's model directory under --out."""
        return f"tiny-{self.name}-L{self.layers}-warm{self.warm_steps}-{self.recipe}"

    def files(self) -> tuple[Path, ...]:
        return (self.config, self.agent, self.warm_corpus)

    def num_steps(self) -> int:
        return int(yaml.safe_load(self.config.read_text())["num_steps"])


REPEAT = DemoTask(
    name="repeat",
    config=EXAMPLES / "demo.yaml",
    agent=EXAMPLES / "demo_agent.py",
    agent_class="DemoAgent",
    warm_corpus=EXAMPLES / "data" / "demo_format.jsonl",
    # One layer: it learns to copy by RL within the demo's steps (2-layer models did not, within 100 steps).
    layers=1,
    warm_steps=120,
    warm_lr=1e-3,
    recipe="v2",  # v2: the corpus's short system message
    goal="RL teaches a tiny model to repeat the number it is asked to",
    warm_note="the answer format only (its prompts name no number; its replies are random two-digit numbers)."
    " Copying the number is left to RL.",
)
TOOLS = DemoTask(
    name="tools",
    config=EXAMPLES / "tools.yaml",
    agent=EXAMPLES / "tools_agent.py",
    agent_class="ToolsAgent",
    warm_corpus=EXAMPLES / "data" / "tools_format.jsonl",
    layers=1,
    # 1200 steps at 2e-3: at 120 (the copy task's) the model wrote a well-formed call 60% of the time and never
    # repeated the tool's result; repeating it is learned late (3 of 30 answers after 500 steps).
    warm_steps=1200,
    warm_lr=2e-3,
    recipe="v1",
    goal="RL teaches an OpenAI Agents SDK agent's tiny model to call its calculator with the question's numbers",
    warm_note="the tool protocol only (calls with numbers of its own, then the tool's result as the answer: "
    "every answer wrong for its question). Reading the question into the call is left to RL.",
    series=(Series("agent/used_tool", "tool-use rate", True), Series("turns_mean", "model calls per episode", False)),
)
TASKS = {task.name: task for task in (REPEAT, TOOLS)}


def task_named(name: str) -> DemoTask:
    if name not in TASKS:
        raise ArlError(f"--task must be one of {', '.join(TASKS)}; got {name!r}")
    return TASKS[name]


def demo_file_overrides(task: DemoTask = REPEAT) -> list[str]:
    """The task config's agent and dataset (and eval sets) as absolute paths, so its run works from any directory."""
    for path in task.files():
        if not path.exists():
            raise ArlError(
                f"the demo's file {path} is missing from the installed arl package; reinstall arl "
                "(`pip install --force-reinstall arl`, or `pip install -e .` in a checkout)"
            )
    config = yaml.safe_load(task.config.read_text())
    data = EXAMPLES / Path(config["rollout"]["dataset"]["path"]).relative_to("examples")
    overrides = [
        f"rollout.agent={yaml_str(f'{task.agent}:{task.agent_class}')}",
        f"rollout.dataset.path={yaml_str(str(data))}",
    ]
    sets = (config.get("eval") or {}).get("sets") or []
    for spec in sets:  # their data files too (`examples/...` in the config, beside the package's examples)
        path = Path(spec["path"])
        spec["path"] = str(path if path.is_absolute() else EXAMPLES / path.relative_to("examples"))
    if sets:
        overrides.append(f"eval.sets={json.dumps(sets)}")
    return overrides


def yaml_str(value: str) -> str:
    """`value` as an override's right-hand side (parsed as YAML): quoted only where YAML would change it."""
    try:
        if yaml.safe_load(value) == value:
            return value
    except yaml.YAMLError:
        pass
    return json.dumps(value)


def ensure_tiny_model(model_dir: Path, task: DemoTask = REPEAT) -> Path:
    """Make the task's tiny model and its format-only warm start the first time; reuse it afterwards (both are
    seeded, so it is always the same). A directory left without the warm start's record (an interrupted build) is
    rebuilt."""
    from pipeline.demo.warm_start import read_record

    if (model_dir / "config.json").exists() and read_record(model_dir) is not None:
        console.print(_warm_start_line(model_dir, task, "reusing"), markup=False, highlight=False)
        return model_dir
    from pipeline.demo.tiny_model import make_tiny_model
    from pipeline.demo.warm_start import warm_start

    console.print(
        f"making the tiny model ({task.layers} layer, {task.warm_steps} warm-start steps) in {model_dir} ...",
        markup=False,
        highlight=False,
    )
    make_tiny_model(model_dir, num_layers=task.layers, overwrite=True)
    warm_start(model_dir, task.warm_corpus, steps=task.warm_steps, lr=task.warm_lr)
    console.print(_warm_start_line(model_dir, task, "made"), markup=False, highlight=False)
    return model_dir


def _warm_start_line(model_dir: Path, task: DemoTask, verb: str) -> str:
    from pipeline.demo.warm_start import read_record

    record = read_record(model_dir)
    assert record is not None
    return (
        f"warm start ({verb}): {record.steps} supervised steps on {Path(record.corpus).name}, {task.warm_note} "
        f"Loss {record.first_loss:.2f} -> {record.last_loss:.2f}."
    )
