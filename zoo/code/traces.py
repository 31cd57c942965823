"""The code model's trace format: the prompt ``[code] <statement>`` and a newline (an observation),
then the completion, a fenced Python block holding the function the problem asks for (trained), and
eos. The code reward runs the last fenced block of a completion (reward_svc/code.py):

```
[code] Write f(xs): return the even numbers of xs times 3.
```python
def f(xs):
    return [x * 3 for x in xs if x % 2 == 0]
```
```
"""

from __future__ import annotations

import re

from zoo.code.tasks import CodeProblem, code_prompt
from zoo.tiny.traces import Piece

FENCE_OPEN, FENCE_CLOSE = "```python\n", "```"
_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)  # the code reward's own rule


def completion(problem: CodeProblem) -> str:
    """The gold completion: the reference function in a fenced block."""
    return f"{FENCE_OPEN}{problem.solution}{FENCE_CLOSE}"


def code_trace(problem: CodeProblem) -> list[Piece]:
    return [Piece(code_prompt(problem), False), Piece(completion(problem), True)]


def program_of(text: str) -> str | None:
    """The program of the last fenced block of ``text``, as the code reward reads it; None without one."""
    blocks = _FENCE.findall(text)
    return blocks[-1][1] if blocks and blocks[-1][1].strip() else None
