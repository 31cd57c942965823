"""HTTP API of the gateway service: validates, calls the core, returns schemas.

Public routes (all need an API key, see gateway/auth.py): ``/v1/jobs`` (scored groups for external
trainers; poll or server-sent events; cancel), ``/v1/runs`` (RL runs driven by this process),
``/v1/datasets`` (JSONL uploads for runs, streamed to disk), ``/v1/policies`` (a trainer's policy
versions, docs/interop-rollout.md), ``/v1/queues`` and ``/v1/ping`` (admin).
The internal services' APIs are not proxied: the gateway reaches them only through the named tasks of
its pipelines. Per-key quotas, failed-key limits and error bodies: docs/security.md.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from gateway.auth import WebAuth, auth_middleware
from gateway.config import GatewaySettings
from gateway.datasets import dataset_root
from gateway.keys import KeyRing
from gateway.manager import Manager
from gateway.pipeline import CeleryStages, Stages
from gateway.quotas import Quotas
from gateway.ratelimit import TokenBuckets
from gateway.routes import api_router
from gateway.routes import policies as policy_routes
from gateway.routes.deps import Backpressure, Gateway
from gateway.routes.web import mount as mount_run_page
from gateway.scheduler import DEFAULT_WINDOW, FairGate
from gateway.state import GatewayState
from loom.contracts.settings import SERVICES, Settings, get_settings
from loom.service import create_queue_app


def fair_gate(config: GatewaySettings, state: GatewayState, weights: dict[str, float]) -> FairGate | None:
    """The rollout tier's fair scheduler (gateway/scheduler.py): its window from the settings, a
    job's or run's tenant its key (``weights``: each key's share; a key not configured any more: 1)."""
    if not config.fair_share:
        return None

    def tenant(scope: str) -> tuple[str, float]:
        owner = state.owner_of(scope)
        name = scope if owner is None else owner
        return name, weights.get(name, 1.0)

    return FairGate(config.rollout_window or config.rollout_slots or DEFAULT_WINDOW, tenant)


def build_gateway(
    settings: Settings, config: GatewaySettings, celery_app: Any, stages: Stages | None = None
) -> Gateway:
    """The process's state and its pipeline manager, on ``settings.data_dir``."""
    data_dir = Path(settings.data_dir)
    state = GatewayState(data_dir / "gateway.sqlite")
    stop = threading.Event()
    if stages is None:
        weights = KeyRing.from_spec(settings.api_keys).weights()
        stages = CeleryStages(celery_app, stop=stop, fair=fair_gate(config, state, weights))
    return Gateway(
        settings=settings,
        config=config,
        celery_app=celery_app,
        state=state,
        manager=Manager(state, stages, data_dir, stop),
        backpressure=Backpressure(celery_app, config.max_queue_depth),
        quotas=Quotas.from_settings(config),
        datasets=dataset_root(data_dir),
    )


def build_app(
    settings: Settings | None = None,
    celery_app: Any = None,
    stages: Stages | None = None,
    config: GatewaySettings | None = None,
) -> FastAPI:
    """The gateway on the shared ``settings`` and its own ``config`` (default: both from the environment)."""
    settings = settings or get_settings()
    config = config or GatewaySettings()
    if celery_app is None:
        from gateway.tasks import celery_app as default_app

        celery_app = default_app
    app = create_queue_app(
        "gateway",
        celery_app,
        ping=SERVICES,
        settings=settings,
        description=__doc__ or "",
        errors=(401, 403, 429),
        body_limits={"/v1/datasets": config.dataset_max_bytes},
    )
    gateway = build_gateway(settings, config, celery_app, stages)
    keys = KeyRing.from_spec(settings.api_keys)
    failures = TokenBuckets(config.auth_fail_rate, config.auth_fail_burst)
    web = WebAuth.from_settings(keys, failures, config)  # the run page's sessions and login limits
    app.middleware("http")(auth_middleware(keys, TokenBuckets(config.rate, config.burst), failures, web))
    app.state.gateway = gateway
    app.state.gateway_state = gateway.state
    app.state.manager = gateway.manager

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if config.run_loop:
            gateway.manager.resume_all()
        yield
        await asyncio.to_thread(gateway.manager.shutdown)

    app.router.lifespan_context = lifespan
    app.include_router(api_router)
    app.include_router(policy_routes.router, prefix="/v1")  # trainers publish policy versions
    mount_run_page(app)  # /ui: the run page (docs/run-page.md)
    return app


app = build_app()
