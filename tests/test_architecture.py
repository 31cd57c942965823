"""The walls between Loom's packages, checked by walking every import with ``ast``.

Rules: a service (``gateway``, ``rollout_svc``, ``reward_svc``, ``reflect_svc``, ``learner``) may import
the shared core ``loom``, the built-in models ``zoo`` and itself, never another service; ``zoo`` may
import ``loom`` and itself only; ``loom`` imports nothing of Loom's other packages (no service, not
``zoo``: the core holds no model); none imports the launcher ``launch``, which sits above them all and
may import anything. Services talk to each other over the queues and HTTP, through the contracts in
``loom`` (docs/architecture.md, the walls).

What counts as an import of module M (in every .py file of ``loom/``, ``zoo/`` and the five services):

(a) ``import M`` / ``from M import x`` at any depth: module level, inside functions, classes, ``try``
    and ``if TYPE_CHECKING:`` blocks; relative imports are resolved against the file's package.
(b) ``importlib.import_module(...)`` / ``import_module(...)`` / ``__import__(...)`` with a string
    constant, or with an f-string: its constant text before the first placeholder names the package
    (``f"rollout_svc.modes.{name}"`` imports from ``rollout_svc``). An f-string whose top-level
    package is itself a placeholder (``f"{pkg}.tasks"``) cannot be checked, so outside ``launch/`` it
    is a violation in itself: name the package in the string, or move the code to ``launch/``. A call
    with a variable (``import_module(RUN_MODES[mode])``) is not followed; the names it can take are
    caught where they are written down, by (c).
(c) A string constant that names an existing module file of Loom, alone (``"rollout_svc.modes.tree"``)
    or as a ``"module:attr"`` target (``"rollout_svc.engines.server:main"``, uvicorn's
    ``"gateway.api:app"``), and the f-string form of such a target (``f"{pkg}.api:app"``: dynamic,
    so a violation as in (b)). A dotted string that is no module file is not an import: the Celery
    task name ``"learner.train_step"`` names a task, not ``learner/train_step.py``. A bare word is not
    an import either (``"gateway"`` and ``"learner"`` are service names used as keys everywhere).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = "loom"
ZOO = "zoo"
LAUNCHER = "launch"
SERVICES = ("gateway", "rollout_svc", "reward_svc", "reflect_svc", "learner", "sandbox_svc", "env_svc")
FIRST_PARTY = (CORE, ZOO, LAUNCHER, *SERVICES)

_IDENT = r"[A-Za-z_]\w*"
_MODULE_STRING = re.compile(
    rf"^({_IDENT}(?:\.{_IDENT})+)$|^({_IDENT}(?:\.{_IDENT})*):{_IDENT}(?:\.{_IDENT})*$"
)
# an f-string with its placeholders written "{}": module path (at least one dot), optional ":attr"
_SEG = rf"(?:\{{\}}|{_IDENT})"
_FSTRING_TARGET = re.compile(rf"^({_SEG}(?:\.{_SEG})+)(?::{_SEG}(?:\.{_SEG})*)?$")
_FSTRING_MODULE_ATTR = re.compile(rf"^({_SEG}(?:\.{_SEG})*):{_SEG}(?:\.{_SEG})*$")
_IMPORT_FUNCS = {"import_module", "__import__"}
DYNAMIC = "<dynamic>"


@dataclass(frozen=True)
class Import:
    line: int
    module: str  # the dotted module named; starts with DYNAMIC when its package is computed at run time
    how: str  # "import", "importlib", "string"

    @property
    def package(self) -> str:
        return DYNAMIC if self.module.startswith(DYNAMIC) else self.module.split(".")[0]


def module_file_exists(name: str, root: Path = ROOT) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _shape(node: ast.JoinedStr) -> tuple[str, str] | None:
    """(text with each placeholder as "{}", source) of an f-string; None if a part is not plain text."""
    parts = []
    for value in node.values:
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            parts.append(value.value)
        elif isinstance(value, ast.FormattedValue):
            parts.append("{}")
        else:
            return None
    return "".join(parts), ast.unparse(node)


def _fstring_import(node: ast.JoinedStr, line: int, how: str, need_colon: bool) -> Import | None:
    shape = _shape(node)
    if shape is None:
        return None
    text, source = shape
    pattern = _FSTRING_MODULE_ATTR if need_colon else _FSTRING_TARGET
    match = pattern.match(text)
    if not match or (need_colon and "." not in match.group(1)):
        return None
    module = match.group(1)
    if module.startswith("{}"):
        return Import(line, f"{DYNAMIC} {source}", how)
    # the constant text before the first placeholder, cut to whole segments
    constant = module.split("{}")[0].rstrip(".")
    return Import(line, constant, how)


def _is_import_call(node: ast.Call) -> bool:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in _IMPORT_FUNCS


def imports_of(
    source: str, module: str, is_package: bool = False, is_module: Callable[[str], bool] = module_file_exists
) -> list[Import]:
    """Every import of ``source`` (the text of ``module``; ``is_package`` for an ``__init__.py``)."""
    tree = ast.parse(source)
    package_parts = module.split(".") if is_package else module.split(".")[:-1]
    found: list[Import] = []
    consumed: set[int] = set()  # ids of string nodes already read as an importlib argument

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(node.lineno, alias.name, "import") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            found.append(Import(node.lineno, target, "import"))
        elif isinstance(node, ast.Call) and _is_import_call(node) and node.args:
            arg = node.args[0]
            consumed.add(id(arg))
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append(Import(node.lineno, arg.value, "importlib"))
            elif isinstance(arg, ast.JoinedStr):
                consumed.update(id(v) for v in arg.values)
                hit = _fstring_import(arg, node.lineno, "importlib", need_colon=False)
                found.append(hit or Import(node.lineno, f"{DYNAMIC} {ast.unparse(arg)}", "importlib"))

    for node in ast.walk(tree):
        if id(node) in consumed:
            continue
        if isinstance(node, ast.JoinedStr):
            consumed.update(id(v) for v in node.values)
            hit = _fstring_import(node, node.lineno, "string", need_colon=True)
            if hit is not None:
                found.append(hit)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = _MODULE_STRING.match(node.value)
            if match:
                name = match.group(1) or match.group(2)
                if name.split(".")[0] in FIRST_PARTY and is_module(name):
                    found.append(Import(node.lineno, name, "string"))
    return sorted(found, key=lambda i: (i.line, i.module))


def allowed(owner: str, imp: Import) -> bool:
    """May package ``owner`` import ``imp``? (the module docstring's rules)"""
    if owner == LAUNCHER:
        return True
    target = imp.package
    if target == DYNAMIC:
        return False
    if target not in FIRST_PARTY:
        return True  # the standard library and third-party packages
    if owner == CORE:
        return target == CORE
    if owner == ZOO:
        return target in (CORE, ZOO)
    return target in (CORE, ZOO, owner)


def walked_files() -> Iterator[tuple[str, Path]]:
    for owner in (CORE, ZOO, *SERVICES):
        for path in sorted((ROOT / owner).rglob("*.py")):
            if "checkpoint" not in path.relative_to(ROOT).parts:
                yield owner, path


def violations() -> list[str]:
    out = []
    for owner, path in walked_files():
        rel = path.relative_to(ROOT)
        parts = list(rel.with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        for imp in imports_of(path.read_text(), module, is_package):
            if not allowed(owner, imp):
                out.append(f"{rel}:{imp.line}: {owner} imports {imp.module} ({imp.how})")
    return out


def test_no_service_imports_another_and_the_core_imports_no_service() -> None:
    found = violations()
    assert not found, "imports across the walls (see this file's docstring for the rules):\n" + "\n".join(
        found
    )


def test_every_package_is_walked() -> None:
    owners = {owner for owner, _ in walked_files()}
    assert owners == {CORE, ZOO, *SERVICES}
    # a known import of each service is seen, so an empty walk cannot pass for a clean one
    gateway_api = imports_of((ROOT / "gateway" / "api.py").read_text(), "gateway.api")
    assert any(i.package == CORE for i in gateway_api)


def test_the_core_holds_no_model_weights() -> None:
    """The built-in models' weights are the zoo's package data (docs/models.md), none the core's."""
    assert not [p for p in (ROOT / CORE).rglob("*") if p.suffix in (".safetensors", ".bin", ".pt")]
    assert len(list((ROOT / ZOO).rglob("model.safetensors"))) == 8  # with the code, tool and judge models


# --- the walker on small sources: each form is caught, so the check can fail

KNOWN = {
    "loom",
    "zoo.registry",
    "loom.contracts.settings",
    "gateway",
    "gateway.api",
    "learner",
    "learner.train",
    "rollout_svc",
    "rollout_svc.modes",
    "rollout_svc.modes.tree",
    "rollout_svc.engines.server",
}


def _walk(source: str, module: str = "gateway.validate", is_package: bool = False) -> list[Import]:
    return imports_of(source, module, is_package, is_module=KNOWN.__contains__)


def _bad(owner: str, source: str, module: str = "gateway.validate") -> list[str]:
    return [i.module for i in _walk(source, module) if not allowed(owner, i)]


def test_walker_catches_an_import_inside_a_function() -> None:
    src = "def f():\n    if True:\n        from rollout_svc.modes import check\n    return check\n"
    assert _bad("gateway", src) == ["rollout_svc.modes"]
    assert _walk(src)[0].line == 3


def test_walker_catches_imports_in_try_class_and_type_checking_blocks() -> None:
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import reward_svc.core\n"
        "try:\n    import learner.train as t\nexcept ImportError:\n    t = None\n"
        "class C:\n    import reflect_svc\n"
    )
    assert _bad("gateway", src) == ["reward_svc.core", "learner.train", "reflect_svc"]


def test_walker_resolves_relative_imports() -> None:
    assert [i.module for i in _walk("from . import api\nfrom .. import x\n", "gateway.sub.mod")] == [
        "gateway.sub",
        "gateway",
    ]
    assert [i.module for i in _walk("from .modes import tree\n", "rollout_svc", is_package=True)] == [
        "rollout_svc.modes"
    ]
    assert _bad("rollout_svc", "from .modes import tree\n", "rollout_svc.rollout") == []


def test_walker_catches_importlib_strings() -> None:
    src = "import importlib\nm = importlib.import_module('reward_svc.core')\nn = __import__('learner')\n"
    assert _bad("gateway", src) == ["reward_svc.core", "learner"]
    src = "from importlib import import_module\nm = import_module(f'rollout_svc.modes.{name}')\n"
    assert _bad("gateway", src) == ["rollout_svc.modes"]


def test_walker_flags_an_fstring_whose_package_is_dynamic() -> None:
    src = "import importlib\ntasks = importlib.import_module(f'{PACKAGES[svc]}.tasks')\n"
    assert [i.module for i in _walk(src, "loom.cli") if i.how == "importlib"] == [
        f"{DYNAMIC} f'{{PACKAGES[svc]}}.tasks'"
    ]
    assert len(_bad("loom", src, "loom.cli")) == 1
    uvicorn = "uvicorn.run(f'{PACKAGES[svc]}.api:app', port=1)\n"
    assert len(_bad("loom", uvicorn, "loom.cli")) == 1
    assert _bad("launch", uvicorn, "launch.cli") == []  # the launcher may start anything


def test_walker_catches_module_and_module_attr_strings() -> None:
    src = (
        "MODES = {'tree': 'rollout_svc.modes.tree'}\n"
        "COMMANDS = {'engine': ('rollout_svc.engines.server:main', 'help')}\n"
        "APP = 'gateway.api:app'\n"
    )
    assert _bad("loom", src, "loom.cli") == [
        "rollout_svc.modes.tree",
        "rollout_svc.engines.server",
        "gateway.api",
    ]
    assert _bad("rollout_svc", src, "rollout_svc.modes") == ["gateway.api"]  # its own modules are fine


def test_walker_catches_the_core_reaching_into_the_zoo() -> None:
    src = "from zoo.registry import resolve_model_path\nTARGET = 'zoo.registry:resolve_model_path'\n"
    assert _bad("loom", src, "loom.store") == ["zoo.registry", "zoo.registry"]
    assert _bad("learner", src, "learner.train") == []  # a service may load a built-in model
    assert _bad("zoo", "import gateway.datasets\n", "zoo.tiny.tasks") == ["gateway.datasets"]


def test_walker_ignores_task_names_service_names_and_other_strings() -> None:
    src = (
        "send_task('learner.train_step', args=[1])\n"  # a Celery task name, no module of that name
        "url = urls['gateway']\n"  # a service name
        "path = f'{run_id}.jsonl'\n"
        "addr = f'{host}:{port}'\n"
        "doc = 'see rollout_svc.modes.tree for the mode'\n"
        "import numpy.linalg\n"
    )
    assert _bad("gateway", src) == []


@pytest.mark.parametrize(
    ("owner", "target", "ok"),
    [
        ("gateway", "loom.contracts.settings", True),
        ("gateway", "gateway.jobs", True),
        ("gateway", "rollout_svc.modes", False),
        ("gateway", "launch.stack", False),
        ("loom", "loom.queue", True),
        ("loom", "learner", False),
        ("loom", "launch", False),
        ("loom", "zoo.registry", False),
        ("zoo", "loom.formats", True),
        ("zoo", "zoo.tiny.traces", True),
        ("zoo", "gateway.datasets", False),
        ("zoo", "launch.cli", False),
        ("learner", "zoo.registry", True),
        ("launch", "zoo.search.train", True),
        ("launch", "rollout_svc.engines.server", True),
        ("learner", "torch", True),
    ],
)
def test_rules(owner: str, target: str, ok: bool) -> None:
    assert allowed(owner, Import(1, target, "import")) is ok
