"""The test's client on the gateway host (run with ``ip netns exec``): reads a plan from stdin, runs
it against the gateway at argv[1] with API key argv[2], prints what it saw as one JSON line.

Plan: {"run": RunRequest, "job": JobRequest, "unknown_version_job": JobRequest}: the run to its end
(its final view and metrics), then the job to its end (its view), then the submission that must fail;
both jobs name the run's lineage (its namespace, the run's id), where its versions are."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import httpx


def wait_final(client: httpx.Client, path: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        view: dict[str, Any] = client.get(path).json()
        if view["status"] in ("succeeded", "failed", "cancelled"):
            return view
        if time.monotonic() > deadline:
            return view
        time.sleep(0.5)


def main() -> None:
    url, key, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
    plan = json.load(sys.stdin)
    out: dict[str, Any] = {}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
        r = client.post("/v1/runs", json=plan["run"])
        r.raise_for_status()
        run_id = r.json()["id"]
        out["run"] = wait_final(client, f"/v1/runs/{run_id}", timeout)
        out["metrics"] = client.get(f"/v1/runs/{run_id}/metrics").json()
        for job in ("job", "unknown_version_job"):
            plan[job]["policy_namespace"] = out["run"]["lineage"]["namespace"]
        r = client.post("/v1/jobs", json=plan["job"])
        r.raise_for_status()
        out["job"] = wait_final(client, f"/v1/jobs/{r.json()['id']}", timeout)
        r = client.post("/v1/jobs", json=plan["unknown_version_job"])
        out["unknown_version_job"] = {"status_code": r.status_code, "body": r.json()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
