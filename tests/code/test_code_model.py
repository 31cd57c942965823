"""The built-in code model (zoo/code, its row ``code`` of zoo/recipes.py): a short run of its recipe
writes a checkpoint whose card holds the held-out code reward measured in the real sandbox, and the
shipped checkpoint solves part of the held-out problems, not all (room for RL)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loom.clients.sandbox import SandboxClient
from loom.runtime import configure_process
from tests.sandbox.conftest import sandbox_url  # noqa: F401  (the fixture)
from zoo.code import CODE_CHECKPOINT_DIR, HELDOUT_SEED, code_problems
from zoo.code.evaluate import evaluate
from zoo.code.train import CodeTrainConfig
from zoo.recipe import heldout_row, train
from zoo.recipes import RECIPES
from zoo.tiny import load_model, load_tokenizer


@pytest.fixture
def sandbox_port(sandbox_url: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The recipe's evaluation reaches the sandbox where the settings say (``LOOM_SANDBOX_PORT``)."""
    from loom.contracts.settings import get_settings

    monkeypatch.setenv("LOOM_SANDBOX_PORT", sandbox_url.rsplit(":", 1)[1])
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_a_short_run_writes_a_card_with_the_sandboxed_held_out_rows(
    tmp_path: Path, sandbox_port: None
) -> None:
    configure_process()
    cfg = CodeTrainConfig(seed=3, steps=2, batch_size=4, train_problems=40, eval_problems=3)
    card = train(RECIPES["code"], cfg, tmp_path, progress=False)
    saved = json.loads((tmp_path / "card.json").read_text())
    assert set(saved["heldout"]) == {"code_all", "code_pass"}
    assert saved["heldout"]["code_all"]["total"] == 3 and saved["heldout"]["code_pass"]["total"] == 12
    assert len(card["losses"]) == 2 and (tmp_path / "model.safetensors").is_file()
    assert "| code_all |" in (tmp_path / "MODEL_CARD.md").read_text()


@pytest.mark.slow
def test_the_shipped_model_solves_part_of_the_held_out_problems_as_its_card_says(sandbox_url: str) -> None:  # noqa: F811
    configure_process()
    card = json.loads((CODE_CHECKPOINT_DIR / "card.json").read_text())
    tok, model = load_tokenizer(CODE_CHECKPOINT_DIR), load_model(CODE_CHECKPOINT_DIR)
    problems = code_problems(card["config"]["eval_problems"], seed=HELDOUT_SEED, split="test")
    rows = evaluate(model, tok, problems, SandboxClient(sandbox_url))
    solved, tests = rows["code_all"], rows["code_pass"]
    assert 0 < solved.correct < solved.total  # part, not all: room for RL
    assert solved.correct * 4 <= tests.correct < tests.total
    assert {k: heldout_row(r) for k, r in rows.items()} == card["heldout"]  # the card's numbers, re-measured
