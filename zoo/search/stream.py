"""Loom's third built-in model, ``stream``: the search model fine-tuned on streaming traces
whose reading phase can be wasteful, as real models' is, so that AdaSR's HRPO has something to shorten.

The search model's streaming thoughts are already their shortest form (``n=3 5 7``, ``t=22`` or the
skip marker), 13.2 tokens a trace in docs/benchmarks/adasr.md. Here each trace draws a *verbosity*
``w`` (0 to 3, :data:`VERBOSITY`), and each thought carries up to ``w`` extras drawn from its
sentence's pool:

- the numbers (``We have 3, 5 and 7.``): a restatement (``we have 3, 5 and 7 so``) before
  ``n=3 5 7``, and pre-solving with partial arithmetic on pairs of the numbers (``5*7=35``);
- the target (``Make 22 from them.``): a restatement before ``t=22``, an early guess with its
  verdict (``guess 3+5+7=15 no``), and what the target leaves after one number (``22-7=15``);
- a distractor: its restatement (``it is a sunny day so skip``) in place of the skip marker.

None of the extras is used by the deep phase, which is the search model's search (FIXED style) from
the start, so a shorter reading phase costs no accuracy: the waste HRPO's streaming advantage (AdaSR
eq. 8, A^s) is meant to remove. The verbosity is drawn per trace, not per problem, so one prompt's
samples differ in reading-phase length; the wasteful forms are the majority (4 in 5 traces), so the
start policy's greedy reading phase is wasteful too. Every thought stays under the streaming
segment cap of bench/adasr.py (32 tokens; tests/search/test_stream.py checks it).

``loom train-stream`` starts from the search checkpoint (``--init``) and trains one phase on these
streaming traces mixed with the search model's plain Countdown traces and the tiny model's arithmetic
(so the other skills are kept). docs/models.md describes it; docs/benchmarks/adasr.md measures it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from loom.formats import DEFAULT_MARKERS, Markers
from zoo.recipe import CardText, FinetuneConfig, on_device, reproduce
from zoo.search.tasks import search_problems, training_problems
from zoo.search.traces import FIXED, boxed, expression_from_steps, search_lines
from zoo.search.traces import plain_trace as search_plain_trace
from zoo.tiny.evaluate import Budgets, FormatResult, eval_plain, eval_stream
from zoo.tiny.tasks import HELDOUT_SEED, Problem, _apply
from zoo.tiny.traces import Piece, stream_connector
from zoo.tiny.traces import _stream_units as concise_units
from zoo.tiny.traces import plain_trace as arith_plain_trace
from zoo.tiny.traces import stream_trace as arith_stream_trace

# P(w) for w = 0..3 extras per thought: the concise form in 1 trace of 5
VERBOSITY = (0.2, 0.3, 0.3, 0.2)
OPS = "+-*"


def _pair_ops(nums: Sequence[int], rng: random.Random) -> list[str]:
    """Partial arithmetic on pairs of the numbers (pre-solving while reading), drawn."""
    out = []
    for i, j in ((0, 1), (0, 2), (1, 2)):
        x, y = max(nums[i], nums[j]), min(nums[i], nums[j])
        op = rng.choice(OPS)
        out.append(f"{x}{op}{y}={_apply(x, op, y)}")
    rng.shuffle(out)
    return out


def _guess(nums: Sequence[int], target: int, rng: random.Random) -> str:
    """An early guess: the numbers in their order with drawn operators, evaluated left to right."""
    ops = [rng.choice(OPS) for _ in range(len(nums) - 1)]
    value = nums[0]
    text = str(nums[0])
    for op, n in zip(ops, nums[1:], strict=True):
        value = value + n if op == "+" else value - n if op == "-" else value * n
        text += f"{op}{n}"
    return f"guess {text}={value} {'yes' if value == target else 'no'}"


def _left(target: int, n: int) -> str:
    """What the target leaves after one number (the larger minus the smaller)."""
    return f"{target}-{n}={target - n}" if target >= n else f"{n}-{target}={n - target}"


def wasteful_units(problem: Problem, rng: random.Random) -> list[tuple[str, str | None]]:
    """(sentence, thought or None for skip): the sentences of ``zoo.tiny.traces.stream_sentences``
    (the same revealed text as every model's) with thoughts of a drawn verbosity."""
    units = concise_units(problem, random.Random(problem.key))
    w = rng.choices(range(len(VERBOSITY)), weights=VERBOSITY)[0]
    nums, target = list(problem.numbers), problem.target
    shown = ", ".join(str(n) for n in nums[:-1]) + f" and {nums[-1]}"
    out: list[tuple[str, str | None]] = []
    for sentence, thought in units:
        if thought is None:  # a distractor: skipped, or restated
            restated = sentence.rstrip(".").lower() + " so skip"
            out.append((sentence, restated if w > 0 and rng.random() < 0.7 else None))
            continue
        numbers = thought.startswith("n=")
        restate = f"we have {shown} so" if numbers else f"make {target} from them so"
        extras = _pair_ops(nums, rng)[:2] if numbers else [_guess(nums, target, rng), _left(target, nums[-1])]
        pool = ["restate", *extras]
        picked = rng.sample(pool, min(w, len(pool)))
        head = [restate] if "restate" in picked else []
        tail = [e for e in extras if e in picked]
        if head:  # a restated sentence keeps one extra: every thought stays under 32 tokens
            tail = tail[:1]
        out.append((sentence, " ".join([*head, thought, *tail])))
    return out


def stream_trace(problem: Problem, variant: int = 0, markers: Markers = DEFAULT_MARKERS) -> list[Piece]:
    """A streaming trace with a wasteful reading phase (Countdown), then the search model's deep
    phase; arithmetic keeps the tiny model's concise trace."""
    if problem.kind == "arith":
        return arith_stream_trace(problem, markers)
    rng = random.Random(f"{problem.key}/stream/{variant}")
    pieces = [Piece("[stream]", False)]
    for sentence, thought in wasteful_units(problem, rng):
        pieces.append(Piece(f" {sentence}{markers.sentence_end}", False))
        body = f" {thought}" if thought else markers.skip
        pieces.append(Piece(body + markers.thought_end, True))
    pieces.append(Piece(stream_connector(markers), False))
    lines, solution = search_lines(problem, rng, FIXED)
    deep = "\n".join(lines[1:])
    answer = boxed(expression_from_steps(solution))
    pieces.append(Piece(f" {deep}{markers.reasoning_end} {answer}{markers.answer_end}", True))
    return pieces


# ------------------------------------------------------------------------------------------- training

# the search model's greedy limits, with room for a wasteful thought
BUDGETS = Budgets(plain=400, reflect=480, thought=40, final=400, spawn_head=160, child=200, join_answer=40)


@dataclass
class StreamTrainConfig(FinetuneConfig):
    stream_variants: int = 2  # wasteful streaming traces per Countdown problem


def build_sequences(problems: dict[str, list[Problem]], variants: int) -> list[list[Piece]]:
    """Wasteful streaming traces of Countdown (``variants`` per problem) and arithmetic, and plain
    Countdown search and arithmetic (kept from the search model's mix)."""
    seqs: list[list[Piece]] = []
    for p in problems["countdown"]:
        seqs.extend(stream_trace(p, v) for v in range(variants))
        seqs.append(search_plain_trace(p, 0, FIXED))
    for p in problems["arith"]:
        seqs.append(arith_stream_trace(p))
        seqs.append(arith_plain_trace(p))
    return seqs


def sequences(cfg: StreamTrainConfig) -> list[list[Piece]]:
    """The row's trace builder (zoo/recipes.py): :func:`build_sequences` of the training problems."""
    return build_sequences(training_problems(cfg.train_problems, cfg.seed), cfg.stream_variants)


def facts(cfg: StreamTrainConfig, seqs: list[list[Piece]], data: object, model: object) -> dict:
    return {"verbosity": list(VERBOSITY)}


def heldout(model, tok, n: int) -> dict[str, FormatResult]:  # type: ignore[no-untyped-def]
    """Greedy held-out accuracy in the formats it was trained on (the search model's held-out set)."""
    cd = search_problems("countdown", n, HELDOUT_SEED, "test")
    return {"plain": eval_plain(model, tok, cd, b=BUDGETS), "stream": eval_stream(model, tok, cd, BUDGETS)}


# MODEL_CARD.md's paragraph, before the command that reproduces it
ABOUT = (
    "The search model (zoo/search/checkpoint) fine-tuned by `loom train-stream` on streaming\n"
    "traces whose reading phase is wasteful at a drawn verbosity (zoo/search/stream.py), mixed\n"
    "with plain Countdown search and arithmetic. Reproduce with"
)


def card_text(card: dict) -> CardText:
    data = [f"- {card['sequences']} sequences; verbosity P(w=0..3) {card['verbosity']}"]
    return CardText(
        "Loom stream model", ABOUT, reproduce("stream", card, "seed", "steps", "lr"), data, on_device(card)
    )
