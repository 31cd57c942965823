"""The run page in a real headless browser (issue 28 "Must show"): Debian's chromium driven by
playwright, against the real stack (gateway, rollout with the torch engine on the tiny model, reward,
learner; embedded broker) started by ``launch.stack.Stack`` as ``loom demo`` does.

Logs in through the form, opens a running demo-sized run and sees its curve gain points as steps finish,
opens a tree job and a spawn job and finds their nodes. Screenshots go to ``test-artifacts/run-page/``
at the repository root (git-ignored); their folder is printed. Without a session the pages hold no data
(also checked with plain httpx)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))
from helpers import API_KEYS, RUNS_KEY, auth, free_port  # noqa: E402

from gateway.datasets import load_dataset  # noqa: E402
from gateway.models import DatasetSpec  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # a stack start and a 6-step run

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts" / "run-page"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
STEPS = 6
WAIT_S = 600.0  # a generous bound for a loaded 2-core machine; nothing asserts a duration


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from launch.stack import Stack
    from loom.contracts.settings import Settings

    data = tmp_path_factory.mktemp("run-page")
    ports = {f"{svc}_port": free_port() for svc in ("gateway", "rollout", "reward", "reflect", "learner")}
    settings = Settings(
        data_dir=data, broker_url="embedded", result_backend="embedded", api_keys=API_KEYS, **ports
    )
    env = {"LOOM_DATA_DIR": str(data), "LOOM_DEVICE": "cpu", "LOOM_ENGINE_LOGPROBS_MODE": "processed"}
    services = ("gateway", "rollout", "reward", "learner")
    with Stack(settings, services=services, env=env, ready_timeout=300.0, grace=5.0) as stack:
        yield stack.urls()["gateway"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed (deploy/setup.sh installs Debian's chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def submit(url: str, path: str, body: dict[str, Any]) -> str:
    r = httpx.post(url + path, json=body, headers=auth(RUNS_KEY), timeout=60.0)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def wait_job(url: str, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        view = httpx.get(f"{url}/v1/jobs/{job_id}", headers=auth(RUNS_KEY), timeout=30.0).json()
        if view["status"] in ("succeeded", "failed", "cancelled"):
            return dict(view)
        time.sleep(1.0)
    raise AssertionError(f"job {job_id} did not end")


def shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)
    print(f"screenshot: {ARTIFACTS / name}")


def test_a_request_without_a_key_gets_no_page_data(gateway_url: str) -> None:
    run_id = submit(
        gateway_url,
        "/v1/runs",
        {
            "run_key": "no-key-probe",
            "dataset": {"builtin": "arith", "size": 8},
            "schedule": {"steps": 1, "batch_size": 1},
        },
    )
    for path in ("/ui/", f"/ui/runs/{run_id}"):
        r = httpx.get(gateway_url + path, follow_redirects=False, timeout=30.0)
        assert r.status_code == 303 and r.headers["location"] == "/ui/login" and run_id not in r.text
    for path in (f"/ui/runs/{run_id}/events", f"/ui/runs/{run_id}/steps.json", f"/v1/runs/{run_id}"):
        r = httpx.get(gateway_url + path, timeout=30.0)
        assert r.status_code == 401 and run_id not in r.text, path
    login = httpx.get(gateway_url + "/ui/login", timeout=30.0)
    assert login.status_code == 200 and run_id not in login.text


def test_the_browser_follows_a_run_and_shows_trees_and_spawn_forests(gateway_url: str, browser: Any) -> None:
    if ARTIFACTS.exists():
        shutil.rmtree(ARTIFACTS)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(gateway_url + "/ui/")
    assert page.url.endswith("/ui/login")  # no session yet: the form, no data
    page.fill("#api_key", RUNS_KEY)
    page.click("#login")
    page.wait_for_url("**/ui/")
    assert RUNS_KEY not in page.url
    cookie = next(c for c in page.context.cookies() if c["name"] == "loom_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["value"] != RUNS_KEY
    # logged in first, so the run page opens while the run's first steps are still going
    run_id = submit(
        gateway_url,
        "/v1/runs",
        {
            "run_key": "browser-run",
            "dataset": {"builtin": "arith", "size": 64, "seed": 0},
            "sampling": {"n": 4, "max_tokens": 48, "temperature": 1.3},
            "reward": {"components": [{"name": "accuracy", "weight": 1.0}]},
            "schedule": {"steps": STEPS, "batch_size": 2, "staleness": 1},
        },
    )
    page.reload()
    shot(page, "index.png")
    page.click(f"a[href='/ui/runs/{run_id}']")
    page.wait_for_url(f"**/ui/runs/{run_id}")

    # the curve gains points while the run goes: a count seen before the end, then more
    seen: list[int] = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        n = page.evaluate("window.loomRun.points.length")
        if not seen or n != seen[-1]:
            seen.append(n)
            if 0 < n < STEPS and not (ARTIFACTS / "run-live.png").exists():
                page.wait_for_selector("div.chart")
                shot(page, "run-live.png")
        if n >= STEPS:
            break
        page.wait_for_timeout(500)
    assert seen[-1] == STEPS, f"points seen: {seen}"
    assert any(0 < n < STEPS for n in seen), f"the page never showed a run in progress: {seen}"
    page.wait_for_selector("#run-status.s-succeeded", timeout=WAIT_S * 1000)
    chart = page.evaluate(
        "(() => { const c = window.loomRun.charts['reward per component'];"
        " return {keys: c.keys, x: c.plot.data[0].length}; })()"
    )
    assert "reward/accuracy" in chart["keys"] and chart["x"] == STEPS
    assert page.inner_text("#points") == str(STEPS)
    page.reload()  # the samples of the last step, rendered by the server
    assert page.locator("tr.sample").count() > 0  # prompt, response, reward breakdown, status
    first = page.inner_text("tr.sample >> nth=0")
    assert "accuracy" in first and any(s in first for s in ("ok", "parse_error", "no_answer", "timeout"))
    page.wait_for_selector("#run-status.s-succeeded")  # the stream's end: every chart is drawn
    shot(page, "run-done.png")

    # a tree rollout and a spawn rollout, as jobs
    arith = load_dataset(DatasetSpec(builtin="arith", size=8, seed=3), "tree")[:2]
    tree_id = submit(
        gateway_url,
        "/v1/jobs",
        {
            "job_key": "browser-tree",
            "tasks": [t.model_dump(mode="json") for t in arith],
            "mode": "tree",
            "mode_params": {
                "initial": 2,
                "branches": 2,
                "continuations": 2,
                "strategy": "entropy",
                "min_distance": 4,
            },
            "sampling": {"n": 2, "max_tokens": 48, "temperature": 1.3},
        },
    )
    countdown = load_dataset(DatasetSpec(builtin="countdown", size=8, seed=3), "spawn")[:1]
    spawn_id = submit(
        gateway_url,
        "/v1/jobs",
        {
            "job_key": "browser-spawn",
            "tasks": [t.model_dump(mode="json") for t in countdown],
            "mode": "spawn",
            "sampling": {"n": 2, "max_tokens": 128, "temperature": 1.0},
        },
    )
    streaming = load_dataset(DatasetSpec(builtin="arith", size=8, seed=3), "streaming")[:1]
    stream_id = submit(
        gateway_url,
        "/v1/jobs",
        {
            "job_key": "browser-streaming",
            "tasks": [t.model_dump(mode="json") for t in streaming],
            "mode": "streaming",
            "sampling": {"n": 2, "max_tokens": 48, "temperature": 1.0},
        },
    )
    for job_id, kind in ((tree_id, "tree"), (spawn_id, "forest")):
        view = wait_job(gateway_url, job_id)
        assert view["status"] == "succeeded", json.dumps(view)[:2000]
        group = view["groups"][0]["group"]
        expected = (
            [n["id"] for n in group["tree"]] if kind == "tree" else [t["id"] for t in group["trajectories"]]
        )
        page.goto(f"{gateway_url}/ui/jobs/{job_id}")
        shown = page.eval_on_selector_all(
            f"section.group[data-group='{group['id']}'] li.{kind}-node", "els => els.map(e => e.dataset.node)"
        )
        assert sorted(shown) == sorted(expected)
        if kind == "tree":
            # every branch's first node names its branch point and the entropy that chose it
            n_branches = sum(1 for t in group["trajectories"] if t.get("parent_id"))
            assert n_branches > 0
            assert (
                page.locator(f"section.group[data-group='{group['id']}'] li.branch .bp").count() == n_branches
            )
            assert "entropy" in page.inner_text(
                f"section.group[data-group='{group['id']}'] li.branch .bp >> nth=0"
            )
        else:
            links = group["threads"] or []
            nested = page.locator(f"section.group[data-group='{group['id']}'] li.forest-node li.forest-node")
            assert nested.count() == len(links)
        shot(page, f"job-{kind}.png")

    # streaming segments are coloured where they are: one bar span per stream segment
    view = wait_job(gateway_url, stream_id)
    assert view["status"] == "succeeded", json.dumps(view)[:2000]
    segments = [s for g in view["groups"] for t in g["group"]["trajectories"] for s in t["segments"]]
    page.goto(f"{gateway_url}/ui/jobs/{stream_id}")
    for kind in ("stream", "answer"):
        expected = sum(1 for s in segments if s["kind"] == kind)
        assert page.locator(f"div.segbar span.seg-{kind}").count() == expected
    assert page.locator("div.segbar span.seg-stream").count() > 0
    shot(page, "job-streaming.png")
