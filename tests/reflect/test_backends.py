"""The services over HTTP and the queues: verifier requests in batches the reward service accepts,
and a failed rollout or reward call as a typed ``ServiceError`` (the API's 503)."""

from __future__ import annotations

from typing import Any

import pytest
from celery.exceptions import TimeoutError as CeleryTimeout

from loom.contracts.wire import Group, RewardSpec, RolloutRequest
from reflect_svc.backends import HTTPServices, QueueServices, match_batches
from reflect_svc.revise import ServiceError


class FakeResult:
    def __init__(self, value: Any) -> None:
        self.value = value

    def get(self, **kw: Any) -> Any:
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


class FakeApp:
    """A Celery app whose tasks answer at once: ``answer(name, args)``."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.sent: list[tuple[str, list[Any]]] = []

    def send_task(self, name: str, args: list[Any], **kw: Any) -> FakeResult:
        self.sent.append((name, args))
        return FakeResult(self.answer(name, args))


def test_match_batches_cap_texts_and_characters_in_order():
    texts = [str(i) * (1 + i % 3) for i in range(10)]
    batches = match_batches(texts, 4, 1000)
    assert [len(b) for b in batches] == [4, 4, 2] and sum(batches, []) == texts
    assert match_batches(["aaaa", "bb", "cc", "dddddd", "e"], 10, 5) == [
        ["aaaa"],
        ["bb", "cc"],
        ["dddddd"],
        ["e"],
    ]
    assert match_batches([], 4, 10) == []


def test_a_large_group_is_verified_in_batches_over_http(reward_url):
    """80 trajectories x 53 chunks went in one request over the reward service's 4096-text cap: every
    trajectory got verifier_error."""
    texts = [f"Then the result is {7 if i % 53 == 52 else 3}." for i in range(80 * 53)]
    services = HTTPServices("http://127.0.0.1:9", reward_url)
    try:
        verdicts = services.match(Group(id="g", label="7", task="arithmetic"), texts)
    finally:
        services.close()
    assert verdicts == [i % 53 == 52 for i in range(80 * 53)]


def test_a_large_group_is_verified_in_batches_over_the_queue():
    def answer(name: str, args: list[Any]) -> Any:
        texts = args[0]["texts"]
        assert name == "reward.match_texts" and len(texts) <= 4096
        return {"verdicts": [{"status": "ok", "correct": t.endswith("7.")} for t in texts]}

    app = FakeApp(answer)
    texts = [f"It is {7 if i % 3 == 0 else 1}." for i in range(9000)]
    assert QueueServices(app).match(Group(id="g", label="7"), texts) == [i % 3 == 0 for i in range(9000)]
    assert [len(a[0]["texts"]) for _, a in app.sent] == [4096, 4096, 808]


def test_failed_rollout_and_reward_calls_are_typed_service_errors():
    down = HTTPServices("http://127.0.0.1:9", "http://127.0.0.1:9")  # nothing listens there
    down.rollout.retries = down.reward.retries = 0
    request = RolloutRequest(prompt_ids=[5, 6])
    with pytest.raises(ServiceError) as err:
        down.complete([request])
    assert err.value.status == "rollout_error"
    with pytest.raises(ServiceError) as err:
        down.score(Group(id="g"), RewardSpec())
    assert err.value.status == "reward_error"
    down.close()

    queue = QueueServices(FakeApp(lambda name, args: CeleryTimeout("no answer")))
    with pytest.raises(ServiceError) as err:
        queue.complete([request])
    assert err.value.status == "rollout_error"
    with pytest.raises(ServiceError) as err:
        queue.score(Group(id="g"), RewardSpec())
    assert err.value.status == "reward_error"
    queue = QueueServices(FakeApp(lambda name, args: {"not": "a group"}))
    with pytest.raises(ServiceError) as err:
        queue.complete([request])
    assert err.value.status == "rollout_error"
