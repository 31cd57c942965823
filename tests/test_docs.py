"""The documents the code cites are in the repository: every ``docs/algorithms.md §N`` in a docstring
or comment names a section heading of docs/algorithms.md, and no code cites a file outside it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "loom",
    "zoo",
    "launch",
    "gateway",
    "rollout_svc",
    "reward_svc",
    "reflect_svc",
    "learner",
    "sandbox_svc",
    "bench",
)
CITATION = re.compile(r"docs/algorithms\.md §(\d+(?:\.\d+)?)")


def _sources() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def _sections() -> set[str]:
    text = (ROOT / "docs" / "algorithms.md").read_text()
    return {m.group(1) for m in re.finditer(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", text, re.M)}


def test_every_algorithms_citation_names_a_section() -> None:
    sections = _sections()
    assert {"1.1", "2.3", "5.1"} <= sections  # the headings parse
    missing = [
        f"{path.relative_to(ROOT)}: §{m.group(1)}"
        for path in _sources()
        for m in CITATION.finditer(path.read_text())
        if m.group(1) not in sections
    ]
    assert missing == []


def test_code_cites_no_document_outside_the_repository() -> None:
    outside = re.compile(r"\b(ALGORITHMS|DESIGN|STYLE)\.md\b")
    found = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in _sources()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if outside.search(line)
    ]
    assert found == []


def test_docs_links_between_documents_resolve() -> None:
    broken = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", md.read_text()):
            if "://" in target:
                continue
            if not (md.parent / target).exists():
                broken.append(f"{md.relative_to(ROOT)} -> {target}")
    assert broken == []
