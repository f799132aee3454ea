"""A session's conversation tree: interactions, reward propagation, export to shard rows.

Every LLM call the proxy serves is an `Interaction`: the exact prompt tokens the engine saw, the
tokens it sampled with their log-probabilities and weight versions, and a link to the earlier
interaction it extends (`parent_id`). One agent run (a session) is a tree of them: a chain for a
plain multi-turn chat, a branch where the agent forks its history (sub-agents, retries).

Rewards arrive on some nodes (usually the last call). `propagate_rewards` spreads them towards
the roots, leaves first: node = own reward (0 if unset) + discount × mean of its children's
propagated rewards. It walks nodes in reverse insertion order, which is a valid leaves-first
order because a parent is always added before its children (checked in `add`); no recursion,
so a 100,000-turn chain is as safe as a 3-turn one.

Export (`schemas.trajectory.TrajectoryRow`, the shard rows of docs/trajectory-schema.md):

* `individual`: one row per interaction: `prompt_ids + output_ids`, loss mask over the output.
* `concat`: one row per root-to-leaf path, loss mask over every sampled segment. Token-exact
  multi-turn means a child's prompt starts with its parent's prompt + output, so the path's last
  prompt + output holds every earlier turn. Where that fails (a *prefix break*: the agent edited
  its history, or the proxy flagged a re-render) the path is split and a new row starts at the
  breaking interaction. Rows are keyed by their last interaction (`sample_id`), so a segment
  shared by several paths (the part before a break both branches go through) is emitted once.

Interactions without any sampled token (an engine abort before the first token) cannot be
trained on; they take part in reward propagation but produce no row of their own.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from pipeline.errors import ArlError
from schemas.trajectory import FINISH_REASONS, TrajectoryRow, validate_row

ExportStyle = Literal["individual", "concat"]
EXPORT_STYLES: tuple[str, ...] = ("individual", "concat")


class TrajectoryError(ArlError, ValueError):
    """An interaction or a request on the tree is inconsistent (bad lengths, unknown parent, bad reward)."""


class UnknownInteraction(TrajectoryError, LookupError):
    """An interaction id that is not in the session (the proxy answers 404 with this message)."""


@dataclass
class Interaction:
    """One LLM call as the engine saw and produced it."""

    id: str
    session_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    messages: list[dict] = field(default_factory=list)
    """The request's messages, normalised to the OpenAI chat shape."""
    response_message: dict | None = None
    """The assistant message returned to the agent."""
    parent_id: str | None = None
    prefix_break: bool = False
    """True when the prompt does not extend the parent's prompt + output tokens (set by the proxy)."""
    finish_reason: str = "stop"
    """`stop`, `length`, `tool_calls` or `abort`, already mapped by the proxy."""
    reward: float | None = None
    created_at: float = field(default_factory=time.time)
    """Epoch seconds when the call finished."""
    metadata: dict = field(default_factory=dict)

    @property
    def full_ids(self) -> list[int]:
        """Prompt + sampled tokens: what a child interaction's prompt must start with."""
        return [*self.prompt_ids, *self.output_ids]


class SessionTree:
    """The interactions of one session, in the order they were added (parents before children)."""

    def __init__(self, session_id: str, group_id: str, metadata: dict | None = None) -> None:
        self.session_id = session_id
        self.group_id = group_id
        self.metadata: dict = dict(metadata or {})
        self._nodes: dict[str, Interaction] = {}
        self._children: dict[str, list[str]] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[Interaction]:
        return iter(self._nodes.values())

    def add(self, interaction: Interaction) -> None:
        """Add a finished interaction; its parent (if any) must already be in the tree."""
        _check_interaction(interaction, self.session_id)
        if interaction.id in self._nodes:
            raise TrajectoryError(f"interaction {interaction.id!r} is already in session {self.session_id!r}")
        if interaction.parent_id is not None and interaction.parent_id not in self._nodes:
            raise TrajectoryError(
                f"interaction {interaction.id!r} names parent {interaction.parent_id!r}, which is not in session "
                f"{self.session_id!r}: add the parent first"
            )
        self._nodes[interaction.id] = interaction
        self._children[interaction.id] = []
        if interaction.parent_id is not None:
            self._children[interaction.parent_id].append(interaction.id)

    def get(self, interaction_id: str) -> Interaction:
        try:
            return self._nodes[interaction_id]
        except KeyError:
            raise UnknownInteraction(self._unknown_message(interaction_id)) from None

    def last(self) -> Interaction | None:
        """The most recently added interaction (the one a bare `set_reward` rewards)."""
        if not self._nodes:
            return None
        return next(reversed(self._nodes.values()))

    def children(self, interaction_id: str) -> list[Interaction]:
        self.get(interaction_id)
        return [self._nodes[c] for c in self._children[interaction_id]]

    def set_reward(self, reward: float, interaction_id: str | None = None) -> None:
        """Reward one interaction (`None` = the last one). Setting it again replaces the old value."""
        value = float(reward)
        if not math.isfinite(value):
            raise TrajectoryError(f"reward must be a finite number, got {reward!r}")
        if interaction_id is None:
            target = self.last()
            if target is None:
                raise UnknownInteraction(
                    f"session {self.session_id!r} has no interaction yet: make an LLM call before setting a reward"
                )
        else:
            target = self.get(interaction_id)
        target.reward = value

    def is_break(self, interaction: Interaction) -> bool:
        """Does `interaction` start a new token sequence (flagged, or its prompt does not extend the parent)?"""
        if interaction.parent_id is None:
            return False
        if interaction.prefix_break:
            return True
        parent = self._nodes[interaction.parent_id]
        head = len(parent.prompt_ids) + len(parent.output_ids)
        prompt = interaction.prompt_ids
        return (
            len(prompt) < head
            or prompt[: len(parent.prompt_ids)] != parent.prompt_ids
            or prompt[len(parent.prompt_ids) : head] != parent.output_ids
        )

    def prefix_breaks(self) -> list[str]:
        """Ids of the interactions where the token prefix breaks (each starts a new concat row)."""
        return [i.id for i in self._nodes.values() if self.is_break(i)]

    def propagate_rewards(self, discount: float) -> dict[str, float]:
        """Discounted reward of every interaction: own (0 if unset) + discount × mean(children's)."""
        if not 0.0 <= discount <= 1.0:
            raise TrajectoryError(f"discount must be in [0, 1], got {discount}")
        out: dict[str, float] = {}
        for node_id in reversed(self._nodes):  # children were added after their parents
            node = self._nodes[node_id]
            own = node.reward if node.reward is not None else 0.0
            kids = self._children[node_id]
            out[node_id] = own + (discount * sum(out[k] for k in kids) / len(kids) if kids else 0.0)
        return out

    def export(self, style: ExportStyle, discount: float, step: int | None = None) -> list[TrajectoryRow]:
        """The session's training rows, each checked by `validate_row` (`step` None: not assigned yet)."""
        if style not in EXPORT_STYLES:
            raise TrajectoryError(f"export style must be one of {list(EXPORT_STYLES)}, got {style!r}")
        rewards = self.propagate_rewards(discount)
        if style == "individual":
            segments = [[node] for node in self._nodes.values()]
        else:
            segments = self._concat_segments()
        rows = []
        for segment in segments:
            row = self._row(segment, rewards[segment[-1].id], step)
            if row is not None:
                validate_row(row, where=f"session {self.session_id!r} sample {row.sample_id!r}")
                rows.append(row)
        return rows

    # -- internals ---------------------------------------------------------------------------
    def _concat_segments(self) -> list[list[Interaction]]:
        """Every root-to-leaf path, cut at prefix breaks; pieces deduplicated by their last id."""
        pieces: dict[str, list[Interaction]] = {}
        for leaf_id, kids in self._children.items():
            if kids:
                continue
            path = self._path_to_root(leaf_id)
            piece: list[Interaction] = []
            for node in path:
                if piece and self.is_break(node):
                    pieces.setdefault(piece[-1].id, piece)
                    piece = []
                piece.append(node)
            pieces.setdefault(piece[-1].id, piece)
        order = {node_id: i for i, node_id in enumerate(self._nodes)}
        return sorted(pieces.values(), key=lambda p: order[p[-1].id])

    def _path_to_root(self, node_id: str) -> list[Interaction]:
        path = []
        current: str | None = node_id
        while current is not None:
            node = self._nodes[current]
            path.append(node)
            current = node.parent_id
        path.reverse()
        return path

    def _row(self, segment: list[Interaction], reward: float, step: int | None) -> TrajectoryRow | None:
        """One row from interactions that extend each other's tokens (the last prompt holds them all)."""
        last = segment[-1]
        input_ids = last.full_ids
        n = len(input_ids)
        loss_mask = [0] * n
        logprobs = [0.0] * n
        versions = [-1] * n
        for node in segment:
            start = len(node.prompt_ids)
            end = start + len(node.output_ids)
            loss_mask[start:end] = [1] * len(node.output_ids)
            logprobs[start:end] = node.output_logprobs
            versions[start:end] = node.output_versions
        if 1 not in loss_mask:
            return None
        first = segment[0]
        metadata = dict(self.metadata)
        for node in segment:
            metadata.update(node.metadata)
        metadata["interaction_ids"] = [node.id for node in segment]
        metadata["prefix_break"] = self.is_break(first)
        # The merge kept the last turn's count: the row's is its turns' sum (0 when none, so that readers can
        # tell "no call" from a shard written before the count existed).
        metadata["parsed_tool_calls"] = sum(int(node.metadata.get("parsed_tool_calls", 0)) for node in segment)
        return TrajectoryRow(
            step=step,
            session_id=self.session_id,
            sample_id=last.id,
            parent_id=first.parent_id,
            group_id=self.group_id,
            input_ids=input_ids,
            loss_mask=loss_mask,
            logprobs=[float(x) for x in logprobs],
            versions=[int(x) for x in versions],
            reward=float(reward),
            prompt_len=loss_mask.index(1),
            num_turns=len(segment),
            finish_reason=last.finish_reason,
            created_at=int(last.created_at * 1000),
            metadata=json.dumps(metadata, sort_keys=True, default=str),
        )

    def _unknown_message(self, interaction_id: str) -> str:
        known = list(self._nodes)
        shown = ", ".join(repr(k) for k in known[-5:])
        more = f" (last 5 of {len(known)})" if len(known) > 5 else ""
        return (
            f"no interaction {interaction_id!r} in session {self.session_id!r}; known ids{more}: {shown or 'none yet'}"
        )


def _check_interaction(interaction: Interaction, session_id: str) -> None:
    """Refuse an interaction whose token lists disagree: a row built from it would be wrong silently."""
    where = f"interaction {interaction.id!r}"
    if interaction.session_id != session_id:
        raise TrajectoryError(f"{where} belongs to session {interaction.session_id!r}, not {session_id!r}")
    lengths = {
        "output_ids": len(interaction.output_ids),
        "output_logprobs": len(interaction.output_logprobs),
        "output_versions": len(interaction.output_versions),
    }
    if len(set(lengths.values())) != 1:
        raise TrajectoryError(f"{where}: output lists differ in length: {lengths}")
    if interaction.finish_reason not in FINISH_REASONS:
        raise TrajectoryError(f"{where}: finish_reason {interaction.finish_reason!r} not in {sorted(FINISH_REASONS)}")
    if interaction.reward is not None and not math.isfinite(interaction.reward):
        raise TrajectoryError(f"{where}: reward must be finite, got {interaction.reward!r}")
    if any(v < 0 for v in interaction.output_versions):
        raise TrajectoryError(f"{where}: negative weight version in output_versions")
