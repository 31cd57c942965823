"""Loom's built-in judge, ``judge``: the search model fine-tuned to answer whether an arithmetic or
Countdown answer is right (the ``judge`` reward's ``arith`` template) and whether the last step of a
partial trace is right (the process-reward template), one model, two prompts, a one-token verdict
(`` yes`` / `` no``) then the end (docs/models.md "The judge model").

Why a trained judge: the ``judge`` reward component (docs/interop-reward.md "Judge rewards") needs a
judge that grades, so that the CPU tests and the benches exercise its real path (``loom engine
--model judge``, the vLLM CPU build) and measure agreement with the exact verifier (loom/exact.py).

The data, per training problem, labelled by the exact verifier (never by construction alone):

- outcome: the search model's own trace (its fixed or a drawn move order), right, or made wrong the
  ways a policy goes wrong: a number or an operator of the boxed expression changed, an expression
  that misses a number, a failed move claimed as a finish, a failed move boxed, a trace cut before
  its answer or a malformed box; arithmetic: a boxed value off by a carry slip, the trace's last
  ``r`` line with it half the time;
- process: a prefix of the trace's lines whose last line is the trace's own (right) or has one
  number changed or its verdict flipped (wrong: every number of a line follows from the question
  and the lines before it).

The prompts are the reward component's own rendering (reward_svc/judge.py ``build_prompt``, which
tests/search/test_judge.py checks byte for byte); the service is not imported here (the walls,
docs/architecture.md).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

import torch

from loom.answers import last_boxed
from loom.contracts.rewards import ARITH_JUDGE_TEMPLATE
from loom.exact import check_arithmetic, check_countdown
from loom.prm import steps_prompt
from zoo.recipe import CardText, FinetuneConfig, on_device, reproduce
from zoo.search.tasks import search_problems, training_problems
from zoo.search.traces import FIXED, Style, expression_from_steps, finish, moves, plain_trace, search_line
from zoo.tiny.evaluate import FormatResult
from zoo.tiny.tasks import HELDOUT_SEED, Problem, _apply
from zoo.tiny.traces import Piece

YES, NO = " yes", " no"  # one token each in the search model's vocabulary
SHUFFLED = Style(shuffle=True, echo_target=True)  # a drawn move order, the target echoed
_NUM = re.compile(r"\d+")
_PLACEHOLDER = re.compile(r"\{(question|answer|reference|steps)\}")


def fill(template: str, values: dict[str, str]) -> str:
    """The placeholders filled in one pass (reward_svc/judge.py's rule: a value's braces stay text)."""
    return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), template)


def outcome_prompt(question: str, answer: str, reference: str) -> str:
    """The ``arith`` template as the judge component renders it (answer tags never occur here)."""
    block = f"<answer>\n{answer}\n</answer>"
    return fill(ARITH_JUDGE_TEMPLATE, {"question": question, "answer": block, "reference": reference})


def process_prompt(question: str, steps: list[str]) -> str:
    """The ``process`` reward's prompt for a step prefix, written by the core's one function
    (loom/prm.py), so the judge learns the very text the reward service sends."""
    return steps_prompt("steps", question, steps)


def reference_of(problem: Problem) -> str:
    """The label the gateway's datasets give (bench/rl_loop.py ``countdown_label``)."""
    if problem.kind == "countdown":
        return json.dumps({"numbers": list(problem.numbers), "target": problem.target})
    return problem.gold


def exact_right(problem: Problem, completion: str) -> bool:
    """The exact verifier's verdict on a completion's last boxed answer (reward_svc/accuracy.py's rule)."""
    boxed = last_boxed(completion)
    if boxed is None:
        return False
    if problem.kind == "arith":
        return check_arithmetic(boxed, problem.gold)
    return check_countdown(boxed, list(problem.numbers), problem.target)


# ------------------------------------------------------------------------------------- wrong answers


def _change_number(text: str, rng: random.Random) -> str:
    """One number of ``text`` replaced by a near one (a slip), the text otherwise kept."""
    spans = [m.span() for m in _NUM.finditer(text)]
    if not spans:
        return text + "1"
    a, b = rng.choice(spans)
    n = int(text[a:b])
    new = max(0, n + rng.choice([-3, -2, -1, 1, 2, 3, 10, -10]))
    new = new if new != n else n + 1
    return text[:a] + str(new) + text[b:]


def _rebox(completion: str, expr: str) -> str:
    head = completion.rsplit("\\boxed{", 1)[0]
    return head + "\\boxed{" + expr + "}"


def wrong_countdown(problem: Problem, completion: str, rng: random.Random) -> str:
    """A realistic wrong completion of a Countdown problem (the module's list)."""
    expr = last_boxed(completion) or problem.gold
    kind = rng.randrange(6)
    if kind == 0:
        return _rebox(completion, _change_number(expr, rng))
    if kind == 1:
        ops = [i for i, c in enumerate(expr) if c in "+-*/"]
        i = rng.choice(ops)
        return _rebox(completion, expr[:i] + rng.choice([o for o in "+-*" if o != expr[i]]) + expr[i + 1 :])
    if kind == 2:  # misses a number: a part of the expression, or the last step's two numbers
        inner = re.findall(r"\(([^()]+)\)", expr)
        last = completion.rsplit("yes ", 1)[-1].split("=")[0] if "yes " in completion else None
        return _rebox(completion, rng.choice([*inner, last] if last else inner or [expr[:-2]]))
    failed = [m for m in moves(problem.numbers) if finish(problem.target, m.rest) is None]
    m = rng.choice(failed)
    a, b = m.rest
    if kind == 3:  # a failed move claimed as a finish, boxed
        op = rng.choice([o for o in "+-*" if _apply(a, o, b) != problem.target])
        head = completion.split("</think>")[0].rstrip("\n")
        last = f"{a}{op}{b}={problem.target}"
        claim = search_line(problem.target, m, FIXED).removesuffix(" no") + f" yes {last}"
        return f"{head}\n{claim}\n</think> \\boxed{{{expression_from_steps([m.step, last])}}}"
    if kind == 4:  # a failed move boxed with its own value
        op = rng.choice("+-*")
        return _rebox(completion, expression_from_steps([m.step, f"{a}{op}{b}={_apply(a, op, b)}"]))
    lines = completion.split("\n")
    cut = "\n".join(lines[: rng.randint(1, max(1, len(lines) - 1))])
    return rng.choice([cut, _rebox(completion, expr[: max(1, len(expr) - 2)]), _rebox(completion, "")])


def wrong_arith(problem: Problem, completion: str, rng: random.Random) -> str:
    """A wrong arithmetic completion: the boxed value off by a slip (the last ``r`` line too, half
    the time), or the trace cut before its answer."""
    if rng.random() < 0.15:
        return completion.split("</think>")[0].rstrip()
    gold = int(problem.gold)
    value = max(0, gold + rng.choice([-100, -10, -2, -1, 1, 2, 10, 100]))
    value = value if value != gold else gold + 1
    out = _rebox(completion, str(value))
    if rng.random() < 0.5:
        out = out.replace(f"r{gold} </think>", f"r{value} </think>")
    return out


# ---------------------------------------------------------------------------------- process steps


def wrong_step(problem: Problem, step: str, rng: random.Random) -> str:
    """The step with one number changed, or (a search line) its verdict flipped."""
    if problem.kind == "countdown" and step.endswith(" no") and rng.random() < 0.4:
        m = re.match(r"(\d+)[-+*/](\d+)=\d+ \[(\d+),(\d+)\]", step)
        if m:
            a, b = int(m.group(3)), int(m.group(4))
            op = rng.choice([o for o in "+-*" if _apply(a, o, b) != problem.target])
            return step.removesuffix(" no") + f" yes {a}{op}{b}={problem.target}"
    if problem.kind == "countdown" and " yes " in step and rng.random() < 0.4:
        return step.split(" yes ")[0] + " no"
    return _change_number(step, rng)


def completion_of(problem: Problem, variant: int) -> str:
    """The search model's own trace: the fixed move order (variant 0) or a drawn one (arithmetic: its one)."""
    style = FIXED if variant == 0 else SHUFFLED
    return plain_trace(problem, variant, style)[1].text


@dataclass(frozen=True)
class Example:
    prompt: str
    right: bool  # the exact verifier's (outcome) or the construction's (process) label
    skill: str  # "outcome" | "process"
    kind: str  # "countdown" | "arith"


def outcome_examples(problem: Problem, rng: random.Random, variant: int) -> list[Example]:
    """One right and one wrong answer to ``problem``, labelled by the exact verifier."""
    right = completion_of(problem, variant)
    wrong_of = wrong_countdown if problem.kind == "countdown" else wrong_arith
    question, ref = f"[plain] {problem.text}\n", reference_of(problem)
    out = []
    for text in (right, wrong_of(problem, right, rng)):
        prompt = outcome_prompt(question, text, ref)
        out.append(Example(prompt, exact_right(problem, text), "outcome", problem.kind))
    return out


def process_examples(problem: Problem, rng: random.Random, variant: int) -> list[Example]:
    """Two prefixes of the trace's lines: the last step the trace's own, then one made wrong."""
    lines = completion_of(problem, variant).split("\n")
    question = f"[plain] {problem.text}\n"
    out = []
    for right in (True, False):
        k = rng.randint(1, len(lines))
        last = lines[k - 1] if right else wrong_step(problem, lines[k - 1], rng)
        if not right and last == lines[k - 1]:
            continue
        ok = right or (k == len(lines) and problem.kind == "countdown" and exact_right(problem, last))
        out.append(Example(process_prompt(question, [*lines[: k - 1], last]), ok, "process", problem.kind))
    return out


@torch.no_grad()
def sampled_completions(
    problems: list[Problem], samples: int, temperature: float, seed: int, max_new_tokens: int = 256
) -> list[list[str]]:
    """The search model's own answers to ``problems`` (``[plain] {question}``), ``samples`` each, drawn
    at ``temperature`` (no top-k or top-p): the policy's real mistakes, which no constructed wrong
    kind covers (a failed move claimed as the target's, wrong arithmetic in the claimed line)."""
    from zoo.registry import resolve_model_path
    from zoo.tiny import load_model, load_tokenizer
    from zoo.tiny.evaluate import generate_batch

    path = resolve_model_path("search")
    tok, model = load_tokenizer(path), load_model(path)
    model.eval()
    torch.manual_seed(seed)
    prompts = [f"[plain] {p.text}\n" for p in problems for _ in range(samples)]
    # 512 rows a call: generate's per-token cost is mostly overhead at this model's size
    texts = generate_batch(model, tok, prompts, [], max_new_tokens, batch_size=512, temperature=temperature)
    return [texts[i * samples : (i + 1) * samples] for i in range(len(problems))]


def policy_examples(problems: list[Problem], samples: int, temperature: float, seed: int) -> list[Example]:
    """Outcome examples of the search model's sampled answers, each labelled by the exact verifier."""
    drawn = sampled_completions(problems, samples, temperature, seed)
    return [
        Example(
            outcome_prompt(f"[plain] {p.text}\n", text, reference_of(p)),
            exact_right(p, text),
            "outcome",
            p.kind,
        )
        for p, texts in zip(problems, drawn, strict=True)
        for text in texts
    ]


def problem_examples(problem: Problem, variant: int) -> list[Example]:
    """Both skills' examples of one problem (a seed of its own: the same problem, the same examples)."""
    rng = random.Random(f"{problem.key}/judge/{variant}")
    return outcome_examples(problem, rng, variant) + process_examples(problem, rng, variant)


def as_sequence(ex: Example) -> list[Piece]:
    return [Piece(ex.prompt, False), Piece(YES if ex.right else NO, True)]


# ------------------------------------------------------------------------------------------- training


@dataclass
class JudgeTrainConfig(FinetuneConfig):
    steps: int = 360
    lr: float = 1e-3
    train_problems: int = 3000  # per kind
    variants: int = 2  # traces per problem: the fixed move order, then drawn ones
    policy_problems: int = 0  # Countdown training problems whose search-model samples join the outcome data
    policy_samples: int = 4  # samples per such problem
    policy_temperature: float = 1.0
    policy_repeat: int = 1  # times each sampled answer's sequence appears in the data


def build_sequences(problems: dict[str, list[Problem]], variants: int) -> list[list[Piece]]:
    """Both skills' examples of every problem, ``variants`` traces each (module docstring)."""
    return [
        as_sequence(ex)
        for kind in ("countdown", "arith")
        for p in problems[kind]
        for v in range(variants if kind == "countdown" else 1)
        for ex in problem_examples(p, v)
    ]


def sequences(cfg: JudgeTrainConfig) -> list[list[Piece]]:
    """The row's trace builder (zoo/recipes.py): :func:`build_sequences` of the training problems, and
    with ``policy_problems`` the search model's own sampled answers to other training problems."""
    seqs = build_sequences(training_problems(cfg.train_problems, cfg.seed), cfg.variants)
    if cfg.policy_problems > 0:
        problems = search_problems("countdown", cfg.policy_problems, 50_000 + cfg.seed, "train")
        exs = policy_examples(problems, cfg.policy_samples, cfg.policy_temperature, cfg.seed)
        seqs += [as_sequence(ex) for ex in exs for _ in range(cfg.policy_repeat)]
    return seqs


def facts(cfg: JudgeTrainConfig, seqs: list[list[Piece]], data: object, model: object) -> dict:
    yes = sum(s[1].text == YES for s in seqs)
    return {"yes_fraction": round(yes / max(1, len(seqs)), 4)}


@torch.no_grad()
def p_yes(model, tok, prompts: list[str]) -> list[float]:  # type: ignore[no-untyped-def]
    """P(yes) over {yes, no} of the first token after each prompt (the ``logprob`` mode's reading)."""
    yes, no = (tok(w, add_special_tokens=False)["input_ids"][0] for w in (YES, NO))
    model.eval()
    out = []
    for prompt in prompts:
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        logits = model(input_ids=ids.to(model.device)).logits[0, -1]
        pair = torch.stack([logits[yes], logits[no]]).softmax(0)
        out.append(float(pair[0]))
    return out


def heldout_examples(n: int) -> dict[str, list[Example]]:
    """``n`` held-out examples per skill and kind, right and wrong alternating (the search model's
    held-out problems; drawn move orders)."""
    out: dict[str, list[Example]] = {}
    for kind in ("countdown", "arith"):
        probs = search_problems(kind, n, HELDOUT_SEED, "test")  # type: ignore[arg-type]
        exs = [ex for i, p in enumerate(probs) for ex in problem_examples(p, 1 + i)]
        for skill in ("outcome", "process"):
            out[f"{skill}_{kind}"] = [e for e in exs if e.skill == skill][:n]
    return out


def heldout(model, tok, n: int) -> dict[str, FormatResult]:  # type: ignore[no-untyped-def]
    """Held-out agreement with the exact label (``correct``: verdicts that agree, P(yes) > 0.5); with
    ``outcome_policy``, the search model's own answers to ``n`` held-out Countdown problems (two each,
    temperature 1): the answers an RL run's judge reads."""
    results = {}
    sampled = search_problems("countdown", n, HELDOUT_SEED, "test")
    examples = {**heldout_examples(n), "outcome_policy": policy_examples(sampled, 2, 1.0, HELDOUT_SEED)}
    for name, exs in examples.items():
        scores = p_yes(model, tok, [e.prompt for e in exs])
        res = FormatResult(total=len(exs), parsed=len(exs), sample=exs[0].prompt if exs else "")
        res.correct = sum((s > 0.5) == e.right for s, e in zip(scores, exs, strict=True))
        results[name] = res
    return results


# MODEL_CARD.md's paragraph, before the command that reproduces it
ABOUT = (
    "The search model (zoo/search/checkpoint) fine-tuned by `loom train-judge` to grade: whether an\n"
    "arithmetic or Countdown answer is right (the judge reward's `arith` template) and whether the\n"
    "last step of a partial trace is right (the process-reward template), one token ` yes` / ` no`\n"
    "(zoo/search/judge.py). Reproduce with"
)


def card_text(card: dict) -> CardText:
    data = [f"- {card['sequences']} sequences (outcome and process prompts), yes {card['yes_fraction']}"]
    return CardText(
        "Loom judge model",
        ABOUT,
        reproduce("judge", card, "seed", "steps", "lr"),
        data,
        on_device(card),
        heldout="Held-out agreement with the exact verifier (P(yes) > 0.5)",
    )
