"""docs/architecture.md matches the code file for file (issue 36): every module of the shared core, the
services and the launcher is named there by its path, every package by its folder, and every path the
document names exists. A new module without a line in the document, or a line left behind by a moved
one, fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "loom",
    "zoo",
    "gateway",
    "rollout_svc",
    "reward_svc",
    "reflect_svc",
    "learner",
    "sandbox_svc",
    "env_svc",
    "launch",
)
DOC = ROOT / "docs" / "architecture.md"
PATH = re.compile(r"`((?:" + "|".join(PACKAGES) + r")/(?:[\w/]*(?:\.py|/))?)`")


def _named() -> set[str]:
    return set(PATH.findall(DOC.read_text()))


def _modules() -> list[str]:
    return [
        p.relative_to(ROOT).as_posix()
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("*.py"))
        if p.name != "__init__.py"
    ]


def _packages() -> list[str]:
    return [
        p.parent.relative_to(ROOT).as_posix() + "/"
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("__init__.py"))
    ]


def test_every_module_is_named_in_the_architecture_document() -> None:
    named = _named()
    assert len(_modules()) > 100  # the walk found the code
    assert [m for m in _modules() if m not in named] == []


def test_every_package_is_named_in_the_architecture_document() -> None:
    named = _named()
    assert [p for p in _packages() if p not in named] == []


def test_every_path_the_document_names_exists() -> None:
    named = _named()
    assert named  # the pattern reads the document
    assert sorted(p for p in named if not (ROOT / p).exists()) == []
