"""The trainer of the publishing test, on the gateway host (run with ``ip netns exec``): publishes the
checkpoint at argv[4] twice through the gateway at argv[1] with API key argv[2], tries a tampered
upload, runs the jobs of the plan read from stdin at those versions, prints what it saw as one JSON
line (wait for each job at most argv[3] seconds).

Plan: {"jobs": [JobRequest without policy fields, with "at": [version, match]]}."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import httpx

from loom.clients.policies import PolicyPublisher
from tests.multihost.client import wait_final


def main() -> None:
    url, key, timeout, checkpoint = sys.argv[1], sys.argv[2], float(sys.argv[3]), Path(sys.argv[4])
    plan = json.load(sys.stdin)
    out: dict[str, Any] = {}
    publisher = PolicyPublisher(url, key, part_bytes=256 * 1024)  # the weights go in several parts
    refs = [publisher.publish_dir(checkpoint, meta={"step": step}) for step in (1, 2)]
    out["refs"] = [r.model_dump(mode="json") for r in refs]
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        weights = (checkpoint / "model.safetensors").read_bytes()
        declared = {
            "path": "model.safetensors",
            "size": len(weights),
            "sha256": hashlib.sha256(weights).hexdigest(),
        }
        ticket = client.post("/v1/policies/uploads", json={"files": [declared]}).json()
        tampered = weights[:-1] + bytes([weights[-1] ^ 0xFF])
        put = client.put(
            f"/v1/policies/uploads/{ticket['upload_id']}/files/model.safetensors", content=tampered
        )
        commit = client.post(f"/v1/policies/uploads/{ticket['upload_id']}/commit")
        out["tampered"] = {
            "put": [put.status_code, put.json()],
            "commit": [commit.status_code, commit.json()],
        }
        out["listed"] = client.get("/v1/policies").json()
        out["jobs"] = []
        for job in plan["jobs"]:
            version, match = job.pop("at")
            body = {
                **job,
                "policy_namespace": refs[0].namespace,
                "policy_version": version,
                "policy_match": match,
            }
            r = client.post("/v1/jobs", json=body)
            r.raise_for_status()
            out["jobs"].append(wait_final(client, f"/v1/jobs/{r.json()['id']}", timeout))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
