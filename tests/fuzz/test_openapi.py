"""Property-based fuzzing of every service's OpenAPI (schemathesis): valid and invalid requests for
every operation, each answer checked for a 5xx (none allowed) and against the OpenAPI document
(status code documented, content type, headers and body matching their schemas).

Each app is built in-process as ``uvicorn <package>.api:app`` would run it, with what it needs to
answer without a 5xx: the gateway and the learner on an embedded broker in a temporary data dir (a
real learner worker consumes it), the rollout service with the real torch engine and the tiny model,
the reward service with its real verifier pool, the sandbox service with its real pool (the fuzzed
programs run in bubblewrap), the reflect service over HTTP to the rollout and
reward apps (served by uvicorn in threads). ``POST /v1/ping`` is left out: it waits on a round trip
through every queue by design (up to its ``timeout``, 600 s).

Bounded: ``LOOM_FUZZ_EXAMPLES`` examples per operation and generation mode (default 12), the same
examples every run unless ``LOOM_FUZZ_RANDOM=1``. Costs requests, not model calls: generated sampling sizes
are capped (``_small``) so a valid rollout costs milliseconds of the tiny model.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import BrokerEnv, free_port, start_worker

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("LOOM_FUZZ_EXAMPLES", "12"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
WAIT_FLOOR_S = 60.0  # the shortest wait on a worker a fuzzed request asks for (``_small``)
REQUEST_TIMEOUT_S = 300  # a loaded machine; every wait of an operation here is capped (``_small``)
ADMIN_KEY = "loom_fuzz_admin_key"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("LOOM_FUZZ_RANDOM") != "1",
    suppress_health_check=list(HealthCheck),
    database=None,
)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _floored(wait: Any) -> Any:
    return WAIT_FLOOR_S if _number(wait) and 0 < wait < WAIT_FLOOR_S else wait


def _small(body: Any) -> Any:
    """Cap what a valid request may ask the tiny model or the verifier to do (sizes and timeouts).

    A positive ``timeout`` (how long a route waits on its worker) is also raised to
    ``WAIT_FLOOR_S``: a wait of 0.05 s that expires answers the documented 504 ``timeout`` by design,
    and whether it expires depends on the machine's load (CI once drew 0.05 s for
    ``POST /v1/train_step`` on a loaded machine). The 504 path has its own tests
    (tests/learner/test_api.py, tests/security/test_workers_bounds.py)."""
    if isinstance(body, dict):
        out = {k: _small(v) for k, v in body.items()}
        for key, cap in (("n", 2), ("max_tokens", 8), ("timeout_s", 2), ("timeout", 120.0)):
            if _number(out.get(key)):
                out[key] = min(out[key], cap)
        if _number(out.get("timeout")):
            out["timeout"] = _floored(out["timeout"])
        if isinstance(out.get("timeout"), list):  # a repeated query parameter: the server reads the last
            out["timeout"] = [_floored(t) for t in out["timeout"]]
        return out
    if isinstance(body, list):
        return [_small(v) for v in body]
    return body


@schemathesis.serializer("application/x-ndjson")
def _ndjson(ctx: Any, value: Any) -> dict[str, Any]:
    """``POST /v1/datasets``: the generated rows as JSONL (anything else as one JSON line)."""
    rows = value if isinstance(value, list) else [value]
    return {"data": "".join(json.dumps(r) + "\n" for r in rows).encode()}


def _serve(app: Any) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """LOOM_* settings of every app and worker here."""
    from loom.contracts.settings import get_settings

    data = tmp_path_factory.mktemp("fuzz")
    values = {
        "LOOM_DATA_DIR": str(data),
        "LOOM_BROKER_URL": "embedded",
        "LOOM_RESULT_BACKEND": "embedded",
        "LOOM_ENGINE_PROCESS": "false",
        "LOOM_TORCH_THREADS": "1",
        "LOOM_API_KEYS": f"fuzz:{hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}:jobs+runs+admin",
        "LOOM_GATEWAY_RUN_LOOP": "false",
        "LOOM_GATEWAY_BURST": "1000000",
        "LOOM_GATEWAY_QUOTA_JOBS": "1000000",
        "LOOM_GATEWAY_QUOTA_RUNS": "1000000",
    }
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    get_settings.cache_clear()
    try:
        yield values
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        get_settings.cache_clear()


@pytest.fixture(scope="module")
def loom_settings(env: dict[str, str]) -> Any:
    from loom.contracts.settings import Settings

    return Settings()


@contextlib.contextmanager
def _module_app(package: str, settings: Any) -> Iterator[Any]:
    """``<package>.api:app`` as uvicorn imports it, with this module's settings while the test runs
    (its routes read ``app.state.settings``; the module is not reloaded: other tests share it)."""
    app = importlib.import_module(f"{package}.api").app
    saved = app.state.settings
    app.state.settings = settings
    try:
        yield app
    finally:
        app.state.settings = saved


# vLLM's NCCL weight-transfer routes: the engine answers each with 501 on purpose (no such transport
# here); tests/interop/engine checks that answer, and a 5xx is what schemathesis flags
REFUSED_BY_DESIGN = (
    "/engine/init_weight_transfer_engine",
    "/engine/start_weight_update",
    "/engine/update_weights",
    "/engine/finish_weight_update",
)


def _schema(app: Any, **headers: str) -> Any:
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=headers)
    return schema.exclude(path="/v1/ping").exclude(path=list(REFUSED_BY_DESIGN))


def fuzz(schema: Any, headers: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """Every operation of ``schema``, valid and invalid requests: (requests sent, failures found, each
    the operation, the mode and schemathesis' report with the request that reproduces it)."""
    sent, failures = 0, []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                strategy = operation.as_strategy(generation_mode=mode)
            except Exception as exc:  # e.g. nothing to make invalid in an operation without inputs
                failures.append(f"{operation.label} [{mode.value}]: no strategy: {exc}")
                continue

            @FUZZ
            @given(case=strategy)
            def one(case: Any) -> None:
                nonlocal sent
                case.body = _small(case.body)
                if isinstance(case.query, dict):
                    case.query = _small(case.query)
                sent += 1
                case.call_and_validate(checks=CHECKS, headers=headers, timeout=REQUEST_TIMEOUT_S)

            try:
                one()
            except Unsatisfiable:  # nothing to make invalid (no inputs, or any string is valid)
                continue
            except (Exception, BaseExceptionGroup) as exc:  # schemathesis' FailureGroup is the latter
                report = "".join(traceback.format_exception(exc))[-4000:]
                failures.append(f"{operation.label} [{mode.value}]: {report}")
    return sent, failures


@pytest.fixture(scope="module")
def gateway_schema(loom_settings: Any) -> Any:
    from gateway.api import build_app
    from loom.queue import make_celery

    return _schema(build_app(loom_settings, celery_app=make_celery("gateway", loom_settings)), **AUTH)


@pytest.fixture(scope="module")
def reward_schema(loom_settings: Any) -> Iterator[Any]:
    with _module_app("reward_svc", loom_settings) as app:
        yield _schema(app)
    importlib.import_module("reward_svc.api")._close_pool()


@pytest.fixture(scope="module")
def rollout_schema(loom_settings: Any) -> Iterator[Any]:
    from fastapi.testclient import TestClient

    with _module_app("rollout_svc", loom_settings) as app:
        warm = TestClient(app).post("/v1/rollouts", json={"prompt": "1+1=", "sampling": {"max_tokens": 2}})
        assert warm.status_code == 200, warm.text  # the engine is loaded before the clock of any request
        yield _schema(app)


@pytest.fixture(scope="module")
def learner_schema(
    env: dict[str, str], loom_settings: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    from learner.api import build_app
    from loom.queue import make_celery

    worker = start_worker(
        BrokerEnv(kind="embedded", tmp=tmp_path_factory.mktemp("learner"), env=env), "learner"
    )
    try:
        yield _schema(build_app(loom_settings, celery_app=make_celery("learner", loom_settings)))
    finally:
        worker.kill_group()


@pytest.fixture(scope="module")
def reflect_schema(loom_settings: Any) -> Iterator[Any]:
    """The reflect service over HTTP to the rollout and reward apps (served here by uvicorn)."""
    from reflect_svc.config import get_reflect_settings

    with contextlib.ExitStack() as stack:
        apps = [stack.enter_context(_module_app(p, loom_settings)) for p in ("rollout_svc", "reward_svc")]
        urls = [stack.enter_context(contextlib.contextmanager(_serve)(a)) for a in apps]
        os.environ.update(
            LOOM_REFLECT_TRANSPORT="http", LOOM_REFLECT_ROLLOUT_URL=urls[0], LOOM_REFLECT_REWARD_URL=urls[1]
        )
        get_reflect_settings.cache_clear()
        try:
            with _module_app("reflect_svc", loom_settings) as app:
                yield _schema(app)
        finally:
            for k in ("LOOM_REFLECT_TRANSPORT", "LOOM_REFLECT_ROLLOUT_URL", "LOOM_REFLECT_REWARD_URL"):
                os.environ.pop(k, None)
            get_reflect_settings.cache_clear()
            importlib.import_module("reward_svc.api")._close_pool()


@pytest.fixture(scope="module")
def sandbox_schema(loom_settings: Any) -> Iterator[Any]:
    """The sandbox service with its real pool (bubblewrap): fuzzed programs run, isolated."""
    from sandbox_svc.runner import bwrap_path

    if bwrap_path() is None:
        pytest.skip("bubblewrap is not installed (deploy/setup.sh)")
    with _module_app("sandbox_svc", loom_settings) as app:
        yield _schema(app)
    importlib.import_module("sandbox_svc.api")._close_pool()


def test_sandbox(sandbox_schema: Any) -> None:
    sent, failures = fuzz(sandbox_schema)
    print(f"{sent} requests")
    assert sent and not failures, "\n\n".join(failures)


def test_gateway(gateway_schema: Any) -> None:
    sent, failures = fuzz(gateway_schema, AUTH)
    print(f"{sent} requests")
    assert sent and not failures, "\n\n".join(failures)


def test_reward(reward_schema: Any) -> None:
    sent, failures = fuzz(reward_schema)
    print(f"{sent} requests")
    assert sent and not failures, "\n\n".join(failures)


def test_rollout(rollout_schema: Any) -> None:
    sent, failures = fuzz(rollout_schema)
    print(f"{sent} requests")
    assert sent and not failures, "\n\n".join(failures)


def test_learner(learner_schema: Any) -> None:
    sent, failures = fuzz(learner_schema)
    print(f"{sent} requests")
    assert sent and not failures, "\n\n".join(failures)


def test_reflect(reflect_schema: Any) -> None:
    sent, failures = fuzz(reflect_schema)
    print(f"{sent} requests")
    assert sent and not failures, "\n\n".join(failures)
