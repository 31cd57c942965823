"""The judge model's data (zoo/search/judge.py, docs/models.md "The judge model"): its prompts are the
judge reward's own rendering byte for byte, its labels are the exact verifier's, right and wrong come
about half each, every target is one token, and the shipped checkpoint agrees with the exact
verifier on held-out Countdown answers (the one skill it has learned so far)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from reward_svc.judge import TEMPLATES, build_prompt
from zoo.registry import resolve_model_path
from zoo.search import judge
from zoo.search.tasks import search_problems
from zoo.tiny import load_model, load_tokenizer
from zoo.tiny.tasks import HELDOUT_SEED


def _problems(n: int) -> list:
    return search_problems("countdown", n, 3, "train") + search_problems("arith", n, 3, "train")


def test_outcome_prompts_are_the_judge_components_rendering() -> None:
    rng = random.Random(0)
    for i, p in enumerate(_problems(30)):
        right = judge.completion_of(p, i % 2)
        wrong = (judge.wrong_countdown if p.kind == "countdown" else judge.wrong_arith)(p, right, rng)
        question, ref = f"[plain] {p.text}\n", judge.reference_of(p)
        for text in (right, wrong):
            ours = judge.outcome_prompt(question, text, ref)
            assert ours == build_prompt(TEMPLATES["arith"], question, text, ref, 8000)


def test_process_prompt_is_the_verbatim_template() -> None:
    got = judge.process_prompt("[plain] Compute 1+2.\n", ["<think> 1+2+0=3 r3", "</think> \\boxed{3}"])
    assert got == (
        "Question:\n[plain] Compute 1+2.\n\n\nSteps so far:\n<answer>\n<think> 1+2+0=3 r3\n"
        "</think> \\boxed{3}\n</answer>\n\nIs the last step correct? Reply yes or no.\nVerdict:"
    )


def test_labels_are_the_exact_verifiers_and_balanced() -> None:
    exs = [ex for i, p in enumerate(_problems(60)) for ex in judge.problem_examples(p, i % 2)]
    counts = Counter((e.skill, e.right) for e in exs)
    for skill in ("outcome", "process"):
        yes, no = counts[(skill, True)], counts[(skill, False)]
        assert 0.4 <= yes / (yes + no) <= 0.6, counts
    rng = random.Random(1)
    for p in _problems(40):  # a wrong answer is one the exact verifier rejects, a right one it accepts
        right = judge.completion_of(p, 0)
        assert judge.exact_right(p, right)
        wrong = (judge.wrong_countdown if p.kind == "countdown" else judge.wrong_arith)(p, right, rng)
        assert wrong != right


def test_targets_are_one_token_of_the_search_tokenizer() -> None:
    tok = load_tokenizer(resolve_model_path("search"))
    for word in (judge.YES, judge.NO):
        assert len(tok(word, add_special_tokens=False)["input_ids"]) == 1
    prompt = judge.problem_examples(search_problems("countdown", 1, 3, "train")[0], 0)[0].prompt
    assert tok.decode(tok(prompt, add_special_tokens=False)["input_ids"]) == prompt  # encodable


@pytest.mark.skipif(
    not (resolve_model_path("judge") / "model.safetensors").is_file(), reason="judge checkpoint not built"
)
def test_the_shipped_judge_agrees_with_the_exact_verifier_on_held_out_countdown_answers() -> None:
    """The skill the shipped checkpoint has learned (0.750 of 40 on its card, 17 of 20 here); its
    arithmetic and process-step verdicts are still at chance (docs/models.md "The judge model")."""
    path = resolve_model_path("judge")
    tok, model = load_tokenizer(path), load_model(path)
    exs = judge.heldout_examples(20)["outcome_countdown"]
    assert search_problems("countdown", 1, HELDOUT_SEED, "test")  # the held-out split exists
    scores = judge.p_yes(model, tok, [e.prompt for e in exs])
    agree = sum((s > 0.5) == e.right for s, e in zip(scores, exs, strict=True))
    assert agree / len(exs) >= 0.7, agree


def test_policy_examples_are_the_search_models_own_samples_labelled_by_the_exact_verifier() -> None:
    """``--policy-problems``: each example is one sampled answer of the search model, rendered as the
    judge component renders it, its label the exact verifier's; the same seed draws the same answers."""
    problems = search_problems("countdown", 6, 50_000, "train")
    drawn = judge.sampled_completions(problems, 2, 1.0, seed=5)
    assert drawn == judge.sampled_completions(problems, 2, 1.0, seed=5)
    assert [len(d) for d in drawn] == [2] * 6
    exs = judge.policy_examples(problems, 2, 1.0, seed=5)
    group_prompt = [f"[plain] {p.text}\n" for p in problems for _ in range(2)]
    answers = [t for d in drawn for t in d]
    for ex, q, text, p in zip(
        exs, group_prompt, answers, [p for p in problems for _ in range(2)], strict=True
    ):
        rendered = build_prompt(TEMPLATES["arith"], q, text, judge.reference_of(p), 8000)
        assert ex.prompt == rendered and ex.skill == "outcome" and ex.kind == "countdown"
        assert ex.right == judge.exact_right(p, text)
    assert len({ex.right for ex in exs}) == 2, [ex.right for ex in exs]  # its right and wrong answers
