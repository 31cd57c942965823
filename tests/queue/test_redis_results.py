"""loom/redis_results.py against the real Redis: Celery's stored values and messages, one round trip
per state change, a SUCCESS never overwritten, and what the STARTED store tells LoomTask."""

from __future__ import annotations

import uuid

import pytest
import redis
from celery import states

from loom.contracts.settings import Settings
from loom.queue import make_celery
from loom.redis_results import LoomRedisBackend
from tests.conftest import REDIS_RESULTS_URL, _reachable

pytestmark = pytest.mark.skipif(
    not _reachable("127.0.0.1", 6379), reason="Redis is not reachable at 127.0.0.1:6379"
)


@pytest.fixture
def app(tmp_path):
    app = make_celery("reward", Settings(data_dir=tmp_path, result_backend=REDIS_RESULTS_URL))
    yield app
    app.close()


def _tid() -> str:
    return f"t-{uuid.uuid4().hex}"


def test_redis_urls_get_the_loom_backend_and_states_round_trip(app):
    backend = app.backend
    assert isinstance(backend, LoomRedisBackend)
    tid = _tid()
    key = backend.get_key_for_task(tid)
    sub = redis.Redis.from_url(REDIS_RESULTS_URL).pubsub()
    sub.subscribe(key)
    assert sub.get_message(timeout=2)["type"] == "subscribe"
    backend.store_result(tid, {"pid": 1}, states.STARTED)
    assert app.AsyncResult(tid).state == "STARTED"
    backend.store_result(tid, {"ok": [1, 2]}, states.SUCCESS)
    res = app.AsyncResult(tid)
    assert res.ready() and res.result == {"ok": [1, 2]}
    published = [sub.get_message(timeout=2) for _ in range(2)]
    assert [backend.decode_result(m["data"])["status"] for m in published] == ["STARTED", "SUCCESS"]
    ttl = backend.client.ttl(key)
    assert 0 < ttl <= backend.expires  # Celery's result_expires, as RedisBackend sets it
    failed = _tid()
    backend.mark_as_failure(failed, ValueError("bad input"))
    assert app.AsyncResult(failed).state == "FAILURE"
    assert isinstance(app.AsyncResult(failed).result, ValueError)
    sub.close()


def test_a_success_is_never_overwritten_and_the_started_store_reports_it(app):
    backend = app.backend
    tid = _tid()
    backend.store_result(tid, None, states.STARTED)
    assert backend.started_found(tid) == (True, None)  # ran, found no result
    assert backend.started_found(tid) == (False, None)  # forgotten once read
    backend.store_result(tid, {"first": True}, states.SUCCESS)
    for state in (states.STARTED, states.FAILURE, states.SUCCESS):
        result = {"second": True} if state != states.FAILURE else ValueError("late duplicate")
        backend.store_result(tid, result, state)
        assert app.AsyncResult(tid).result == {"first": True}
    backend.store_result(tid, None, states.STARTED)
    known, meta = backend.started_found(tid)
    assert known and meta is not None and meta["status"] == "SUCCESS" and meta["result"] == {"first": True}
    assert backend.started_found(_tid()) == (False, None)  # nothing stored from this thread


def test_a_state_change_is_one_redis_round_trip(app, monkeypatch):
    backend = app.backend
    tid = _tid()
    backend.store_result(tid, None, states.STARTED)  # loads the script
    sent: list[str] = []
    client = backend.client
    execute = client.execute_command

    def counted(*args, **kwargs):
        sent.append(str(args[0]))
        return execute(*args, **kwargs)

    monkeypatch.setattr(client, "execute_command", counted)
    monkeypatch.setattr(client, "pipeline", lambda *a, **k: pytest.fail("a pipeline round trip"))
    backend.store_result(tid, {"ok": 1}, states.SUCCESS)
    assert sent == ["EVALSHA"]  # Celery's RedisBackend: GET, then a SETEX + PUBLISH pipeline
    monkeypatch.undo()
    assert app.AsyncResult(tid).result == {"ok": 1}
