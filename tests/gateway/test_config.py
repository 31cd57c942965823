"""The gateway's one configuration (``GatewaySettings``, issue 36): every ``LOOM_GATEWAY_*`` variable
an operator sets still reaches the gateway by its old name, each lives in exactly one settings class,
and the gateway built from the environment alone (``gateway.api.app``'s path) obeys it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).parent))
from helpers import API_KEYS, JOBS_KEY, auth  # noqa: E402

from gateway.api import build_app  # noqa: E402
from gateway.config import GatewaySettings  # noqa: E402
from loom.contracts.settings import Settings  # noqa: E402
from loom.queue import make_celery  # noqa: E402
from loom.store.publish import PublishLimits  # noqa: E402
from rollout_svc.config import RolloutSettings  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NAMED_IN = [REPO / "README.md", REPO / "docker-compose.yml", *sorted((REPO / "docs").rglob("*.md"))]
NAMED_IN += sorted((REPO / "deploy").rglob("*.example")) + sorted((REPO / "deploy").rglob("*.yaml"))
NOT_SETTINGS = {"LOOM_GATEWAY_URL"}  # a client's variable (where a trainer finds the gateway)


def _variables(cls: type) -> set[str]:
    prefix = cls.model_config["env_prefix"]  # type: ignore[attr-defined]
    return {f"{prefix}{name.upper()}" for name in cls.model_fields}  # type: ignore[attr-defined]


@pytest.mark.parametrize("role", [GatewaySettings, RolloutSettings])
def test_every_role_variable_the_docs_and_deployments_name_is_one_setting(role: type) -> None:
    prefix = role.model_config["env_prefix"]  # type: ignore[attr-defined]
    shared, own = _variables(Settings) | _variables(PublishLimits), _variables(role)  # the store's limits
    assert not shared & own, f"in two classes: {shared & own}"
    named = {v for path in NAMED_IN for v in re.findall(rf"\b{prefix}[A-Z0-9_]*[A-Z0-9]\b", path.read_text())}
    assert len(named) >= 3, named  # the pattern finds them
    assert named - NOT_SETTINGS <= shared | own, (named - NOT_SETTINGS) - (shared | own)


def test_the_gateway_takes_its_settings_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOOM_GATEWAY_RUN_LOOP", "false")
    monkeypatch.setenv("LOOM_GATEWAY_QUOTA_JOBS", "1")
    monkeypatch.setenv("LOOM_GATEWAY_POLICY_MAX_BYTES", "12345")  # the store's: shared with its host
    assert GatewaySettings().quota_jobs == 1 and PublishLimits().max_bytes == 12345
    settings = Settings(
        data_dir=tmp_path, broker_url="embedded", result_backend="embedded", api_keys=API_KEYS
    )
    app = build_app(settings, celery_app=make_celery("gateway", settings))  # no config: the environment's
    with TestClient(app) as c:
        job = {"prompts": ["Compute 1+1."]}
        assert c.post("/v1/jobs", json={**job, "job_key": "a"}, headers=auth(JOBS_KEY)).status_code == 201
        r = c.post("/v1/jobs", json={**job, "job_key": "b"}, headers=auth(JOBS_KEY))
        assert r.status_code == 429 and r.json()["quota"] == "jobs", r.text
        assert "LOOM_GATEWAY_QUOTA_JOBS" in r.json()["detail"]
