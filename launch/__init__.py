"""The launcher: the one package above the services, the only one that names them all.

``loom`` (``launch.cli``) starts each service's API and worker, ``launch.stack`` the whole stack on one
machine, ``launch.demo`` a short RL run through it. The shared core ``loom`` and the services never
import this package, and no service imports another (tests/test_architecture.py).
"""

from __future__ import annotations

# Package name of each service; `uvicorn <package>.api:app` starts its API.
SERVICE_PACKAGES: dict[str, str] = {
    "gateway": "gateway",
    "rollout": "rollout_svc",
    "reward": "reward_svc",
    "reflect": "reflect_svc",
    "learner": "learner",
    "sandbox": "sandbox_svc",
    "env": "env_svc",
}
