"""The tiny model's chat template: shipped in the checkpoint (loadable offline), the same one its
tokenizer is trained with, and rendering a chat exactly as the model's training prompts."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from rollout_svc.engines.torch import resolve_model_path
from zoo.tiny.tasks import tiny_problems
from zoo.tiny.tokenizer import CHAT_TEMPLATE, EOS
from zoo.tiny.traces import plain_prompt, reflect_prompt, spawn_prompt


@pytest.fixture(scope="module")
def tokenizer() -> object:
    return AutoTokenizer.from_pretrained(str(resolve_model_path("tiny")), local_files_only=True)


def test_the_checkpoint_ships_the_template_its_tokenizer_is_trained_with(tokenizer: object) -> None:
    assert tokenizer.chat_template == CHAT_TEMPLATE  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("kind", "prompt"), [("arith", plain_prompt), ("arith", reflect_prompt), ("countdown", spawn_prompt)]
)
def test_a_user_message_renders_the_training_prompt(tokenizer: object, kind: str, prompt: object) -> None:
    for problem in tiny_problems(kind, 5, seed=0):  # type: ignore[arg-type]
        text = prompt(problem)  # type: ignore[operator]
        for content in (text, text.rstrip("\n")):  # the newline is added when missing
            rendered = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
            assert rendered == text


def test_an_assistant_turn_ends_with_eos(tokenizer: object) -> None:
    chat = [
        {"role": "user", "content": "[plain] Compute 1+1."},
        {"role": "assistant", "content": "<think> 1+1+0=2 r2 </think> \\boxed{2}"},
        {"role": "user", "content": "[plain] Compute 2+2."},
    ]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)  # type: ignore[attr-defined]
    assert (
        rendered
        == f"[plain] Compute 1+1.\n<think> 1+1+0=2 r2 </think> \\boxed{{2}}{EOS}[plain] Compute 2+2.\n"
    )
