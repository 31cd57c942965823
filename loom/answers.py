"""The boxed final answer, read one way everywhere: the reward service's accuracy and answer region
(docs/algorithms.md §1.1), tree mode's exact reward and the tiny model's traces and evaluation."""

from __future__ import annotations

import re

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str, max_tries: int = 8) -> str | None:
    """Content of the last balanced ``\\boxed{...}`` (or ``\\fbox``), as written (not stripped); None
    when there is none.

    Scans backwards over at most ``max_tries`` openings so an unbalanced trailing ``\\boxed{`` does
    not hide an earlier complete one; each try is linear in the text.
    """
    starts = [m.end() for m in _BOX.finditer(text)]
    for start in reversed(starts[-max_tries:]):
        depth = 1
        for i in range(start, len(text)):
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None
