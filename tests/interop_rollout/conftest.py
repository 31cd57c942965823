"""Fixtures of the policy-version contract tests: real uvicorn servers on loopback (the gateway, and
the learner API that holds the policy store), real keys, a real small checkpoint on disk."""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from gateway.keys import hash_key
from loom.contracts.settings import Settings
from loom.queue import make_celery
from tests.conftest import free_port

PUBLISHER_KEY = "loom_test_publisher_key"  # key "alice": jobs + policy
OTHER_KEY = "loom_test_other_publisher"  # key "bob": jobs + policy
JOBS_ONLY_KEY = "loom_test_jobs_only_key"  # key "carol": jobs
LOOM_NAMED_KEY = "loom_test_key_named_loom"  # key "loom": policy (the learner's name: cannot publish)
API_KEYS = ",".join(
    [
        f"alice:{hash_key(PUBLISHER_KEY)}:jobs+policy",
        f"bob:{hash_key(OTHER_KEY)}:jobs+policy",
        f"carol:{hash_key(JOBS_ONLY_KEY)}:jobs",
        f"loom:{hash_key(LOOM_NAMED_KEY)}:policy",
    ]
)
TOKEN = "publish-test-token"


class Server:
    """``app`` served by uvicorn in a thread on a free loopback port."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


_BASE: list[Path] = []


def base_model() -> Path:
    """The deployment's base model of these tests: a model of the trainers' checkpoints' shape
    (``build_model_dir``), which what they publish is checked against (loom/store/checks.py)."""
    if not _BASE:
        from tests.rollout.conftest import build_model_dir

        _BASE.append(build_model_dir(Path(tempfile.mkdtemp(prefix="loom-base-")), seed=0))
    return _BASE[0]


def gateway_settings(data_dir: Path, **extra: Any) -> Settings:
    extra.setdefault("model", str(base_model()))
    return Settings(
        data_dir=data_dir,
        broker_url="embedded",
        result_backend="embedded",
        api_keys=API_KEYS,
        service_token=TOKEN,
        **extra,
    )


def start_gateway(settings: Settings) -> Server:
    from gateway.api import build_app
    from gateway.config import GatewaySettings

    celery_app = make_celery("gateway", settings)
    return Server(build_app(settings, celery_app=celery_app, config=GatewaySettings(run_loop=False)))


def start_learner_api(settings: Settings) -> Server:
    from learner.api import build_app

    return Server(build_app(settings, make_celery("learner", settings)))


@pytest.fixture
def gateway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Server, Settings]]:
    """A gateway that holds the policy store itself (no LOOM_POLICY_STORE_URL)."""
    monkeypatch.setenv("LOOM_GATEWAY_POLICY_MAX_BYTES", "2000000")
    settings = gateway_settings(tmp_path / "gw")
    with start_gateway(settings) as server:
        yield server, settings


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real small Llama checkpoint with its tokenizer (tests/rollout's model)."""
    from tests.rollout.conftest import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("trainer") / "step-1", seed=11)
