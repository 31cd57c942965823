"""The reflect API's errors: bad input the schemas let through is a 422 naming the field, a failed
rollout or reward service a typed 503, a bug of this service a typed 500 (never an upstream outage)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from reflect_helpers import trace_group  # noqa: E402

import reflect_svc.api  # noqa: E402
from reflect_svc.backends import HTTPServices  # noqa: E402


def reflect(url, group, params=None):
    body = {"group": group.model_dump(mode="json")}
    if params is not None:
        body["params"] = params
    return httpx.post(url + "/v1/reflect", json=body, timeout=120)


def one(tok, **update):
    g = trace_group(tok, "arith", n=1, seed=8)
    t = g.trajectories[0].model_copy(update=update)
    return g.model_copy(update={"trajectories": [t]})


@pytest.mark.parametrize("bad", [-1, 2**40, 523])
def test_token_ids_outside_the_vocabulary_are_a_422_naming_the_field(tok, reflect_url, bad):
    """They were a 503 upstream_error: decode's OverflowError went through a blanket except."""
    assert len(tok) == 523
    g = one(tok, completion_ids=[5, bad, 6], logprobs=None, loss_mask=None)
    r = reflect(reflect_url, g)
    assert r.status_code == 422, r.text
    (err,) = r.json()["detail"]
    assert r.json()["error"] == "validation_error"
    assert err["loc"] == ["body", "group", "trajectories", 0, "completion_ids", 1]
    # -1 is refused by the schema itself (token ids are >= 0), the others by the vocabulary check
    assert str(bad) in err["msg"] or (bad < 0 and "greater than or equal to 0" in err["msg"])
    r = reflect(reflect_url, one(tok, prompt_ids=[bad]))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-2:] == ["prompt_ids", 0]


@pytest.mark.parametrize(
    ("params", "loc"),
    [
        ({"min_chunk_tokens": 500, "max_chunk_tokens": 1}, ["body", "params", "max_chunk_tokens"]),
        ({"detector": "heuristic", "keywords": ["wait", ""]}, ["body", "params", "keywords", 1]),
        ({"detector": "heuristic", "keywords": [" "]}, ["body", "params", "keywords", 0]),
    ],
)
def test_nonsense_params_are_a_422(tok, reflect_url, params, loc):
    r = reflect(reflect_url, one(tok), params)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == loc


def test_a_bug_of_the_service_is_a_typed_500_not_an_upstream_outage(tok, reflect_url, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(reflect_svc.api, "revise_group", broken)
    r = reflect(reflect_url, one(tok))
    assert r.status_code == 500
    assert r.json()["error"] == "internal_error" and "KeyError" not in r.text


def test_a_down_rollout_service_is_a_typed_503(tok, reflect_url, reward_url, monkeypatch):
    def services(*args, **kwargs):
        s = HTTPServices("http://127.0.0.1:9", reward_url)  # nothing listens on the rollout side
        s.rollout.retries = 0
        return s

    monkeypatch.setattr(reflect_svc.api, "make_services", services)
    r = reflect(reflect_url, one(tok), {"min_chunk_tokens": 8})
    assert r.status_code == 503, r.text
    assert r.json()["error"] == "rollout_error"
