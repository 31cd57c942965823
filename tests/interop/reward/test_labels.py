"""The documented coercion of trainers' labels and chat prompts (loom/interop.py,
docs/interop-reward.md), and what the protocol routes do with what they cannot read."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from fastapi.testclient import TestClient
from omegaconf import OmegaConf

from loom.interop import LabelError, label_text, message_text


@pytest.mark.parametrize(
    "value, text",
    [
        ("5", "5"),
        ("", ""),
        (None, None),
        (5, "5"),
        (5.0, "5"),
        (0.5, "0.5"),
        (-3, "-3"),
        (np.int64(12), "12"),
        (np.float32(2.5), "2.5"),
        ({"numbers": np.array([1, 2, 4]), "target": np.int64(12)}, '{"numbers": [1, 2, 4], "target": 12}'),
        (["1/2", 0.5], '["1/2", 0.5]'),
        (OmegaConf.create({"target": 3}), '{"target": 3}'),
        ("\\frac{1}{2}", "\\frac{1}{2}"),
    ],
)
def test_label_text(value, text) -> None:
    assert label_text(value) == text


@pytest.mark.parametrize(
    "value", [True, np.bool_(False), float("nan"), float("inf"), {"x": float("nan")}, object()]
)
def test_unreadable_labels_raise_label_error(value) -> None:
    with pytest.raises(LabelError):
        label_text(value)


def test_message_text_flattens_chat_messages_and_content_parts() -> None:
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "2+3?"}]},
    ]
    assert message_text(chat) == "Be brief.\n2+3?"
    assert message_text("plain") == "plain"


@pytest.fixture(scope="module")
def client():
    from reward_svc.api import app

    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def test_a_malformed_protocol_request_is_422_and_logged_for_the_operator(client, caplog) -> None:
    # OpenRLHF and slime log only the status code and retry 5 / 10 times: the reason is in the service's log
    with caplog.at_level(logging.WARNING, logger="reward_svc.api"):
        r = client.post("/v1/slime/reward", json={"prompt": "p", "label": "1"})  # no response
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "response"]
    assert any("/v1/slime/reward refused (422)" in m and "response" in m for m in caplog.messages)
    with caplog.at_level(logging.WARNING, logger="reward_svc.api"):
        r = client.post("/get_reward", json={"query": ["a", "b"], "labels": ["1"]})
    assert r.status_code == 422 and "1 entries for 2 queries" in r.text
    assert any("/get_reward refused (422)" in m for m in caplog.messages)


def test_an_unknown_task_in_the_url_is_422_naming_it(client) -> None:
    r = client.post("/get_reward?task=chess", json={"query": ["a"]})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "task"]
