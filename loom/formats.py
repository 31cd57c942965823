"""Markers and syntax of the trace formats Loom serves. Configuration, not constants: every mode and
reward takes a ``Markers`` / ``SpawnSyntax`` argument and these are only the defaults.

Streaming defaults follow StreamingThinker (docs/algorithms.md §1.2); the spawn syntax is APR's Countdown
syntax (docs/algorithms.md §2.4); the reasoning format is ``<think>…</think>`` then ``\\boxed{}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Markers:
    sentence_end: str = "<EOS>"  # closes each revealed source sentence
    thought_end: str = "<EOT>"  # closes each streaming thought
    reasoning_end: str = "<EOR>"  # closes the deep-reasoning phase
    answer_end: str = "<EOA>"  # closes the answer
    skip: str = "<ignore>"  # a streaming thought that skips this sentence
    think_open: str = "<think>"
    think_close: str = "</think>"
    connector: str = "Now reason step by step, then answer."  # instruction I after the last sentence

    def special_tokens(self) -> list[str]:
        return [
            self.sentence_end,
            self.thought_end,
            self.reasoning_end,
            self.answer_end,
            self.skip,
            self.think_open,
            self.think_close,
        ]


@dataclass(frozen=True)
class SpawnSyntax:
    """APR's Countdown spawn/join syntax; ``{i}`` is the child index, ``{node}`` its node id."""

    spawn_open: str = "<Calling Sub Searches>"
    spawn_child: str = "<Start Sub Search {i} at level 1> Moving to Node #{node}"
    spawn_close: str = "<End Calling Sub Searches>"
    join_open: str = "<Sub Searches Returned>"
    join_child: str = "<Result of Sub Search {i}> {message}"
    join_close: str = "<End Sub Searches Returned>"
    no_solution: str = "No solution"
    tokens: list[str] = field(
        default_factory=lambda: [
            "<Calling Sub Searches>",
            "<End Calling Sub Searches>",
            "<Sub Searches Returned>",
            "<End Sub Searches Returned>",
        ]
    )


DEFAULT_MARKERS = Markers()
DEFAULT_SPAWN = SpawnSyntax()

# The forced ending REA-RL appends to a truncated thinking part (docs/algorithms.md §3).
FORCED_ENDING = "\n</think>\n\n**Final Answer:**\n\n"

# REA-RL reflection keywords (docs/algorithms.md §1.5).
REFLECTION_KEYWORDS: tuple[str, ...] = ("wait", "alternatively", "check", "but")
