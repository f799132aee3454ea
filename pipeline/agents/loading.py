"""Agents: how the config names one, what it must look like, and what its return value means.

Two interfaces are accepted (docs/rollout.md, "Agents"):

* **run agents**: `run(self, data: dict, **kwargs)`, usually `async def`. The kwargs offered are
  `base_url` (`<proxy>/v1`, for the OpenAI SDK), `anthropic_base_url` (`<proxy>`, for the Anthropic
  SDK), `api_key` (the session key), `http_client` (an `httpx.AsyncClient` the agent may pass to
  `AsyncOpenAI(http_client=...)`; `None` for a sync agent in a subprocess) and `temperature`
  (`rollout.temperature`). An agent whose `run` has no `**kwargs` gets only the names it declares.
* **workflows** (AReaL's `RolloutWorkflow` shape): `async def arun_episode(self, engine, data)`,
  where `engine` is a `SessionEngine` bound to one proxy session (see its docstring).

Return value of either: a number = the reward of the session's last completion; a dict
`{interaction_id: reward}` = rewards by completion id (`{}` = "I set the rewards myself through
`/rl/set_reward`"); `None` = reject the run (it yields no samples). Anything else is an error.

The config names an agent as `package.module:attr` or `path/to/file.py:attr`; `attr` may be a
class (constructed with `rollout.agent_kwargs`), an instance, or a zero-argument factory function.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pipeline.agents.outcome import AgentError

OFFERED_KWARGS = ("base_url", "anthropic_base_url", "api_key", "http_client", "temperature")


@dataclass(frozen=True)
class Agent:
    """A resolved agent: the user's object plus what we learned about how to call it."""

    obj: Any
    spec: str
    kind: Literal["run", "workflow"]
    is_async: bool
    accepts: frozenset[str] | None
    """Kwarg names `run` declares; None when it takes `**kwargs` (then every offered kwarg is passed)."""

    def run_kwargs(self, offered: dict[str, Any]) -> dict[str, Any]:
        if self.accepts is None:
            return dict(offered)
        return {k: v for k, v in offered.items() if k in self.accepts}


def load_object(spec: str) -> Any:
    """Import what `module:attr` or `path/to/file.py:attr` names (attr may be dotted)."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise AgentError(f"agent {spec!r} must look like `package.module:Name` or `path/to/file.py:Name`")
    module = _load_file_module(Path(target)) if _is_path(target) else _import_module(target, spec)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(module) if not n.startswith("_"))
            raise AgentError(f"agent {spec!r}: {target} has no attribute {attr!r}; it defines: {', '.join(names)}")
        obj = getattr(obj, part)
    return obj


def file_module_name(path: Path) -> str:
    """A stable module name for a file, the same in every process, so its classes pickle by reference."""
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    return f"arl_agent_{path.stem}_{digest}"


def _is_path(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _import_module(name: str, spec: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise AgentError(f"agent {spec!r}: cannot import module {name!r}: {exc}") from exc


def _load_file_module(path: Path) -> Any:
    if not path.is_file():
        raise AgentError(f"agent file {path} does not exist (relative paths are resolved from {Path.cwd()})")
    name = file_module_name(path)
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path.resolve())
    if module_spec is None or module_spec.loader is None:
        raise AgentError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before exec: dataclasses and pickle look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def resolve_agent(spec: str, kwargs: dict[str, Any] | None = None, *, mode: str = "inline") -> Agent:
    """Load the agent the config names, construct it if needed, and check it follows the contract."""
    obj = load_object(spec)
    if inspect.isclass(obj):
        try:
            obj = obj(**(kwargs or {}))
        except TypeError as exc:
            raise AgentError(
                f"agent {spec!r}: constructing it with rollout.agent_kwargs={kwargs!r} failed: {exc}"
            ) from exc
    elif kwargs:
        raise AgentError(f"agent {spec!r} is an instance, not a class: rollout.agent_kwargs={kwargs!r} cannot apply")
    elif inspect.isfunction(obj) and not _has_agent_method(obj):
        obj = obj()  # a factory
    return inspect_agent(obj, spec, mode=mode)


def _has_agent_method(obj: Any) -> bool:
    return callable(getattr(obj, "run", None)) or callable(getattr(obj, "arun_episode", None))


def inspect_agent(obj: Any, spec: str, *, mode: str = "inline") -> Agent:
    """Check `obj` against the contract; the error says what is missing and how to fix it."""
    episode = getattr(obj, "arun_episode", None)
    if callable(episode):
        if not inspect.iscoroutinefunction(episode):
            raise AgentError(f"agent {spec!r}: arun_episode must be `async def arun_episode(self, engine, data)`")
        return Agent(obj=obj, spec=spec, kind="workflow", is_async=True, accepts=None)
    run = getattr(obj, "run", None)
    if run is None:
        raise AgentError(
            f"agent {spec!r} ({type(obj).__name__}) has neither `async def run(self, data, **kwargs)` nor "
            "`async def arun_episode(self, engine, data)`"
        )
    if not callable(run):
        raise AgentError(f"agent {spec!r}: its `run` attribute is a {type(run).__name__}, not a method")
    is_async = inspect.iscoroutinefunction(run)
    if not is_async and mode == "inline":
        raise AgentError(
            f"agent {spec!r} has a synchronous run(); inline mode runs agents as coroutines in the rollout's event "
            "loop, where a blocking call would stall every other run and the proxy: make it `async def run`, "
            "or set rollout.mode=subproc (sync agents are allowed there)"
        )
    return Agent(obj=obj, spec=spec, kind="run", is_async=is_async, accepts=_accepted_kwargs(run, spec))


def _accepted_kwargs(run: Any, spec: str) -> frozenset[str] | None:
    try:
        params = list(inspect.signature(run).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional and not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        raise AgentError(f"agent {spec!r}: run{inspect.signature(run)} takes no `data` argument")
    return frozenset(p.name for p in params[1:] if p.kind is not inspect.Parameter.POSITIONAL_ONLY)
