"""The recipe table (zoo/recipes.py) makes every built-in model (zoo/registry.py) with the one recipe
(zoo/recipe.py): each name has its row and its ``loom train-<name>``, each checked-in MODEL_CARD.md
is what its row writes from its card.json, and the command a card states rebuilds the configuration
its card.json records (docs/models.md: the shipped checkpoints are reproducible by their command)."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import asdict

import pytest

from launch.cli import COMMANDS, TRAIN
from zoo.recipe import SHARED, parser
from zoo.recipes import RECIPES, model_card
from zoo.registry import BUILTIN, resolve_model_path


def test_every_built_in_model_has_a_row_and_a_command() -> None:
    assert (
        set(RECIPES)
        == set(BUILTIN)
        == {"tiny", "search", "stream", "reflect", "deep", "judge", "code", "tool"}
    )
    assert {command: name for command, name in TRAIN.items()} == {f"train-{n}": n for n in BUILTIN}
    assert all(COMMANDS[f"train-{n}"][0] == "zoo.recipes:main" for n in BUILTIN)
    # the fine-tunes start from the search model (tool: from tiny); tiny, search and code from scratch
    assert {n: r.base for n, r in RECIPES.items()} == {
        "tiny": None,
        "search": None,
        "stream": "search",
        "reflect": "search",
        "deep": "search",
        "judge": "search",
        "code": None,
        "tool": "tiny",
    }


@pytest.mark.parametrize("name", BUILTIN)
def test_the_checked_in_card_is_written_from_card_json(name: str) -> None:
    checkpoint = resolve_model_path(name)
    card = json.loads((checkpoint / "card.json").read_text())
    assert model_card(name, card) == (checkpoint / "MODEL_CARD.md").read_text()


@pytest.mark.parametrize("name", BUILTIN)
def test_no_flags_are_the_rows_defaults(name: str) -> None:
    recipe = RECIPES[name]
    args = parser(recipe).parse_args([])
    given = {field: getattr(args, field) for field in (*SHARED, *recipe.flags)}
    assert recipe.config(**given) == recipe.config()
    assert args.out is None and args.no_eval is False
    takes_init = recipe.base is not None or recipe.init_help is not None  # --init: the base, or none
    assert hasattr(args, "init") == takes_init and getattr(args, "init", None) is None


@pytest.mark.parametrize("name", BUILTIN)
def test_the_command_a_card_states_rebuilds_its_configuration(name: str) -> None:
    checkpoint = resolve_model_path(name)
    card = json.loads((checkpoint / "card.json").read_text())
    stated = re.search(rf"`loom train-{name}([^`]*)`", (checkpoint / "MODEL_CARD.md").read_text())
    assert stated is not None
    recipe = RECIPES[name]
    args = parser(recipe).parse_args(shlex.split(stated.group(1)))
    cfg = recipe.config(**{field: getattr(args, field) for field in (*SHARED, *recipe.flags)})
    assert {k: v for k, v in asdict(cfg).items() if k in card["config"]} == card["config"]
