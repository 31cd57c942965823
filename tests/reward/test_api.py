"""The HTTP API in-process: routes, statuses, limits (413/422), and a fuzz test with zero 5xx."""

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reward_svc.api import app


@pytest.fixture(scope="module")
def client():
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def group(texts, label="42", gid="g", **kw):
    trajs = [{"id": f"t{i}", "group_id": gid, "text": t} for i, t in enumerate(texts)]
    return {"id": gid, "label": label, "trajectories": trajs, **kw}


def test_rewards_returns_every_component_total_and_status(client):
    body = {
        "groups": [group(["<think>ok</think> \\boxed{42}", "<think>hmm</think> \\boxed{41}", "nothing"])],
        "spec": {
            "components": [{"name": "accuracy"}, {"name": "format_think", "weight": 0.5}],
            "timeout_s": 3,
        },
    }
    r = client.post("/v1/rewards", json=body)
    assert r.status_code == 200
    (res,) = r.json()["results"]
    rows = res["rewards"]
    assert [x["components"]["accuracy"] for x in rows] == [1.0, 0.0, 0.0]
    assert [x["components"]["format_think"] for x in rows] == [1.0, 1.0, 0.0]
    assert [x["total"] for x in rows] == [1.5, 0.5, 0.0]
    assert [x["status"] for x in rows] == ["ok", "ok", "no_answer"]


def test_exact_tasks_use_loom_verifier(client):
    cd = group(["\\boxed{(3+4)*2}", "\\boxed{3*4+2}"], label=json.dumps({"numbers": [2, 3, 4], "target": 14}))
    cd["task"] = "countdown"
    ar = group(["\\boxed{7/2}", "\\boxed{3.4}"], label="3.5", gid="h")
    ar["task"] = "arithmetic"
    r = client.post("/v1/rewards", json={"groups": [cd, ar]}).json()["results"]
    assert [x["total"] for x in r[0]["rewards"]] == [1.0, 1.0]
    assert [x["total"] for x in r[1]["rewards"]] == [1.0, 0.0]


def test_choice_task(client):
    g = group(["The answer is (B).", "\\boxed{C}"], label="B")
    g["task"] = "choice"
    r = client.post("/v1/rewards", json={"groups": [g]}).json()["results"][0]["rewards"]
    assert [x["total"] for x in r] == [1.0, 0.0]


def test_openrlhf_protocol(client):
    body = {"query": ["Q? \\boxed{42}", "Q? \\boxed{1}"], "prompts": ["Q?", "Q?"], "labels": ["42", "42"]}
    r = client.post("/get_reward", json=body).json()
    assert r["rewards"] == [1.0, 0.0] and r["scores"] == [1.0, 0.0]
    assert r["extra_logs"]["accuracy"] == [1.0, 0.0]


def test_openrlhf_answer_comes_from_the_response_not_the_prompt(client):
    body = {"query": ["Is it \\boxed{42}? I say 41"], "prompts": ["Is it \\boxed{42}?"], "labels": ["42"]}
    assert client.post("/get_reward", json=body).json()["rewards"] == [0.0]


def test_slime_protocol(client):
    r = client.post("/v1/slime/reward", json={"prompt": "p", "response": "\\boxed{42}", "label": "42"})
    assert r.status_code == 200 and r.json() == 1.0
    body = {"prompt": "p", "response": "\\boxed{42}", "label": "42"}
    r = client.post("/v1/slime/reward/components", json=body).json()
    assert r["reward"] == 1.0 and r["status"] == "ok" and r["accuracy"] == 1.0


def test_limits_413_for_the_request_and_a_status_for_an_item(client, monkeypatch):
    from reward_svc import api

    monkeypatch.setattr(api._settings, "max_items", 3)
    monkeypatch.setattr(api._settings, "max_chars", 100)
    r = client.post("/v1/rewards", json={"groups": [group(["a"] * 4)]})
    assert r.status_code == 413 and r.json()["error"] == "payload_too_large"
    r = client.post("/get_reward", json={"query": ["q"] * 4})
    assert r.status_code == 413 and r.json()["detail"][0]["loc"] == ["body", "query"]
    # one text over max_chars: that item is invalid with reward 0, the others score
    r = client.post("/v1/rewards", json={"groups": [group(["\\boxed{42}", "b" * 101, "\\boxed{42}"])]})
    assert r.status_code == 200
    rows = r.json()["results"][0]["rewards"]
    assert [x["status"] for x in rows] == ["ok", "invalid", "ok"]
    assert [x["total"] for x in rows] == [1.0, 0.0, 1.0]
    assert "longer than 100 characters" in rows[1]["detail"]
    r = client.post("/v1/rewards", json={"groups": [group(["\\boxed{4}"], label="4" * 101)]})
    assert r.status_code == 200 and r.json()["results"][0]["rewards"][0]["status"] == "invalid"
    r = client.post("/get_reward", json={"query": ["x" * 101, "\\boxed{7}"], "labels": ["7", "7"]})
    assert r.status_code == 200
    assert r.json()["rewards"] == [0.0, 1.0] and r.json()["extra_logs"]["status_ok"] == [0.0, 1.0]
    r = client.post("/v1/slime/reward/components", json={"prompt": "p", "response": "r", "label": "4" * 101})
    assert r.status_code == 200 and r.json()["status"] == "invalid" and r.json()["reward"] == 0.0
    r = client.post("/v1/rewards/match", json={"label": "4" * 101, "texts": ["4"]})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "label"]


def test_bad_spec_is_422_with_the_path(client):
    r = client.post(
        "/v1/rewards", json={"groups": [group(["a"])], "spec": {"components": [{"name": "nope"}]}}
    )
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "name"
    spec = {"components": [{"name": "reflection", "params": {"q": 2}}]}
    r = client.post("/v1/rewards", json={"groups": [group(["a"])], "spec": spec})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-2:] == ["params", "q"]


def test_tail_chars_out_of_bounds_is_422_with_the_path(client):
    for bad in (0, -5, 10**6):
        spec = {"components": [{"name": "accuracy", "params": {"tail_chars": bad}}]}
        r = client.post("/v1/rewards", json={"groups": [group(["a"])], "spec": spec})
        assert r.status_code == 422
        assert r.json()["detail"][0]["loc"] == ["body", "spec", "components", 0, "params", "tail_chars"]


def test_hostile_numbers_and_labels_are_statuses_not_500(client):
    huge = "1" * 5000
    cd = group(["\\boxed{1+2}"], label="[" * 5000)
    cd["task"] = "countdown"
    ar = group(["\\boxed{" + huge + "}"], label="3", gid="h")
    ar["task"] = "arithmetic"
    r = client.post("/v1/rewards", json={"groups": [cd, ar]})
    assert r.status_code == 200
    assert [res["rewards"][0]["status"] for res in r.json()["results"]] == ["invalid", "parse_error"]
    inf = (
        '{"groups":[{"id":"g","task":"countdown","meta":{"numbers":[1,2],"target":Infinity},'
        '"trajectories":[{"id":"t","group_id":"g","text":"\\\\boxed{1+2}"}]}]}'
    )
    r = client.post("/v1/rewards", content=inf, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["results"][0]["rewards"][0]["status"] == "invalid"
    r = client.post("/v1/rewards/match", json={"label": huge, "task": "arithmetic", "texts": ["3"]})
    assert r.status_code == 200 and r.json()["verdicts"][0]["status"] == "invalid"
    body = {"query": ["\\boxed{" + huge + "}"], "labels": ["3"], "task": "arithmetic"}
    r = client.post("/get_reward", json=body)
    assert r.status_code == 200 and r.json()["rewards"] == [0.0]
    body = {"response": "\\boxed{3}", "label": huge, "task": "arithmetic"}
    r = client.post("/v1/slime/reward/components", json=body)
    assert r.status_code == 200 and r.json()["status"] == "invalid"


# ---------------------------------------------------------------- fuzz: thousands of requests, no 5xx

_names = st.sampled_from(
    [
        "accuracy",
        "format_stream",
        "format_deep",
        "format_think",
        "format_spawn",
        "length_kimi",
        "length_refined",
        "length_stream",
        "length_deep",
        "efficiency",
        "reflection",
        "bogus",
    ]
)
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=6,
)
_params = st.dictionaries(
    st.sampled_from(["alpha", "tau", "q", "d_q", "variant", "task", "keywords", "cluster_chars", "x"]),
    _json,
    max_size=2,
)
_markers = st.sampled_from(
    ["<EOS>", "<EOT>", "<EOR>", "<EOA>", "<ignore>", "<think>", "</think>", "\\boxed{", "}", "{"]
)
_text = st.lists(st.text(max_size=12) | _markers, max_size=8).map("".join)
_seg = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["stream", "deep", "answer", "thread", "bogus"]),
        "start": st.integers(-1, 6),
        "end": st.integers(-1, 8),
    },
    optional={"meta": st.fixed_dictionaries({"text": _text})},
)
_traj = st.fixed_dictionaries(
    {"id": st.text(min_size=0, max_size=6), "group_id": st.just("g")},
    optional={
        "text": _text,
        "completion_ids": st.lists(st.integers(0, 9), max_size=8),
        "segments": st.lists(_seg, max_size=3),
    },
)
_group = st.fixed_dictionaries(
    {"id": st.just("g"), "trajectories": st.lists(_traj, max_size=4)},
    optional={
        "label": st.text(max_size=10) | st.sampled_from(["42", "\\frac12", '{"numbers":[1,2],"target":3}']),
        "task": st.sampled_from(["math", "choice", "countdown", "arithmetic", "other"]),
        "meta": st.dictionaries(st.sampled_from(["numbers", "target"]), _json, max_size=2),
    },
)
_spec = st.fixed_dictionaries(
    {
        "components": st.lists(
            st.fixed_dictionaries(
                {"name": _names},
                optional={"weight": st.floats(allow_nan=False, allow_infinity=False), "params": _params},
            ),
            max_size=4,
        )
    },
    optional={"timeout_s": st.integers(-1, 3)},
)
_chat = st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": _text}), max_size=3)
_requests = st.one_of(
    st.tuples(
        st.just("/v1/rewards"),
        st.fixed_dictionaries({"groups": st.lists(_group, max_size=2)}, optional={"spec": _spec}),
    ),
    st.tuples(
        st.just("/get_reward"),
        st.fixed_dictionaries(
            {"query": st.lists(_text, max_size=3)},
            optional={
                "prompts": st.lists(_text, max_size=3),
                "labels": st.lists(_json, max_size=3),
            },
        ),
    ),
    st.tuples(
        st.sampled_from(["/v1/slime/reward", "/v1/slime/reward/components"]),
        st.fixed_dictionaries(
            {"response": _text},
            optional={
                "prompt": _text | _chat,
                "label": _json,
            },
        ),
    ),
    st.tuples(st.sampled_from(["/v1/rewards", "/get_reward", "/v1/slime/reward"]), _json),
)


@settings(max_examples=1200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(req=_requests)
def test_fuzz_never_5xx(client, req):
    path, body = req
    r = client.post(path, json=body)
    assert r.status_code < 500, (path, body, r.text)
    assert r.status_code in (200, 413, 422), r.status_code


def test_non_json_numbers_and_lone_surrogates_are_client_errors(client):
    nan = '{"groups":[{"id":"g"}],"spec":{"components":[{"name":"accuracy","weight":NaN}]}}'
    r = client.post("/v1/rewards", content=nan, headers={"content-type": "application/json"})
    assert r.status_code == 422
    sur = (
        '{"groups":[{"id":"g\\ud800","trajectories":'
        '[{"id":"t","group_id":"g\\ud800","text":"\\\\boxed{1}"}]}]}'
    )
    r = client.post("/v1/rewards", content=sur, headers={"content-type": "application/json"})
    assert r.status_code == 422
