"""Agent mode's tool-call formats and built-in tools, pure (docs/algorithms.md §2.5).

The rollout service's agent mode (rollout_svc/modes/agent.py) parses a turn's call and runs these
tools; the built-in tool model's traces (zoo/tiny/tool.py, docs/models.md) are rendered with the very
same functions, so a trace's observation is the text agent mode appends. They live in the core
because the models import no service (docs/architecture.md, the walls). Each is a pure function of
its arguments, never code or URLs from a request.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from loom.exact import check_countdown


@dataclass(frozen=True)
class Syntax:
    """A parser's tags: the call's open/close tags and the fixed wrapper of a tool's response."""

    call_open: str
    call_close: str
    response: str  # str.format template with {output}


SYNTAXES: dict[str, Syntax] = {
    # the Qwen2.5/Qwen3 (Hermes) templates' tool call and tool response
    "hermes": Syntax("<tool_call>", "</tool_call>", "\n<tool_response>\n{output}\n</tool_response>\n"),
    # a plain call: <call>calculator(2+3)</call>; the argument is the tool's input text, or a JSON object
    "function": Syntax("<call>", "</call>", "\n<result>{output}</result>\n"),
    # Toolformer's inline calculator: a turn ending "7-3=" calls calculator("7-3"), the result follows
    "inline": Syntax("", "=", "{output}"),
}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


MALFORMED = "error: malformed tool call"
_FUNCTION = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]{0,63})\((.*)\)\s*", re.DOTALL)
_INLINE = re.compile(r"[0-9.+\-*/()]+\Z")


def parse_call(text: str, parser: str) -> ToolCall | None:
    """The call that ``text`` (a turn ending with the close tag) ends with; None when malformed."""
    syntax = SYNTAXES[parser]
    body = text.rstrip()
    if not body.endswith(syntax.call_close):
        return None
    body = body[: -len(syntax.call_close)]
    if parser == "inline":  # the arithmetic written just before the "="
        m = _INLINE.search(body)
        return None if m is None else ToolCall("calculator", {"expression": m.group(0)})
    start = body.rfind(syntax.call_open)
    if start < 0:
        return None
    inner = body[start + len(syntax.call_open) :].strip()
    if parser == "hermes":
        try:
            obj = json.loads(inner)
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some templates write the arguments as a JSON string
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                return None
        return ToolCall(obj["name"], args) if isinstance(args, dict) else None
    m = _FUNCTION.fullmatch(inner)
    if m is None:
        return None
    raw = m.group(2).strip()
    if raw.startswith("{"):
        try:
            args = json.loads(raw)
        except (ValueError, RecursionError):
            return None
        return ToolCall(m.group(1), args) if isinstance(args, dict) else None
    return ToolCall(m.group(1), {"input": raw})


# built-in tools: pure functions of their arguments, never code or URLs from the request

MAX_CALC_CHARS = 256
MAX_CALC_NODES = 128
MAX_EXPONENT = 64
MAX_DIGITS = 200

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class ToolError(ValueError):
    """A tool's input is not one it accepts; the message is the observation."""


def _bounded(v: Fraction) -> Fraction:
    if len(str(abs(v.numerator))) > MAX_DIGITS or len(str(v.denominator)) > MAX_DIGITS:
        raise ToolError(f"result exceeds {MAX_DIGITS} digits")
    return v


def _calc(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(Fraction(str(node.value)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _calc(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp):
        a, b = _calc(node.left), _calc(node.right)
        if isinstance(node.op, ast.Pow):
            if b.denominator != 1 or abs(b) > MAX_EXPONENT:
                raise ToolError(f"exponent must be an integer of at most {MAX_EXPONENT} in size")
            if a == 0 and b < 0:
                raise ToolError("division by zero")
            return _bounded(a ** int(b))
        fn = _BINARY.get(type(node.op))
        if fn is None:
            raise ToolError(f"operator {type(node.op).__name__} is not supported")
        if b == 0 and isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod):
            raise ToolError("division by zero")
        return _bounded(Fraction(fn(a, b)))
    raise ToolError(f"{type(node).__name__} is not arithmetic")


def calculate(expression: str) -> str:
    """Arithmetic (``+ - * / // % **``, parentheses, int and decimal literals) on exact fractions:
    parsed with ``ast`` and walked, never evaluated; sizes, nodes, exponents and digits bounded."""
    text = expression.replace("^", "**").replace("×", "*").replace("÷", "/").strip()
    if len(text) > MAX_CALC_CHARS:
        raise ToolError(f"expression longer than {MAX_CALC_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ToolError("not an arithmetic expression") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_CALC_NODES:
        raise ToolError(f"expression has more than {MAX_CALC_NODES} nodes")
    v = _calc(tree.body)
    return str(v.numerator) if v.denominator == 1 else f"{float(v):.12g}"


def _text_arg(args: dict[str, Any], *names: str) -> str:
    for n in names:
        if isinstance(args.get(n), str | int | float) and not isinstance(args.get(n), bool):
            return str(args[n])
    raise ToolError(f"missing argument {names[0]!r}")


def calculator_tool(args: dict[str, Any]) -> str:
    return calculate(_text_arg(args, "expression", "input"))


def countdown_check_tool(args: dict[str, Any]) -> str:
    """Does ``expression`` reach ``target`` using each of ``numbers`` exactly once (``loom.exact``)?"""
    expression = _text_arg(args, "expression", "input")
    numbers, target = args.get("numbers"), args.get("target")
    if not isinstance(numbers, list) or not all(type(n) is int for n in numbers) or type(target) is not int:
        raise ToolError("countdown_check takes expression, numbers (integers) and target (an integer)")
    if len(numbers) > 16:
        raise ToolError("at most 16 numbers")
    return "correct" if check_countdown(expression, numbers, target) else "incorrect"


# the built-in registry (its names: loom.contracts.modes.AGENT_TOOLS, what a request may enable)
TOOLS: dict[str, Callable[[dict[str, Any]], str]] = {
    "calculator": calculator_tool,
    "countdown_check": countdown_check_tool,
}


def unknown_tool(name: str, enabled: list[str]) -> str:
    """The observation of a call to a tool that is not enabled (or not built in)."""
    return f"error: unknown tool {name[:64]!r}; available: {', '.join(enabled)}"
