"""Loom's built-in tool model, ``tool``: the tiny model fine-tuned to call the calculator
mid-reasoning, read its result and continue to a boxed answer (docs/models.md, "The tool model").

Agent mode (rollout_svc/modes/agent.py, docs/algorithms.md §2.5) needs a policy that writes tool calls
in a parser's format and reads the observations it gets back; the tiny model writes none. The
problems are the tiny model's arithmetic with multi-digit multiplication added (:data:`TOOL_KNOBS`:
``a*b`` with ``b`` of 2-3 digits, which column steps in the head get wrong), prompted as the tiny
model's plain prompt, so the gateway's built-in ``arith`` dataset serves them with these knobs. The
calls use the ``function`` parser (``<call>calculator(47*38)</call>``): its tags and its response
wrapper are shorter than Hermes' JSON, and the tiny tokenizer writes both (``loom.formats.marker_ids``).

A trace renders exactly as agent mode builds the sequence: the policy's text up to and including the
close tag, then the parser's response wrapper with the tool's real output (``loom.tools``: the very
functions agent mode runs), each piece encoded alone as agent mode encodes it, observations masked out
of the loss as the learner masks them. Four kinds, drawn per trace (:data:`KINDS`):

- ``call``: ``<think> <call>calculator(47*38)</call>`` | ``\\n<result>1786</result>\\n`` |
  `` </think> \\boxed{1786}``;
- ``head``: no call, the tiny model's column steps (``47*8=376 47*3=141 r1786`` for a multiplication,
  a line the model cannot compute reliably);
- ``retry``: a first call that goes wrong (a missing parenthesis: ``error: malformed tool call``; a
  wrong name: ``error: unknown tool 'calc'; ...``), then the right call and the answer;
- ``fallback``: the call answered ``unknown tool`` because the calculator is not enabled
  (:data:`NO_TOOL`), then the column steps: what "without the tool" measures.

Calls and the head are mixed so the policy sampled at the demo's temperature answers part of the time
without the tool, and RL in agent mode has a choice to learn (``loom demo --mode agent``,
docs/benchmarks/demo.md). ``loom train-tool`` starts from the tiny checkpoint, its tokenizer unchanged.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from loom.answers import last_boxed
from loom.formats import marker_ids
from loom.tools import MALFORMED, SYNTAXES, TOOLS, ToolError, parse_call, unknown_tool
from zoo.recipe import CardText, FinetuneConfig, on_device, reproduce
from zoo.tiny.evaluate import FormatResult
from zoo.tiny.tasks import HELDOUT_SEED, Problem, make_problems
from zoo.tiny.traces import Piece, arith_steps, boxed, plain_prompt, plain_trace

PARSER = "function"  # agent mode's mode_params.parser for this model
SYNTAX = SYNTAXES[PARSER]
TOOLS_ON = ["calculator"]  # the tools the demo and the card's "tool" row enable
NO_TOOL = ["countdown_check"]  # the card's "no_tool" row: the calculator not enabled
# the arithmetic the model is trained and evaluated on (gateway ``arith`` knobs: loom demo --mode agent)
TOOL_KNOBS: dict[str, Any] = {"ops": ("+", "-", "*"), "digits": (2, 3), "mul_digits_b": (2, 3)}
# trace kind -> P(kind) per trace
KINDS: dict[str, float] = {"call": 0.45, "head": 0.35, "retry": 0.1, "fallback": 0.1}
MAX_TURNS = 4  # agent mode's max_turns for this model: a retry takes three turns
TURN_TOKENS = 64  # the held-out turns' budget (sampling.max_tokens)


def tool_problems(n: int, seed: int, split: str = "any") -> list[Problem]:
    """``n`` distinct problems of :data:`TOOL_KNOBS` (the tiny tasks' hash split)."""
    return make_problems("arith", n, seed, split, **TOOL_KNOBS)  # type: ignore[arg-type]


def observation(turn: str, enabled: list[str]) -> str:
    """The observation agent mode appends after ``turn`` (a turn ending with the close tag): the
    parser's response wrapper around the tool's output, or the error agent mode reports."""
    call = parse_call(turn, PARSER)
    if call is None:
        out = MALFORMED
    elif call.name not in enabled or call.name not in TOOLS:
        out = unknown_tool(call.name, enabled)
    else:
        try:
            out = TOOLS[call.name](call.arguments)
        except ToolError as exc:
            out = f"error: {exc}"
    return SYNTAX.response.format(output=out)


def call_pieces(body: str, enabled: list[str], head: str = "") -> list[Piece]:
    """``head`` (trained), a call of ``body`` (its tags encoded alone, as agent mode matches and
    writes them) and its observation (masked)."""
    turn = f"{head}{SYNTAX.call_open}{body}{SYNTAX.call_close}"
    pieces = [Piece(head, True)] if head else []
    pieces += [Piece(SYNTAX.call_open, True), Piece(body, True), Piece(SYNTAX.call_close, True)]
    return [*pieces, Piece(observation(turn, enabled), False)]


def bad_call(problem: Problem, rng: random.Random) -> str:
    """A first call that goes wrong: a missing parenthesis or a wrong tool name."""
    expr = f"{problem.a}{problem.op}{problem.b}"
    return f"calculator({expr}" if rng.random() < 0.5 else f"{rng.choice(('calc', 'compute'))}({expr})"


def tool_trace(problem: Problem, kind: str, rng: random.Random) -> list[Piece]:
    """One trace of ``kind`` (:data:`KINDS`) for an arithmetic problem."""
    if kind == "head":
        return plain_trace(problem)
    good = f"calculator({problem.a}{problem.op}{problem.b})"
    pieces = [Piece(plain_prompt(problem), False)]
    if kind == "fallback":
        pieces += call_pieces(good, NO_TOOL, "<think> ")
        steps = "\n".join(arith_steps(problem.a, problem.op, problem.b))
        return [*pieces, Piece(f"{steps} </think> {boxed(problem.gold)}", True)]
    if kind == "retry":
        pieces += call_pieces(bad_call(problem, rng), TOOLS_ON, "<think> ")
        pieces += call_pieces(good, TOOLS_ON)
    else:
        pieces += call_pieces(good, TOOLS_ON, "<think> ")
    result = pieces[-1].text.removeprefix("\n<result>").removesuffix("</result>\n")  # the tool's output
    return [*pieces, Piece(f" </think> {boxed(result)}", True)]


# ------------------------------------------------------------------------------------------- training


@dataclass
class ToolTrainConfig(FinetuneConfig):
    steps: int = 400
    train_problems: int = 4000
    eval_problems: int = 100
    max_len: int = 256
    traces_per_problem: int = 2


def sequences(cfg: ToolTrainConfig) -> list[list[Piece]]:
    """``traces_per_problem`` traces per training problem, each of a kind drawn from :data:`KINDS`."""
    seqs: list[list[Piece]] = []
    kinds, weights = list(KINDS), list(KINDS.values())
    for p in tool_problems(cfg.train_problems, cfg.seed, "train"):
        rng = random.Random(f"{p.key}/tool/{cfg.seed}")
        for _ in range(cfg.traces_per_problem):
            seqs.append(tool_trace(p, rng.choices(kinds, weights)[0], rng))
    return seqs


def facts(cfg: ToolTrainConfig, seqs: list[list[Piece]], data: object, model: object) -> dict:
    return {"kinds": KINDS, "knobs": {k: list(v) for k, v in TOOL_KNOBS.items()}, "parser": PARSER}


class _StopAtClose:
    """Stop a greedy generation when it ends with the close tag's canonical ids."""

    def __init__(self, close: list[int]) -> None:
        self.close = torch.tensor(close)

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kw: Any) -> torch.Tensor:
        n = len(self.close)
        done = input_ids.shape[1] >= n and bool((input_ids[0, -n:] == self.close).all())
        return torch.tensor([done])


@torch.no_grad()
def greedy_episode(model: Any, tok: Any, prompt: str, enabled: list[str]) -> tuple[str, int]:
    """A greedy agent episode with HF ``generate``, built as agent mode builds it (turns stopped at
    the close tag, observations encoded alone and appended): the completion's text and its calls. A
    reference for the card; the held-out numbers of docs/models.md are agent mode's on the torch
    engine (bench/tool_model.py)."""
    close = marker_ids(tok, SYNTAX.call_close)
    ids = tok.encode(prompt, add_special_tokens=False)
    start, calls = len(ids), 0
    for _ in range(MAX_TURNS):
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=TURN_TOKENS,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            stopping_criteria=[_StopAtClose(close)],
        )
        turn = out[0, len(ids) :].tolist()
        ids += [t for t in turn if t != tok.eos_token_id]
        if turn[-len(close) :] != close:
            break
        calls += 1
        ids += tok.encode(observation(tok.decode(turn), enabled), add_special_tokens=False)
    return tok.decode(ids[start:]), calls


def eval_agent(model: Any, tok: Any, problems: list[Problem], enabled: list[str]) -> FormatResult:
    """Greedy held-out accuracy of :func:`greedy_episode` with ``enabled`` tools."""
    res = FormatResult(total=len(problems))
    for i, p in enumerate(problems):
        text, _ = greedy_episode(model, tok, plain_prompt(p), enabled)
        if i == 0:
            res.sample = plain_prompt(p) + text
        ans = last_boxed(text) if "</think>" in text else None
        res.parsed += ans is not None
        res.correct += p.verify(ans)
    return res


def heldout(model, tok, n: int) -> dict[str, FormatResult]:  # type: ignore[no-untyped-def]
    """Greedy held-out accuracy with the calculator (``tool``) and without it (``no_tool``)."""
    problems = tool_problems(n, HELDOUT_SEED, "test")
    return {
        "tool": eval_agent(model, tok, problems, TOOLS_ON),
        "no_tool": eval_agent(model, tok, problems, NO_TOOL),
    }


ABOUT = (
    "The tiny model (zoo/tiny/checkpoint) fine-tuned by `loom train-tool` on arithmetic traces that\n"
    "call the calculator in agent mode's `function` format, read its result and box it, mixed with\n"
    "traces that answer in the head, retry a bad call, or fall back to the head when the calculator\n"
    "is not enabled (zoo/tiny/tool.py). Rows: greedy episodes with the calculator enabled (`tool`)\n"
    "and without it (`no_tool`), this card's reference loop (HF generate). Reproduce with"
)


def card_text(card: dict) -> CardText:
    data = [
        f"- {card['sequences']} sequences; trace kinds {card['kinds']}; parser {card['parser']}",
        f"- problems: arithmetic {card['knobs']}",
    ]
    return CardText(
        "Loom tool model", ABOUT, reproduce("tool", card, "seed", "steps", "lr"), data, on_device(card)
    )
