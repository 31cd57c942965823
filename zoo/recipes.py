"""The recipe table: the built-in models as rows of the one recipe (zoo/recipe.py), so that
``loom train-<name>`` is the same skeleton for each (data -> fit -> finish -> checkpoint) and a new
model is one row plus its module (its trace builder, held-out evaluation and card; docs/models.md).

A row names its module, its defaults (its config class, whose defaults are the shipped checkpoint's
command), the command's line, the model it starts from and its own flags; the checkpoint folder is
``zoo.registry``'s for the same name.
"""

from __future__ import annotations

from collections.abc import Sequence

from zoo.code import train as code
from zoo.recipe import Recipe, RowModule, TrainConfig, card_markdown
from zoo.recipe import main as run_main
from zoo.search import deep_train, judge, reflect, stream
from zoo.search import train as search
from zoo.tiny import tool
from zoo.tiny import train as tiny


def _row(name: str, module: RowModule, config: type[TrainConfig], about: str, **more: object) -> Recipe:
    line = f"reproduce the built-in {name} model ({about})"
    return Recipe(name, module, config, line, **more)  # type: ignore[arg-type]  # more: its keyword fields


PER_KIND = {"train_problems": "per kind"}
SEARCH_FLAGS = {
    **PER_KIND,
    "fixed_steps": "steps of each round of phase 2",
    "fixed_rounds": "rounds of phase 2",
}
SEARCH_INIT = "a checkpoint of earlier phases: run --fixed-rounds more from it"
MISTAKE = {**PER_KIND, "mistake": "P(a caught mistake) per trace"}
JUDGE = {
    **PER_KIND,
    "policy_problems": "Countdown problems whose search-model samples join the outcome data",
    "policy_samples": "samples per such problem",
    "policy_temperature": "their sampling temperature",
    "policy_repeat": "times each sample's sequence appears",
}

# fmt: off
RECIPES: dict[str, Recipe] = {r.name: r for r in (
    _row("tiny", tiny, TrainConfig, "all formats, from scratch", gpu=False),
    _row("search", search, search.SearchTrainConfig, "Countdown search traces, from scratch",
         model=search.MODEL, flags=SEARCH_FLAGS, init_help=SEARCH_INIT, train=search.train),
    _row("stream", stream, stream.StreamTrainConfig, "wasteful reading", base="search", flags=PER_KIND),
    _row("reflect", reflect, reflect.ReflectTrainConfig, "reflecting", base="search", flags=MISTAKE),
    _row("deep", deep_train, deep_train.DeepTrainConfig, "spawn/join", base="search", flags=deep_train.FLAGS),
    _row("judge", judge, judge.JudgeTrainConfig, "grading answers and steps", base="search", flags=JUDGE),
    _row("code", code, code.CodeTrainConfig, "Python functions, from scratch", model=code.MODEL, gpu=False),
    _row("tool", tool, tool.ToolTrainConfig, "calculator calls in agent mode", base="tiny", gpu=False),
)}
# fmt: on


def model_card(name: str, card: dict) -> str:
    """The MODEL_CARD.md the row ``name`` writes for ``card`` (card.json's content)."""
    module: RowModule = RECIPES[name].module
    return card_markdown(card, module.card_text(card))


def main(name: str, argv: Sequence[str] | None = None) -> int:
    """``loom train-<name>``."""
    return run_main(RECIPES[name], argv)
