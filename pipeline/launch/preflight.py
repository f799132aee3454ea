"""The checks of `arl check`, which `arl launch` also runs before it writes or submits anything.

A mistake found here costs a second; found by a job it costs a place in the GPU queue, then a
traceback in a log. Each check reads what a stage would read at start-up, without loading weights:
the model's config and tokenizer, the chat template (rendered, and tokenized turn by turn the way the
proxy does), the agent (imported and constructed), the dataset (opened, rows checked for the fields
the agent declares), the inference engine where it must start on this machine, the Slurm resources
(`sinfo`, `sacctmgr`) where jobs will be queued, and the file root. A failure is a `Problem`: the
config key, its value, what is wrong and the fix, printed as one line. `pipeline.launch.check` runs them all;
the Slurm ones live in `pipeline.launch.slurm_fit`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import ArlError
from schemas.config import ArlConfig, DatasetConfig

ROWS_CHECKED = 1000
"""Dataset rows checked for the agent's fields (all of a smaller dataset)."""


@dataclass(frozen=True)
class Problem:
    key: str
    value: Any
    message: str

    def __str__(self) -> str:
        return f"{self.key}={self.value!r}: {self.message}"


@dataclass
class Outcome:
    """One check: its name, what it found (or why it was skipped), its problems, and how long it took."""

    name: str
    detail: str = ""
    problems: list[Problem] = field(default_factory=list)
    seconds: float = 0.0
    skipped: bool = False


class PreflightError(ArlError):
    """Problems found before launch: one line each (the CLI prefixes the first with `error: `)."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\nerror: ".join(str(p) for p in problems))


def check_model(config: ArlConfig, loaded: dict[str, Any] | None = None) -> Outcome:
    model = config.model
    path = Path(model.path)
    if not (path / "config.json").is_file():
        why = "no such directory" if not path.exists() else "no config.json in it (not a Hugging Face model dir)"
        return _fail(
            "model.path",
            model.path,
            f"{why} (relative paths start at {Path.cwd()}); point it at a "
            "Hugging Face model directory on a shared file system",
        )
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # transformers raises many kinds for a broken config.json
        return Outcome("", problems=[Problem("model.path", model.path, f"config.json does not load: {_first(exc)}")])
    tokenizer_path = model.tokenizer or model.path
    try:
        tokenizer = _tokenizer(tokenizer_path, loaded)
    except Exception as exc:
        key = "model.tokenizer" if model.tokenizer else "model.path"
        return Outcome(
            "",
            problems=[
                Problem(
                    key,
                    tokenizer_path,
                    f"the tokenizer does not load: {_first(exc)}; "
                    "set model.tokenizer to a directory with tokenizer files",
                )
            ],
        )
    positions = _max_positions(hf_config)
    if positions is not None and model.max_context > positions:
        return _fail(
            "model.max_context",
            model.max_context,
            f"the checkpoint has {positions} positions (max_position_embeddings in {path / 'config.json'}): "
            f"no prompt + completion can be longer; set model.max_context to {positions} or less",
        )
    return Outcome("", detail=f"{type(hf_config).__name__.removesuffix('Config')}, vocabulary {len(tokenizer)}")


def _max_positions(hf_config: Any) -> int | None:
    """The checkpoint's position limit (a multimodal config keeps it in its text config); None if it names none."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    positions = getattr(text, "max_position_embeddings", None)
    return positions if isinstance(positions, int) and positions > 0 else None


def check_template(config: ArlConfig, loaded: dict[str, Any] | None = None) -> Outcome:
    """The proxy's own tokenizer, built as the proxy builds it, extends a first turn's tokens by the reply and a
    second user message (never re-tokenizing history); the tokens must decode to exactly the template's render.
    A template that re-renders the first turn (Qwen3's) is served, not refused: the detail says how."""
    model = config.model
    if not (Path(model.path) / "config.json").is_file():
        return Outcome("", detail="not checked: the model did not load", skipped=True)
    from pipeline.proxy.tokenize import ChatTokenizer

    key, value = ("model.chat_template", model.chat_template) if model.chat_template else ("model.path", model.path)
    try:
        path = model.tokenizer or model.path
        chat = ChatTokenizer(path, model.chat_template, model_dir=model.path, loaded=_tokenizer(path, loaded))
        first = [{"role": "user", "content": "What is 2 + 2?"}]
        messages = [*first, {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"}]
        output = _sampled(chat, "4")
        extension = chat.extend(messages, None, 2, output, parent_text=chat.render(first, None, True))
        whole = chat.render(messages, None, True)
    except Exception as exc:  # a template error is the finding, whatever its type
        return Outcome("", problems=[Problem(key, value, f"the chat template does not render: {_first(exc)}")])
    if extension is None:  # served honestly (proxy.history), not refused: Qwen3's own template does this
        return Outcome(
            "",
            detail="the template re-renders an earlier turn once the conversation goes on (e.g. drops past "
            "reasoning): under proxy.history: template such a call starts a new row (a counted prefix break); "
            "proxy.history: sampled keeps one row",
        )
    tokens = chat.prompt_ids(first, None) + output + extension.suffix_ids
    if chat.hf.decode(tokens, skip_special_tokens=False) != whole:
        return _fail(
            key,
            value,
            "tokens built turn by turn do not decode to the template's render of the "
            "conversation: capture would not be token-exact",
        )
    fast = "turn-local" if chat.turn_local else "full renders"
    return Outcome("", detail=f"token-exact over two turns ({fast}, {len(tokens)} tokens)")


def _tokenizer(path: str, loaded: dict[str, Any] | None) -> Any:
    """The tokenizer at `path`; `loaded` (one `run_checks` call's) keeps it for the next check that needs it."""
    if loaded is not None and path in loaded:
        return loaded[path]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if loaded is not None:
        loaded[path] = tokenizer
    return tokenizer


def _sampled(chat: Any, text: str) -> list[int]:
    """The tokens a model emits for `text` and then its turn close, up to the stop token it would sample."""
    ids = chat.encode(text + chat.close_text)
    for i, token in enumerate(ids):
        if token in chat.stop_token_ids:
            return list(ids[: i + 1])
    return list(chat.encode(text))


def check_agent_and_data(config: ArlConfig) -> Outcome:
    rollout = config.rollout
    if rollout.source == "external":
        return Outcome("", detail="external agents: nothing to load here", skipped=True)
    problems: list[Problem] = []
    details = []
    for i, task in enumerate(rollout.task_list()):
        where = f"rollout.tasks[{i}]." if rollout.tasks else "rollout."
        agent = _load_agent(task.agent, task.agent_kwargs, config, where + "agent", problems)
        rows = _load_rows(task.dataset, agent, where + "dataset.path", problems)
        if rows is None:
            continue
        fields = tuple(getattr(agent.obj, "required_fields", ()) if agent is not None else ())
        kind = f"{agent.kind} agent {type(agent.obj).__name__}" if agent is not None else "agent not loaded"
        detail = f"{kind}; {len(rows)} rows" + (f" with {', '.join(fields)}" if fields else "")
        details.append(f"{task.name}: {detail}" if rollout.tasks else detail)
    return Outcome("", detail="; ".join(details), problems=problems)


def check_eval_sets(config: ArlConfig) -> Outcome:
    """Every eval set's agent loads and its rows carry what that agent requires (an in-run evaluation fails
    mid-run otherwise, and `arl eval` after the run)."""
    if not config.eval.sets:
        return Outcome("", detail="no eval sets", skipped=True)
    from pipeline.eval.runner import set_agent_kwargs

    problems: list[Problem] = []
    sizes = []
    for i, spec in enumerate(config.eval.sets):
        name = spec.agent or config.rollout.agent
        # the training agent's own problems are the rollout check's to report, once
        found = problems if spec.agent is not None else []
        agent = _load_agent(name, set_agent_kwargs(spec, config), config, f"eval.sets[{i}].agent", found)
        rows = _load_rows(DatasetConfig(path=spec.path, split=spec.split), agent, f"eval.sets[{i}].path", problems)
        sizes.append(f"{spec.name} {len(rows) if rows is not None else '?'} rows")
    return Outcome("", detail="; ".join(sizes), problems=problems)


def _load_agent(name: str, kwargs: dict[str, Any], config: ArlConfig, key: str, problems: list[Problem]) -> Any:
    from pipeline.agents.loading import resolve_agent

    try:
        return resolve_agent(name, kwargs, mode=config.rollout.mode)
    except Exception as exc:  # an import error, a bad shape, a constructor that raises: all the user's to fix
        problems.append(Problem(key, name, _with_cwd(_first(exc))))
        return None


def _load_rows(dataset: DatasetConfig, agent: Any, key: str, problems: list[Problem]) -> Any:
    """The dataset's rows (None when it does not load); a problem for the first row lacking an agent's field."""
    from pipeline.agents.dataset import load_rows

    try:
        rows = load_rows(dataset)
    except Exception as exc:
        problems.append(Problem(key, dataset.path, _first(exc)))
        return None
    fields = tuple(getattr(agent.obj, "required_fields", ()) if agent is not None else ())
    for index in range(min(len(rows), ROWS_CHECKED)):
        missing = [name for name in fields if name not in rows[index]]
        if missing:
            lacks = f"row {index} lacks {', '.join(missing)}, which the agent requires (its required_fields)"
            problems.append(Problem(key, dataset.path, lacks))
            break
    return rows


def check_engine(config: ArlConfig, executor: str) -> Outcome:
    """With the local executor the servers start here: SGLang or vLLM must be importable by their interpreter."""
    backend = config.inference.backend
    if backend == "hf" or executor != "local":
        return Outcome(
            "",
            detail=f"{backend}" + ("" if backend == "hf" else " (started on the inference nodes)"),
            skipped=backend != "hf",
        )
    python = config.inference.python or sys.executable
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({backend!r}) is None)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Outcome("", problems=[Problem("inference.python", python, f"does not run: {exc}")])
    if not found:
        return Outcome(
            "",
            problems=[
                Problem(
                    "inference.backend",
                    backend,
                    f"{python} cannot import {backend}: "
                    f"install it (pip install -e '.[{backend}]') or set inference.python "
                    "to an interpreter that has it",
                )
            ],
        )
    return Outcome("", detail=f"{backend} importable by {python}")


def check_fileroot(config: ArlConfig) -> Outcome:
    """The run dir can be created: fileroot is (or will be) a writable directory. Nothing is created here."""
    root = Path(config.fileroot).absolute()
    if root.exists() and not root.is_dir():
        return Outcome("", problems=[Problem("fileroot", config.fileroot, "exists and is not a directory")])
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        return _fail(
            "fileroot",
            config.fileroot,
            f"{existing} is not writable by {_user()}; choose a fileroot on a shared file system you can write",
        )
    return Outcome("", detail=f"{root} ({'exists' if root.exists() else f'will be created under {existing}'})")


def _with_cwd(message: str) -> str:
    return message if "relative paths" in message else f"{message} (relative paths start at {Path.cwd()})"


def _fail(key: str, value: Any, message: str) -> Outcome:
    return Outcome("", problems=[Problem(key, value, message)])


def _first(exc: BaseException) -> str:
    """An exception's first line (tracebacks and long transformers messages stay out of the one-line error)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _user() -> str:
    return os.environ.get("USER") or str(os.getuid())


def slurm_commands_here() -> bool:
    return shutil.which("sbatch") is not None and shutil.which("sinfo") is not None
