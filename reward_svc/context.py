"""What a reward component sees: the whole group, one view per trajectory, and the accuracy verdicts.

Every component has the same signature, ``fn(ctx, params) -> list[float]`` (one value per
trajectory, in group order), so group-relative components (Kimi length, efficiency's group tau) and
per-trajectory ones are called alike. ``params`` is validated by the component's own params model
(``loom.contracts.rewards``). A component that reads verdicts says so with :func:`reads`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from loom.contracts.wire import Group
from loom.formats import DEFAULT_MARKERS, Markers
from reward_svc.trace import TraceView


@dataclass
class GroupContext:
    group: Group
    views: list[TraceView]
    correct: list[float] | None = None  # accuracy per trajectory, 0/1; None when not computed
    markers: Markers = DEFAULT_MARKERS
    state: Any = None  # service-held running statistics (reflection quantile)
    cache: dict[str, Any] = field(default_factory=dict)

    def accuracy(self) -> list[float]:
        if self.correct is None:
            raise ValueError("this component needs the accuracy verdicts")
        return self.correct

    def verdicts(self, kind: Verdict, what: str) -> list[Any]:
        """The ``kind`` verdicts of the group (a component that reads them declared so: :func:`reads`);
        ``what`` names them in the error when they were not computed."""
        got = self.cache.get(kind)
        if got is None:
            raise ValueError(f"this component needs {what}")
        return list(got)

    def scores(self, kind: Verdict, what: str) -> list[float]:
        """The ``kind`` verdicts' scores, 0 where one could not be had (its status says why)."""
        return [v.score if v.status == "ok" else 0.0 for v in self.verdicts(kind, what)]


ComponentFn = Callable[[GroupContext, dict[str, Any]], list[float]]

Verdict = Literal["accuracy", "code", "judge", "process"]


def reads(*verdicts: Verdict) -> Callable[[ComponentFn], ComponentFn]:
    """Declares the verdicts a component reads (``accuracy``: the verifier's, ``ctx.accuracy()``;
    ``code``: the sandbox's; ``judge``: the judge server's; ``process``: the PRM's step scores): a
    group's are computed only when a requested component reads them."""

    def mark(fn: ComponentFn) -> ComponentFn:
        setattr(fn, "reads", frozenset(verdicts))  # noqa: B010 (a function attribute mypy cannot see)
        return fn

    return mark


def reads_of(fn: ComponentFn) -> frozenset[str]:
    """The verdicts ``fn`` declared it reads (:func:`reads`); none by default."""
    return frozenset(getattr(fn, "reads", frozenset()))
