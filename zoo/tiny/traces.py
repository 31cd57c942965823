"""Training traces and prompts in every format Loom serves, and the parsers that read them back.

A trace is a list of ``Piece``s: text plus whether it is trained on. Prompts, revealed stream
sentences and joined child results are observations (``train=False``); everything the model writes
is trained. Pieces are tokenized one by one, exactly as the rollout engines append them.

Exact layouts (``M`` = loom.formats.DEFAULT_MARKERS, ``S`` = DEFAULT_SPAWN, eos appended by the
tokenizer side, see ``zoo.tiny.tokenizer.EOS``):

plain      prompt ``[plain] Compute 47+85.\\n``
           completion ``<think> 7+5+0=12 r2\\n4+8+1=13 r132 </think> \\boxed{132}`` + eos
reflect    prompt ``[reflect] Compute 47+85.\\n``
           completion ``<think> <steps>\\nSo the answer is 132.\\n\\nWait, let me check: ...\\n\\n
           Alternatively, ...\\n</think>\\n\\n**Final Answer:**\\n\\n\\boxed{132}`` + eos
           (the ending is loom.formats.FORCED_ENDING, so a truncated revision continues naturally)
stream     prompt ``[stream]``; then per sentence the observation `` <sentence><EOS>`` and the thought
           `` <thought><EOT>`` or ``<ignore><EOT>``; after the last, the observation
           `` Now reason step by step, then answer.``, the deep phase `` <steps><EOR>`` and the answer
           `` \\boxed{132}<EOA>`` + eos
spawn      prompt ``[spawn] Use 3 5 7 to make 22.\\n``; parent ``<think> 22:[3,5,7]\\n<Calling Sub
           Searches>\\n<Start Sub Search 0 at level 1> Moving to Node #0 3*5=15 22:[15,7]\\n...
           <End Calling Sub Searches>``; observation ``\\n<Sub Searches Returned>\\n<Result of Sub
           Search 0> 3*5=15 15+7=22\\n...<End Sub Searches Returned>\\n``; answer ``</think>
           \\boxed{(3*5)+7}`` + eos
child      prompt ``[child] 3*5=15 22:[15,7]\\n`` (the spawn line after ``Moving to Node #i ``);
           completion ``<think> 15+7=22 yes </think> 3*5=15 15+7=22`` + eos (or ``... no </think> No
           solution``)
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loom.answers import last_boxed
from loom.formats import DEFAULT_MARKERS, DEFAULT_SPAWN, FORCED_ENDING, Markers, SpawnSyntax
from zoo.tiny.tasks import Problem, _apply

FORMATS = ("plain", "reflect", "stream", "spawn")


@dataclass(frozen=True)
class Piece:
    text: str
    train: bool


# ----------------------------------------------------------------------------------------- reasoning


def arith_steps(a: int, op: str, b: int) -> list[str]:
    """Column arithmetic from the units digit, accumulating the result digits (``r...``)."""
    da, db = str(a)[::-1], str(b)[::-1]
    lines: list[str] = []
    digits = ""
    carry = 0
    if op in "+-":
        for i in range(max(len(da), len(db))):
            x = int(da[i]) if i < len(da) else 0
            y = int(db[i]) if i < len(db) else 0
            if op == "+":
                s = x + y + carry
                digits = str(s % 10) + digits
                if i == max(len(da), len(db)) - 1 and s >= 10:
                    digits = "1" + digits
                lines.append(f"{x}+{y}+{carry}={s} r{digits}")
                carry = s // 10
            else:
                xe = x + 10 if x - y - carry < 0 else x
                v = xe - y - carry
                digits = str(v) + digits
                lines.append(f"{xe}-{y}-{carry}={v} r{digits}")
                carry = 1 if xe >= 10 else 0
        return lines
    # a * one digit (or more: falls back to one line per digit of b)
    if len(db) != 1:
        return [f"{a}*{d}={a * int(d)}" for d in db] + [f"r{a * b}"]
    for i, ch in enumerate(da):
        v = int(ch) * b + carry
        digits = str(v % 10) + digits
        if i == len(da) - 1 and v >= 10:
            digits = str(v // 10) + digits
        lines.append(f"{ch}*{b}+{carry}={v} r{digits}")
        carry = v // 10
    return lines


def countdown_steps(problem: Problem) -> list[str]:
    return [f"{x}{op}{y}={r}" for x, op, y, r in problem.steps]


def reasoning_lines(problem: Problem) -> list[str]:
    if problem.kind == "arith":
        return arith_steps(problem.a, problem.op, problem.b)
    return countdown_steps(problem)


# ----------------------------------------------------------------------------------------- prompts


def plain_prompt(problem: Problem) -> str:
    return f"[plain] {problem.text}\n"


def reflect_prompt(problem: Problem) -> str:
    return f"[reflect] {problem.text}\n"


def spawn_prompt(problem: Problem) -> str:
    return f"[spawn] {problem.text}\n"


def child_prompt(message: str) -> str:
    """The prompt of a spawned child: its spawn message (what follows ``Moving to Node #i ``)."""
    return f"[child] {message.strip()}\n"


STREAM_HEADER = "[stream]"


def stream_sentences(problem: Problem, rng: random.Random | None = None) -> list[str]:
    """The problem statement as sentences (without markers); a distractor may be inserted."""
    return [s for s, _ in _stream_units(problem, rng or random.Random(problem.key))]


DISTRACTORS = ("It is a sunny day.", "Take your time.", "This is a short task.", "Numbers can be big.")


def _stream_units(problem: Problem, rng: random.Random) -> list[tuple[str, str | None]]:
    """(sentence, thought or None for skip)."""
    if problem.kind == "arith":
        units: list[tuple[str, str | None]] = [
            (f"The first number is {problem.a}.", f"a={problem.a}"),
            (f"The second number is {problem.b}.", f"b={problem.b}"),
            (f"Find their {OP_WORD[problem.op]}.", f"{problem.a}{problem.op}{problem.b}"),
        ]
    else:
        nums = list(problem.numbers)
        shown = ", ".join(str(n) for n in nums[:-1]) + f" and {nums[-1]}"
        units = [
            (f"We have {shown}.", "n=" + " ".join(str(n) for n in nums)),
            (f"Make {problem.target} from them.", f"t={problem.target}"),
        ]
    if rng.random() < 0.5:
        units.insert(rng.randint(0, len(units)), (rng.choice(DISTRACTORS), None))
    return units


OP_WORD = {"+": "sum", "-": "difference", "*": "product"}


def stream_prompt(problem: Problem, markers: Markers = DEFAULT_MARKERS) -> tuple[str, list[str]]:
    """(header, sentence observations): each observation is `` <sentence><EOS>``, ready to append."""
    return STREAM_HEADER, [f" {s}{markers.sentence_end}" for s in stream_sentences(problem)]


def stream_connector(markers: Markers = DEFAULT_MARKERS) -> str:
    return f" {markers.connector}"


# ----------------------------------------------------------------------------------------- traces


def boxed(answer: str) -> str:
    return "\\boxed{" + answer + "}"


def plain_trace(problem: Problem) -> list[Piece]:
    body = "\n".join(reasoning_lines(problem))
    return [
        Piece(plain_prompt(problem), False),
        Piece(f"<think> {body} </think> {boxed(problem.gold)}", True),
    ]


def reflect_trace(
    problem: Problem, rng: random.Random | None = None, checks: tuple[int, int] = (1, 3)
) -> list[Piece]:
    """Solve, state the answer, then re-check it ``checks`` (inclusive range) times before the
    forced ending. Training uses 1-3 checks plus a short variant with 0-1 (so the ending may follow
    any chunk); bench/reflect.py's overthinking corpus uses more."""
    rng = rng or random.Random(problem.key)
    body = "\n".join(reasoning_lines(problem))
    pool = _reflections(problem)
    rng.shuffle(pool)
    k = rng.randint(*checks)
    picked = [pool[i % len(pool)] for i in range(k)]
    chunks = [f"{body}\nSo the answer is {problem.gold}.", *picked]
    think = "\n\n".join(chunks)
    return [
        Piece(reflect_prompt(problem), False),
        Piece(f"<think> {think}{FORCED_ENDING}{boxed(problem.gold)}", True),
    ]


def _reflections(problem: Problem) -> list[str]:
    g = problem.gold
    if problem.kind == "arith":
        a, b, op = problem.a, problem.b, problem.op
        inverse = {"+": f"{g}-{b}={a}", "-": f"{g}+{b}={a}", "*": f"{a}*{b}={g}"}[op]
        return [
            f"Wait, let me check: {inverse}. Yes.",
            f"Alternatively, {a}{op}{b} is {g}. Yes.",
            f"But let me check the last digit: {g[-1]}. Yes.",
            f"Hmm, let me verify again: {a}{op}{b}={g}. Yes.",
            "Let me double-check the digits: " + " ".join(g) + ". Yes.",
        ]
    return countdown_rechecks(problem, g, f"{g}={problem.target}")


def countdown_rechecks(problem: Problem, answer: str, check: str) -> list[str]:
    """The re-checks of a stated Countdown answer, ``check`` the first one's content (the tiny
    model's reflect traces here, the search and reflect models' in zoo/search/traces.py)."""
    nums = " ".join(str(n) for n in problem.numbers)
    return [
        f"Wait, let me check: {check}. Yes.",
        f"Alternatively, check the numbers: {nums}. Yes.",
        f"But let me check the target: {problem.target}. Yes.",
        f"Hmm, let me verify again: {answer} is {problem.target}. Yes.",
        f"Let me double-check each number is used once: {nums}. Yes.",
    ]


def stream_trace(problem: Problem, markers: Markers = DEFAULT_MARKERS) -> list[Piece]:
    pieces = [Piece(STREAM_HEADER, False)]
    for sentence, thought in _stream_units(problem, random.Random(problem.key)):
        pieces.append(Piece(f" {sentence}{markers.sentence_end}", False))
        pieces.append(
            Piece(f" {thought}{markers.thought_end}" if thought else markers.skip + markers.thought_end, True)
        )
    pieces.append(Piece(stream_connector(markers), False))
    deep = "\n".join(reasoning_lines(problem))
    pieces.append(Piece(f" {deep}{markers.reasoning_end} {boxed(problem.gold)}{markers.answer_end}", True))
    return pieces


# --- spawn / join (APR) ----------------------------------------------------------------------------


def _state(target: int, pool: Sequence[int]) -> str:
    return f"{target}:[" + ",".join(str(n) for n in pool) + "]"


def _moves(pool: list[int]) -> list[tuple[int, str, int, int, list[int]]]:
    """Every valid first move (x >= y) on ``pool``: (x, op, y, result, remaining pool)."""
    out = []
    seen = set()
    for i in range(len(pool)):
        for j in range(len(pool)):
            if i == j or pool[i] < pool[j]:
                continue
            for op in "+-*/":
                r = _apply(pool[i], op, pool[j])
                key = (pool[i], op, pool[j])
                if r is None or key in seen:
                    continue
                seen.add(key)
                rest = [n for k, n in enumerate(pool) if k not in (i, j)] + [r]
                out.append((pool[i], op, pool[j], r, rest))
    return out


def _solve(target: int, pool: list[int]) -> list[str] | None:
    if len(pool) == 1:
        return [] if pool[0] == target else None
    for x, op, y, r, rest in _moves(pool):
        sub = _solve(target, rest)
        if sub is not None:
            return [f"{x}{op}{y}={r}", *sub]
    return None


def child_search_lines(target: int, pool: list[int]) -> tuple[list[str], list[str] | None]:
    """A child's serial search over the moves of ``pool``: tried lines and the solution (or None)."""
    lines: list[str] = []
    for x, op, y, r, rest in _moves(pool):
        sub = _solve(target, rest)
        if sub is not None:
            lines.append(f"{x}{op}{y}={r} yes")
            return lines, [f"{x}{op}{y}={r}", *sub]
        lines.append(f"{x}{op}{y}={r} no")
    return lines, None


@dataclass(frozen=True)
class SpawnTrace:
    parent: list[Piece]
    children: list[list[Piece]]
    messages: list[str]  # each child's returned message


def spawn_trace(
    problem: Problem, syntax: SpawnSyntax = DEFAULT_SPAWN, rng: random.Random | None = None
) -> SpawnTrace:
    """APR-style: the parent spawns one child per candidate first move (the gold move among 1-2
    decoys), each child searches serially, the join block holds each child's message."""
    assert problem.kind == "countdown"
    rng = rng or random.Random(problem.key)
    pool = list(problem.numbers)
    x0, op0, y0, r0 = problem.steps[0]
    gold_rest = list(pool)
    gold_rest.remove(x0)
    gold_rest.remove(y0)
    gold_rest.append(r0)
    decoys = [m for m in _moves(pool) if (m[0], m[1], m[2]) != (x0, op0, y0)]
    rng.shuffle(decoys)
    chosen = [(x0, op0, y0, r0, gold_rest), *decoys[: rng.randint(1, 2)]]
    rng.shuffle(chosen)
    spawn_lines, children, messages, solution = [], [], [], None
    for i, (x, op, y, r, rest) in enumerate(chosen):
        message = f"{x}{op}{y}={r} {_state(problem.target, rest)}"
        spawn_lines.append(syntax.spawn_child.format(i=i, node=i) + " " + message)
        lines, sol = child_search_lines(problem.target, rest)
        ret = " ".join([f"{x}{op}{y}={r}", *sol]) if sol is not None else syntax.no_solution
        if sol is not None and solution is None:
            solution = [f"{x}{op}{y}={r}", *sol]
        body = "\n".join(lines)
        children.append([Piece(child_prompt(message), False), Piece(f"<think> {body} </think> {ret}", True)])
        messages.append(ret)
    assert solution is not None
    parent = spawn_parent(problem, pool, spawn_lines, messages, solution, syntax)
    return SpawnTrace(parent=parent, children=children, messages=messages)


def spawn_parent(
    problem: Problem,
    pool: Sequence[int],
    spawn_lines: list[str],
    messages: list[str],
    solution: list[str],
    syntax: SpawnSyntax,
    answer: str | None = None,
) -> list[Piece]:
    """A spawn trace's parent (the tiny model's and the search model's): the prompt, the state and the
    spawn block (trained), the join block of the children's ``messages`` (inserted, not trained),
    and the answer from the ``solution``'s steps (``answer``: the text after the join block, where a
    format writes more than the boxed expression)."""
    block = "\n".join([syntax.spawn_open, *spawn_lines, syntax.spawn_close])
    return [
        Piece(spawn_prompt(problem), False),
        Piece(f"<think> {_state(problem.target, pool)}\n{block}", True),
        Piece(join_block(messages, syntax), False),
        Piece(answer if answer is not None else f"</think> {boxed(expression_from_steps(solution))}", True),
    ]


_STEP = re.compile(r"^(\d+)([-+*/])(\d+)=(\d+)$")


def substitution_chain(steps: list[str]) -> list[str]:
    """The solution's expression built one substitution at a time, from the last step back:
    ``["7+4=11", "5*4=20", "20+11=31"]`` -> ``["20+11", "(5*4)+11", "(5*4)+(7+4)"]``. A step's
    number that an earlier step made is that step (the latest one making it), every other number is
    itself; each line opens one more step, in parentheses unless it is the last. The four-number
    traces write the chain out (zoo/search/deep.py); :func:`expression_from_steps` is its last line."""
    nodes: list[tuple[tuple[str, int], str, tuple[str, int], int]] = []
    made: dict[int, list[int]] = {}  # result -> the steps that made it, latest last
    for k, step in enumerate(steps):
        m = _STEP.match(step.strip())
        if not m:
            raise ValueError(f"bad step {step!r}")
        x, op, y, r = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
        left = ("step", made[x].pop()) if made.get(x) else ("num", x)
        right = ("step", made[y].pop()) if made.get(y) else ("num", y)
        nodes.append((left, op, right, r))
        made.setdefault(r, []).append(k)

    def render(ref: tuple[str, int], opened: set[int], top: bool = False) -> str:
        kind, v = ref
        if kind == "num":
            return str(v)
        left, op, right, r = nodes[v]
        if v not in opened:
            return str(r)
        inner = f"{render(left, opened)}{op}{render(right, opened)}"
        return inner if top else f"({inner})"

    last = len(steps) - 1
    return [render(("step", last), set(range(k, last + 1)), top=True) for k in range(last, -1, -1)]


def expression_from_steps(steps: list[str]) -> str:
    """``["3*5=15", "15+7=22"]`` -> ``(3*5)+7``: each result is replaced by its sub-expression."""
    return substitution_chain(steps)[-1] if steps else ""


# ----------------------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class StreamParse:
    thoughts: list[str]  # content of each streaming segment (the skip marker kept as is)
    deep: str | None  # deep phase content (before <EOR>), None when missing
    answer: str | None  # boxed content of the answer segment
    well_formed: bool


def parse_stream(
    completion_segments: list[str], final: str, markers: Markers = DEFAULT_MARKERS
) -> StreamParse:
    """Parse the model-written parts: one text per streaming segment and the final (deep + answer)."""
    ok = True
    thoughts = []
    for seg in completion_segments:
        s = seg.strip()
        if not s.endswith(markers.thought_end):
            ok = False
        content = s.removesuffix(markers.thought_end).strip()
        if not content:
            ok = False
        thoughts.append(content)
    deep, answer = None, None
    if markers.reasoning_end in final:
        deep, rest = final.split(markers.reasoning_end, 1)
        deep = deep.strip()
        ok = ok and bool(deep)
        answer = last_boxed(rest.split(markers.answer_end)[0])
    else:
        ok = False
    return StreamParse(thoughts=thoughts, deep=deep, answer=answer, well_formed=ok and answer is not None)


def split_stream_text(text: str, markers: Markers = DEFAULT_MARKERS) -> tuple[list[str], str]:
    """Split a whole interleaved stream text into (model segments after each <EOS>, final part)."""
    after_connector = text.split(markers.connector)
    head, final = after_connector[0], markers.connector.join(after_connector[1:])
    segments = []
    for chunk in head.split(markers.sentence_end)[1:]:
        cut = chunk.find(markers.thought_end)
        segments.append((chunk if cut < 0 else chunk[: cut + len(markers.thought_end)]).strip())
    return segments, final


_SPAWN_LINE = re.compile(r"<Start Sub Search (\d+) at level 1> Moving to Node #(\S+) ?(.*)")


def parse_spawn(text: str, syntax: SpawnSyntax = DEFAULT_SPAWN) -> list[tuple[int, str, str]] | None:
    """The children of the last complete spawn block: (index, node, message), or None."""
    end = text.rfind(syntax.spawn_close)
    start = text.rfind(syntax.spawn_open, 0, end if end >= 0 else None)
    if start < 0 or end < 0:
        return None
    block = text[start + len(syntax.spawn_open) : end]
    out = []
    for line in block.strip().splitlines():
        m = _SPAWN_LINE.match(line.strip())
        if m:
            out.append((int(m.group(1)), m.group(2), m.group(3).strip()))
    return out or None


def child_message(completion: str) -> str:
    """A child's returned message: the text after ``</think>`` (without eos), or "No solution"."""
    if "</think>" not in completion:
        return DEFAULT_SPAWN.no_solution
    return completion.split("</think>", 1)[1].strip() or DEFAULT_SPAWN.no_solution


def join_block(messages: list[str], syntax: SpawnSyntax = DEFAULT_SPAWN) -> str:
    """The observation appended after a spawn block (exactly as in training)."""
    lines = [syntax.join_open, *(syntax.join_child.format(i=i, message=m) for i, m in enumerate(messages))]
    return "\n" + "\n".join([*lines, syntax.join_close]) + "\n"


def trace_text(pieces: list[Piece]) -> str:
    return "".join(p.text for p in pieces)


def build_trace(problem: Problem, fmt: str) -> list[list[Piece]]:
    """Training sequences for ``problem`` in ``fmt`` (spawn gives the parent and every child)."""
    if fmt == "plain":
        return [plain_trace(problem)]
    if fmt == "reflect":
        short = reflect_trace(problem, random.Random(problem.key + "/short"), checks=(0, 1))
        return [reflect_trace(problem), short]
    if fmt == "stream":
        return [stream_trace(problem)]
    if fmt == "spawn":
        t = spawn_trace(problem)
        return [t.parent, *t.children]
    raise ValueError(f"unknown format {fmt!r}")


def posed(problem: Problem, fmt: str) -> tuple[str, dict[str, Any]]:
    """``problem`` as a run item in the prompt format ``fmt`` (a mode's ``BUILTIN_FORMAT``): its prompt
    and the item's own mode params. The stream format's prompt is its header alone, the sentences
    its params: the streaming mode reveals `` <sentence><EOS>` itself, as :func:`stream_prompt`
    writes them."""
    if fmt == "stream":
        return STREAM_HEADER, {"sentences": stream_sentences(problem)}
    prompts = {"plain": plain_prompt, "reflect": reflect_prompt, "spawn": spawn_prompt}
    return prompts[fmt](problem), {}
