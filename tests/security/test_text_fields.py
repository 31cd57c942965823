"""Every text field refuses what UTF-8 cannot encode, at submission (issue 35, finding 5).

JSON's ``\\ud800`` escape decodes to a lone surrogate, a Python str that no UTF-8 encoder takes.
pydantic refused it in a length-constrained ``str`` field (a prompt, a job_key) but passed it in an
unconstrained one and inside ``Any``: ``"label": "3\\ud800"`` was a 201, and once the job was scored
``GET /v1/jobs/{id}`` and ``/ui/jobs/{id}`` answered 500 forever (``UnicodeEncodeError``). Now the
``Contract`` base (loom/contracts/wire.py ``EncodableText``) checks every string of every field,
nested dicts and lists and their keys included: a 422 naming the field, on the gateway and on the
reward, rollout and reflect services' own APIs; a dataset line is a 422 naming the line. The bodies
are sent as raw JSON text, with the escape, as a client would send them.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from helpers import API_KEYS, RUNS_KEY, auth  # noqa: E402

from gateway.api import build_app  # noqa: E402
from gateway.config import GatewaySettings  # noqa: E402
from loom.contracts.settings import Settings  # noqa: E402
from loom.contracts.wire import Group, unencodable_path  # noqa: E402
from loom.queue import make_celery  # noqa: E402

LONE = "\\ud800"  # as it stands in the JSON text: the escape, not the character
JSON = {"content-type": "application/json"}
NDJSON = {"content-type": "application/x-ndjson"}
UNICODE_MSG = "lone surrogate"


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(
        data_dir=tmp_path, broker_url="embedded", result_backend="embedded", api_keys=API_KEYS,
    )  # fmt: skip
    config = GatewaySettings(run_loop=False)
    with TestClient(build_app(settings, celery_app=make_celery("gateway", settings), config=config)) as c:
        c.headers.update({**auth(RUNS_KEY), **JSON})
        yield c


def _refused(r: Any, loc: list[str | int], at: str | None = None) -> None:
    """A 422 whose one problem is at ``loc`` (and names ``at`` inside it). The type is pydantic's own
    for this (a constrained ``str`` field, e.g. ``job_key``, was already refused by pydantic)."""
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error"] == "validation_error", body
    [problem] = body["detail"]
    assert problem["loc"] == loc and problem["type"] == "string_unicode", problem
    assert at is None or f"at {at} " in problem["msg"], problem


def _job(**fields: str) -> str:
    """A job's JSON text; ``fields`` are raw JSON values put in as they are."""
    body = {"job_key": '"k"', "tasks": '[{"prompt": "What is 1 + 2?", "label": "3"}]', **fields}
    return "{" + ", ".join(f'"{k}": {v}' for k, v in body.items()) + "}"


def test_a_lone_surrogate_label_is_a_422_naming_the_label_and_nothing_is_stored(gateway: TestClient) -> None:
    r = gateway.post("/v1/jobs", content=_job(tasks=f'[{{"prompt": "What is 1 + 2?", "label": "3{LONE}"}}]'))
    _refused(r, ["body", "tasks", 0, "label"])
    state = gateway.app.state.gateway_state  # type: ignore[attr-defined]
    assert state.jobs.with_status("queued", "running", "succeeded", "failed", "cancelled") == []
    # a character outside the BMP, escaped as a surrogate pair, is valid text: accepted
    r = gateway.post("/v1/jobs", content=_job(tasks='[{"prompt": "p", "label": "3 \\ud83d\\ude00"}]'))
    assert r.status_code == 201, r.text


@pytest.mark.parametrize(
    ("fields", "loc", "at"),
    [
        ({"job_key": f'"k{LONE}"'}, ["body", "job_key"], None),
        ({"mode_params": f'{{"sentences": ["a", "b{LONE}"]}}'}, ["body", "mode_params"], "sentences[1]"),
        ({"mode_params": f'{{"x{LONE}": 1}}'}, ["body", "mode_params"], "x\\ud800"),  # a key
        (
            {"tasks": f'[{{"prompt": "p", "mode_params": {{"deep": [{{"a": "{LONE}"}}]}}}}]'},
            ["body", "tasks", 0, "mode_params"],
            "deep[0].a",
        ),
        (
            {"reward": f'{{"components": [{{"name": "accuracy", "params": {{"tag": "{LONE}"}}}}]}}'},
            ["body", "reward", "components", 0, "params"],
            "tag",
        ),
        ({"sampling": f'{{"stop": ["{LONE}"]}}'}, ["body", "sampling", "stop", 0], None),
    ],
)
def test_every_text_field_of_a_job_refuses_a_lone_surrogate(
    gateway: TestClient, fields: dict[str, str], loc: list[str | int], at: str | None
) -> None:
    _refused(gateway.post("/v1/jobs", content=_job(**fields)), loc, at)


def test_a_runs_text_fields_and_its_inline_dataset_lines_refuse_a_lone_surrogate(
    gateway: TestClient, tmp_path: Path
) -> None:
    _refused(gateway.post("/v1/runs", content=f'{{"run_key": "r{LONE}", "dataset": {{"builtin": "arith"}}}}'),
             ["body", "run_key"])  # fmt: skip
    knobs = f'{{"dataset": {{"builtin": "arith", "knobs": {{"ops": ["{LONE}"]}}}}}}'
    assert gateway.post("/v1/runs", content=knobs).status_code == 422
    # inline JSONL: the escape is inside the JSONL text (escaped once more in the run's JSON)
    for answer, where in (('"3\\\\ud800"', "answer"), ('{"a": ["\\\\ud800"]}', "answer.a[0]")):
        jsonl = (
            '{\\"prompt\\": \\"ok\\", \\"answer\\": 1}\\n{\\"prompt\\": \\"p\\", \\"answer\\": '
            + answer.replace('"', '\\"')
            + "}\\n"
        )
        r = gateway.post("/v1/runs", content=f'{{"dataset": {{"jsonl": "{jsonl}"}}}}')
        assert r.status_code == 422, r.text
        assert r.json()["error"] == "invalid_dataset", r.text
        assert f"jsonl line 2: '{where}'" in r.json()["detail"] and UNICODE_MSG in r.json()["detail"]
    assert not (tmp_path / "datasets").exists() or os.listdir(tmp_path / "datasets") == []


def test_an_uploaded_dataset_line_with_a_lone_surrogate_is_a_422_naming_it(
    gateway: TestClient, tmp_path: Path
) -> None:
    rows = '{"prompt": "fine", "answer": 1}\n' * 3 + f'{{"prompt": "p", "answer": {{"n": ["3{LONE}"]}}}}\n'
    r = gateway.post("/v1/datasets", content=rows.encode(), headers=NDJSON)
    assert r.status_code == 422 and r.json()["error"] == "invalid_dataset", r.text
    assert "jsonl line 4: 'answer.n[0]'" in r.json()["detail"] and UNICODE_MSG in r.json()["detail"]
    r = gateway.post("/v1/datasets", content=f'{{"prompt": "p{LONE}"}}\n'.encode(), headers=NDJSON)
    assert r.status_code == 422 and "jsonl line 1: 'prompt'" in r.json()["detail"], r.text
    assert os.listdir(tmp_path / "datasets") == []


def test_the_reward_services_routes_refuse_a_lone_surrogate() -> None:
    """Loom's own route and the trainers' protocols alike (labels of any JSON type: nested ones too)."""
    from reward_svc.api import app

    group = f'{{"id": "g", "label": "3", "meta": {{"numbers": [1, "{LONE}"]}}, "trajectories": []}}'
    with TestClient(app, raise_server_exceptions=False) as c:
        _refused(c.post("/v1/rewards", content=f'{{"groups": [{group}]}}', headers=JSON),
                 ["body", "groups", 0, "meta"], "numbers[1]")  # fmt: skip
        label = f'{{"groups": [{{"id": "g", "label": "3{LONE}"}}]}}'
        _refused(c.post("/v1/rewards", content=label, headers=JSON), ["body", "groups", 0, "label"])
        openrlhf = f'{{"query": ["p 3"], "prompts": ["p"], "labels": [{{"target": "{LONE}"}}]}}'
        _refused(c.post("/get_reward", content=openrlhf, headers=JSON), ["body", "labels"], "[0].target")
        slime = f'{{"prompt": "p", "response": "\\\\boxed{{3}}", "label": "3{LONE}"}}'
        _refused(c.post("/v1/slime/reward", content=slime, headers=JSON), ["body", "label"])
        ok = '{"prompt": "p", "response": "\\\\boxed{3}", "label": 3}'
        assert c.post("/v1/slime/reward", content=ok, headers=JSON).status_code == 200


def test_the_rollout_and_reflect_services_refuse_a_lone_surrogate() -> None:
    """Their direct APIs take the same contracts; the rollout engine's OpenAI-compatible routes answer
    vLLM's 400 naming the parameter (before, the tokenizer raised: a 500)."""
    from reflect_svc.api import app as reflect_app
    from rollout_svc.api import app as rollout_app

    with TestClient(rollout_app, raise_server_exceptions=False) as c:
        _refused(c.post("/v1/rollouts", content=f'{{"prompt": "p", "label": "3{LONE}"}}', headers=JSON),
                 ["body", "label"])  # fmt: skip
        chat = f'{{"model": "tiny", "messages": [{{"role": "user", "content": "p{LONE}"}}], "max_tokens": 2}}'
        r = c.post("/engine/v1/chat/completions", content=chat, headers=JSON)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content", r.text
    with TestClient(reflect_app, raise_server_exceptions=False) as c:
        r = c.post("/v1/reflect", content=f'{{"group": {{"id": "g", "label": "3{LONE}"}}}}', headers=JSON)
        _refused(r, ["body", "group", "label"])


def test_unencodable_path_names_where_and_lets_valid_text_through() -> None:
    bad = json.loads(f'{{"a": [1, {{"b": "x{LONE}"}}], "ok": "\\ud83d\\ude00 é"}}')
    assert unencodable_path(bad) == ".a[1].b"
    assert unencodable_path({"ok": "😀 é", "n": [1.5, None, True]}) is None
    deep = json.loads("[" * 900 + f'"{LONE}"' + "]" * 900)  # deeper than a recursive walk could go here
    assert unencodable_path(deep) == "[0]" * 900
    with pytest.raises(ValueError, match=UNICODE_MSG):
        Group.model_validate(json.loads(f'{{"id": "g", "trajectories": [{{"id": "t", "group_id": "g", '
                                        f'"meta": {{"k": "{LONE}"}}}}]}}'))  # fmt: skip
