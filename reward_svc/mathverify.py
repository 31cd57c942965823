"""math-verify as Loom calls it: inside a verification worker process only (see ``pool.py``).

Guards, each for a measured failure (shared/notes/verifier.md):
- only LaTeX extraction (``LatexExtractionConfig``): math-verify's plain-expression extraction runs
  ``sympy.parse_expr``, which builds Python source from the text and ``eval``s it (builtins included),
  and its regex is quadratic. Both entry points are also replaced by a refusal in the worker
  (``install_guards``), so no code path can evaluate model text as Python;
- only the answer region is parsed (last boxed answer; else the tail), long or deeply nested answers
  are refused before parsing;
- math-verify's own integer timeouts stay on (the worker runs them in its main thread);
- gold answers are parsed once per worker and cached.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from loom.contracts.rewards import MAX_ANSWER_CHARS
from reward_svc.trace import brace_depth

MAX_GOLD_CHARS = 2000
MAX_BRACE_DEPTH = 12  # nested \frac grows exponentially with depth (depth 20 ran > 20 s)
GOLD_CACHE_SIZE = 4096
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?")
_DELIMITED = ("$", "\\boxed", "\\(", "\\[", "\\fbox")


@dataclass(frozen=True)
class MathItem:
    """One verification: gold label and the response's answer region (see ``trace.answer_region``)."""

    gold: str
    kind: str  # "boxed" | "tail"
    region: str
    number_fallback: bool = True


@dataclass(frozen=True)
class Verdict:
    status: str  # ok | timeout | parse_error | no_answer | invalid
    correct: bool = False
    detail: str | None = None
    seconds: float = 0.0  # time the item spent in its worker, measured by the parent


class RefusedEval(RuntimeError):
    pass


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise RefusedEval("parse_expr is disabled in Loom's verifier: it evaluates text as Python")


def install_guards() -> None:
    """Make every path from math-verify to ``sympy.parse_expr`` raise instead of evaluating."""
    import latex2sympy2_extended.latex2sympy2 as l2s
    import math_verify.parser as mvp

    mvp.parse_expr_cached = _refuse
    mvp.parse_expr = _refuse  # type: ignore[attr-defined]
    l2s.parse_expr = _refuse


class Checker:
    """Per-process state: the gold cache. ``check`` is what a worker runs for each item."""

    def __init__(self, cache_size: int = GOLD_CACHE_SIZE) -> None:
        from math_verify import LatexExtractionConfig

        self.config = [LatexExtractionConfig(boxed_match_priority=0)]
        self.gold_cache: OrderedDict[str, list[Any]] = OrderedDict()
        self.cache_size = cache_size
        self.gold_hits = 0

    def _parse(self, text: str, timeout_s: int) -> list[Any]:
        from math_verify import parse

        return list(parse(text, self.config, parsing_timeout=timeout_s, raise_on_error=True))

    def gold(self, gold: str, timeout_s: int) -> list[Any]:
        if gold in self.gold_cache:
            self.gold_hits += 1
            self.gold_cache.move_to_end(gold)
            return self.gold_cache[gold]
        wrapped = gold if any(d in gold for d in _DELIMITED) else "\\boxed{" + gold + "}"
        parsed = self._parse(wrapped, timeout_s)
        self.gold_cache[gold] = parsed
        if len(self.gold_cache) > self.cache_size:
            self.gold_cache.popitem(last=False)
        return parsed

    def answer(self, item: MathItem, timeout_s: int) -> list[Any] | None:
        """Parsed answer; [] when the region held an answer that did not parse; None when none."""
        if item.kind == "boxed":
            return self._parse("\\boxed{" + item.region + "}", timeout_s) if item.region.strip() else []
        parsed = self._parse(item.region, timeout_s)
        if parsed:
            return parsed
        if item.number_fallback:
            numbers = _NUMBER.findall(item.region)
            if numbers:
                return self._parse("\\boxed{" + numbers[-1].replace(" ", "") + "}", timeout_s)
        return None

    def check(self, item: MathItem, timeout_s: int) -> Verdict:
        from math_verify import verify
        from math_verify.errors import TimeoutException

        limits = (TimeoutException, RecursionError, MemoryError)  # while parsing or comparing
        gold = item.gold.strip()
        if not gold or len(gold) > MAX_GOLD_CHARS or brace_depth(gold) > MAX_BRACE_DEPTH:
            return Verdict("invalid", detail="gold answer empty or over the size limits")
        if len(item.region) > MAX_ANSWER_CHARS or brace_depth(item.region) > MAX_BRACE_DEPTH:
            return Verdict("parse_error", detail="answer over the size or nesting limits")
        try:
            gold_parsed = self.gold(gold, timeout_s)
            if not gold_parsed:
                return Verdict("invalid", detail="gold answer did not parse")
            answer = self.answer(item, timeout_s)
            if answer is None:
                return Verdict("no_answer")
            if not answer:
                return Verdict("parse_error", detail="answer did not parse")
        except limits as exc:
            return _limit_verdict(exc)
        except Exception as exc:  # sympy raises anything on odd input: the answer is unusable
            return Verdict("parse_error", detail=type(exc).__name__)
        try:
            ok = verify(gold_parsed, answer, timeout_seconds=timeout_s, raise_on_error=True)
        except limits as exc:
            return _limit_verdict(exc)
        except Exception:  # objects sympy cannot compare (a set against a number): not equal
            ok = False
        return Verdict("ok", correct=bool(ok))


def _limit_verdict(exc: BaseException) -> Verdict:
    """The verdict for math-verify's own timeout, or a recursion or memory limit."""
    if isinstance(exc, RecursionError):
        return Verdict("parse_error", detail="nesting too deep")
    if isinstance(exc, MemoryError):
        return Verdict("parse_error", detail="memory limit")
    return Verdict("timeout", detail="math-verify timeout")
