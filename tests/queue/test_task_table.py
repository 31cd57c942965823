"""The task table (loom/contracts/tasks.py) is the one place task names live: every worker registers
a row of it, every row has its worker, and product code neither spells a task name nor publishes
around the table."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from loom.contracts.settings import SERVICES
from loom.contracts.tasks import TASKS, TaskDef, ping

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("loom", "gateway", "rollout_svc", "reward_svc", "reflect_svc", "learner", "launch", "bench")
TABLE = REPO / "loom" / "contracts" / "tasks.py"
# where ``send_task`` itself may be called: the fabric's ``send`` and the gateway's stages
WORKERS = {
    "gateway": "gateway.tasks",
    "rollout": "rollout_svc.tasks",
    "reward": "reward_svc.tasks",
    "reflect": "reflect_svc.tasks",
    "learner": "learner.tasks",
    "sandbox": "sandbox_svc.tasks",
    "env": "env_svc.tasks",
}
PUBLISHERS = {REPO / "loom" / "queue.py", REPO / "gateway" / "pipeline.py"}


# being rewritten on a branch (the gateway's step, reflection as a stage): wired to the table at merge
PENDING = {
    REPO / "gateway" / "pipeline.py",
    REPO / "reflect_svc" / "backends.py",
    REPO / "reflect_svc" / "tasks.py",
}


def product_files() -> list[Path]:
    return sorted(
        p for d in PRODUCT for p in (REPO / d).rglob("*.py") if ".venv" not in p.parts and p not in PENDING
    )


@pytest.mark.parametrize("service", SERVICES)
def test_every_worker_registers_table_rows_and_every_row_has_its_worker(service: str) -> None:
    app = importlib.import_module(WORKERS[service]).celery_app
    registered = {name for name in app.tasks if not name.startswith("celery.")}
    assert registered <= set(TASKS), registered - set(TASKS)  # (Celery shares tasks between apps)
    own = {name for name in registered if name.split(".", 1)[0] == service}
    assert own == {name for name, t in TASKS.items() if t.service == service}


def test_no_task_name_spelled_outside_the_table() -> None:
    names = set(TASKS)
    found = []
    for path in product_files():
        if path == TABLE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert not found, "\n".join(found)


def test_send_task_only_in_the_fabric_and_the_gateway() -> None:
    found = []
    for path in product_files():
        if path in PUBLISHERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "send_task":
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, "\n".join(found)


def test_a_row_names_a_service_and_its_queue_is_the_prefix() -> None:
    assert ping("reward").service == "reward"
    assert TASKS["learner.train_step"].service == "learner"
    with pytest.raises(ValueError, match="not a service"):
        TaskDef("nowhere.train_step")
