"""Fair share of the rollout tier across keys, through the real gateway process, the real broker and
a real ``loom worker rollout`` (torch engine, tiny model) and ``loom worker reward``: a flood of key
A's groups queued, key B's single group is published to the broker before A's remaining ones (the
order asserted from the gateway's own publish marks, ``LOOM_TIMELINE``), and a gateway killed with
SIGKILL while groups wait in its fair queue loses none of them (the jobs are resumed from the
database; docs/operations.md "Fair share")."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import API_KEYS, JOBS_KEY, RUNS_KEY, GatewayProcess, real_services, wait_until  # noqa: E402

FLOOD = 6  # key A's prompts
SAMPLING = {"n": 2, "max_tokens": 12, "temperature": 1.0, "seed": 1}
GENERATE_KEY = re.compile(r"^(job-[0-9a-f]+)\.p(\d+)\.p0$")  # prompt i's generation (not .score)


def _job(key: str, prompts: int) -> dict[str, Any]:
    return {"job_key": key, "prompts": [f"Compute {i}+2." for i in range(prompts)], "sampling": SAMPLING}


def _published(timeline: Path) -> list[tuple[str, int]]:
    """(job id, prompt) of every generation task the gateway published, in order."""
    out: list[tuple[str, int]] = []
    if not timeline.exists():
        return out
    for line in timeline.read_text().splitlines():
        mark = json.loads(line)
        found = GENERATE_KEY.match(mark.get("key", ""))
        if mark["event"] == "published" and found:
            out.append((found.group(1), int(found.group(2))))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("broker_env", ["embedded"], indirect=True)
def test_a_small_job_is_dispatched_before_a_flood_and_a_restart_loses_no_waiting_group(
    broker_env: Any, loom_worker: Callable[..., Any], tmp_path: Path
) -> None:
    timeline = tmp_path / "timeline.jsonl"
    broker_env.extra_env.update(
        LOOM_API_KEYS=API_KEYS, LOOM_TIMELINE=str(timeline), LOOM_GATEWAY_ROLLOUT_WINDOW="1"
    )
    with real_services(broker_env, loom_worker, tmp_path, services=("reward",)) as gw:
        _scenario(gw, broker_env, loom_worker, tmp_path)


def _scenario(gw: GatewayProcess, broker_env: Any, loom_worker: Callable[..., Any], tmp_path: Path) -> None:
    timeline = tmp_path / "timeline.jsonl"
    # no rollout worker yet: A's first group waits in the broker, the rest of the flood and B's
    # group in the gateway's fair queue
    a = gw.post("/v1/jobs", JOBS_KEY, _job("flood", FLOOD))
    assert a.status_code == 201, a.text
    wait_until(lambda: _published(timeline), 30, "the flood's first group published")
    b = gw.post("/v1/jobs", RUNS_KEY, _job("small", 1))
    assert b.status_code == 201, b.text
    a_id, b_id = a.json()["id"], b.json()["id"]
    time.sleep(1.0)  # B's job has asked for its group: it must still wait (the window is full)
    assert _published(timeline) == [(a_id, 0)]

    gw.kill()  # SIGKILL with groups waiting in the fair queue: they live only in memory
    timeline.write_text("")
    gw.start()  # resumes both jobs from the database
    loom_worker("rollout", broker_env)
    for job_id, key in ((a_id, JOBS_KEY), (b_id, RUNS_KEY)):
        view = wait_until(
            lambda job_id=job_id, key=key: (
                (v := gw.get(f"/v1/jobs/{job_id}", key).json())["status"] in ("succeeded", "failed") and v
            ),
            180,
            f"job {job_id} to end",
        )
        assert view["status"] == "succeeded", (view, gw.log_path.read_text()[-3000:])
    a_view = gw.get(f"/v1/jobs/{a_id}", JOBS_KEY).json()
    b_view = gw.get(f"/v1/jobs/{b_id}", RUNS_KEY).json()
    # nothing accepted was lost: every prompt of both jobs has its scored group
    assert sorted(g["index"] for g in a_view["groups"]) == list(range(FLOOD))
    assert [g["index"] for g in b_view["groups"]] == [0]
    assert all(len(g["group"]["trajectories"]) == SAMPLING["n"] for g in a_view["groups"] + b_view["groups"])

    order = _published(timeline)
    # the resumed flood asks for all its groups first (the oldest job resumes first); B's one group
    # still goes out after at most one turn of A, not after A's whole flood (first come first served)
    b_at = order.index((b_id, 0))
    assert b_at <= 2, order
    later = {p for j, p in order[b_at + 1 :] if j == a_id}
    assert len(later) >= FLOOD - 3, order
