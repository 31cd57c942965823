"""Failed authentications are rate-limited per client address (issue 24, item 6): 200 concurrent
requests with wrong keys get at most the burst of 401s and 429s (with Retry-After) for the rest,
checked before any key is hashed; a valid key from another address is not affected. Before: 200 x
401 (the per-key bucket is taken only after a key is verified). In-process app, concurrent requests
on one event loop through httpx's ASGI transport (which sets the client address)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from helpers import API_KEYS, JOBS_KEY, auth  # noqa: E402

from gateway.api import build_app  # noqa: E402
from gateway.config import GatewaySettings  # noqa: E402
from gateway.ratelimit import TokenBuckets  # noqa: E402
from loom.contracts.settings import Settings  # noqa: E402
from loom.queue import make_celery  # noqa: E402

BURST = 20  # LOOM_GATEWAY_AUTH_FAIL_BURST's default


def test_200_concurrent_wrong_keys_are_mostly_429(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path,
        broker_url="embedded",
        result_backend="embedded",
        api_keys=API_KEYS,
    )
    config = GatewaySettings(run_loop=False, auth_fail_rate=0.001)  # no refill while the test runs
    app = build_app(settings, celery_app=make_celery("gateway", settings), config=config)

    async def scenario() -> tuple[list[httpx.Response], httpx.Response, httpx.Response]:
        attacker = httpx.ASGITransport(app=app, client=("203.0.113.7", 40000))
        async with httpx.AsyncClient(transport=attacker, base_url="http://gw") as c:
            wrong = await asyncio.gather(
                *(c.get("/v1/jobs/job-x", headers=auth(f"loom_guess_{i}")) for i in range(200))
            )
            blocked_valid = await c.get("/version", headers=auth(JOBS_KEY))
        other = httpx.ASGITransport(app=app, client=("198.51.100.2", 40000))
        async with httpx.AsyncClient(transport=other, base_url="http://gw") as c:
            fine = await c.get("/version", headers=auth(JOBS_KEY))
        return wrong, blocked_valid, fine

    wrong, blocked_valid, fine = asyncio.run(scenario())
    codes = [r.status_code for r in wrong]
    assert set(codes) <= {401, 429}
    assert codes.count(401) <= BURST and codes.count(429) >= 200 - BURST, codes
    limited = next(r for r in wrong if r.status_code == 429)
    assert limited.json()["error"] == "rate_limited" and int(limited.headers["Retry-After"]) >= 1
    # the address is refused before its key is looked at: even a valid key waits (a guesser must not
    # learn from a 200 among the 429s which guess was right)
    assert blocked_valid.status_code == 429
    assert fine.status_code == 200  # another address is not affected


def test_failure_buckets_of_many_addresses_do_not_grow_without_bound() -> None:
    now = [0.0]
    buckets = TokenBuckets(rate=1.0, burst=2, clock=lambda: now[0], max_keys=100)
    for i in range(1000):
        buckets.take(f"10.0.{i // 256}.{i % 256}")
        now[0] += 2.0  # each address has refilled by the time the next one comes
    assert len(buckets._buckets) <= 100
    assert buckets.wait("10.9.9.9") == 0.0 and len(buckets._buckets) <= 100  # a peek stores nothing new
