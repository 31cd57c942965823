"""Loom on five hosts without Docker and without a shared filesystem (issue 26 "Must show").

Each host is a network namespace this test makes, wired to a bridge in a sixth namespace with veth
pairs (10.77.0.0/24 exists only inside them):

- broker  10.77.0.1: a private RabbitMQ node and a Redis (the result backend);
- gateway 10.77.0.2: ``loom api gateway`` and ``loom worker reward``;
- rollout-a 10.77.0.3, rollout-b 10.77.0.4: one ``loom worker rollout`` each;
- learner 10.77.0.5: ``loom worker learner`` and ``loom api learner``, which serves the policy store.

Every host has its own data directory, and the learner's is hidden (an empty tmpfs mounted over it in
the process's own mount namespace) on every other host: the rollout hosts get each policy version only
over HTTP (``LOOM_POLICY_STORE_URL``), and the gateway checks versions against the remote manifests.
A three-step RL run must train three versions; both rollout hosts must have pulled each version the run
generated with (only a request naming a version makes a replica pull it), and a job at the newest
version comes back with its trajectories carrying it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RABBITMQ_SERVER

# every wait below is on a condition (a log line, a final status), bounded generously: a loaded machine
# (several suites beside this one) makes each step slow, not wrong
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
SUBNET = "10.77.0"
HOSTS = {"broker": 1, "gateway": 2, "rollout-a": 3, "rollout-b": 4, "learner": 5}
TOKEN = "multihost-service-token"
RUNS_KEY = "loom_multihost_key"
STEPS = 3
LEARNER_PORT = 8404  # the default ports: every host has its own
READY_S = 300  # a process's start (imports, broker connection): on a loaded machine this is minutes
FINAL_S = 300  # the client waits this long for each run or job to end; the client itself, for all


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Cluster:
    """The namespaces, their links and the processes started in them; ``close`` removes all of it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tag = uuid.uuid4().hex[:6]
        self.namespaces: list[str] = []
        self.procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def ns(self, host: str) -> str:
        return f"loom{self.tag}-{host}"

    def addr(self, host: str) -> str:
        return f"{SUBNET}.{HOSTS[host]}"

    def build(self) -> None:
        switch = self.ns("switch")
        ip("netns", "add", switch)
        self.namespaces.append(switch)
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        for host, n in HOSTS.items():
            ns = self.ns(host)
            ip("netns", "add", ns)
            self.namespaces.append(ns)
            # the pair is made in the two namespaces directly: no interface ever exists outside them
            ip(
                "link",
                "add",
                "eth0",
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                f"port{n}",
                "netns",
                switch,
            )
            ip("-n", switch, "link", "set", f"port{n}", "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{SUBNET}.{n}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def start(self, host: str, name: str, argv: list[str], env: dict[str, str], hide: list[Path]) -> Path:
        """``argv`` in ``host``'s namespace, with each of ``hide`` covered by an empty tmpfs."""
        log = self.root / f"{name}.log"
        mounts = " && ".join(f"mount -t tmpfs hidden {p}" for p in hide) or "true"
        wrapped = ["ip", "netns", "exec", self.ns(host), "unshare", "--mount", "--propagation", "private"]
        wrapped += ["sh", "-c", f'{mounts} && exec "$@"', "sh", *argv]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                wrapped, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append((name, proc, log))
        return log

    def run(self, host: str, argv: list[str], stdin: str, timeout: float) -> str:
        try:
            done = subprocess.run(
                ["ip", "netns", "exec", self.ns(host), *argv],
                cwd=REPO,
                input=stdin.encode(),
                capture_output=True,
                timeout=timeout,
                env=clean_env(),
            )
        except subprocess.TimeoutExpired as exc:  # say where the processes were, not only that it hung
            raise AssertionError(f"{argv[1]} still ran after {timeout:.0f} s:{self.logs()}") from exc
        assert done.returncode == 0, done.stderr.decode(errors="replace")[-4000:] + self.logs()
        return done.stdout.decode()

    def wait_for(self, log: Path, line: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if line in log.read_text(errors="replace"):
                return
            if any(p.poll() is not None for _, p, lg in self.procs if lg == log):
                break
            time.sleep(0.2)
        raise AssertionError(f"{log.name} never logged {line!r}:\n{log.read_text(errors='replace')[-3000:]}")

    def logs(self) -> str:
        return "".join(f"\n--- {n} ---\n{lg.read_text(errors='replace')[-1500:]}" for n, _, lg in self.procs)

    def close(self) -> None:
        for _, proc, _ in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for _, proc, _ in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.namespaces:  # what was started inside (epmd daemonizes out of its group)
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOOM_", "RABBITMQ_"))}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def start_broker(cluster: Cluster, broker_dir: Path, hide: list[Path]) -> Path:
    """The broker host: a private RabbitMQ node (guest may log in from other hosts) and a Redis (the
    result backend) on its own address; returns Redis's log (it says when it is ready)."""
    rabbit = broker_dir / "rabbit"
    rabbit.mkdir()
    (rabbit / "enabled_plugins").write_text("[].\n")
    (rabbit / "rabbitmq.conf").write_text(
        f"loopback_users = none\nlisteners.tcp.1 = {cluster.addr('broker')}:5672\n"
    )
    rabbit_env = {
        **clean_env(),
        "HOME": str(rabbit),
        "RABBITMQ_NODENAME": f"loom{cluster.tag}@localhost",
        "RABBITMQ_MNESIA_BASE": str(rabbit / "mnesia"),
        "RABBITMQ_LOG_BASE": str(rabbit / "log"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(rabbit / "enabled_plugins"),
        "RABBITMQ_CONFIG_FILE": str(rabbit / "rabbitmq"),
        "RABBITMQ_ADVANCED_CONFIG_FILE": str(rabbit / "advanced.config"),
        "RABBITMQ_PID_FILE": str(rabbit / "pid"),
    }
    cluster.start("broker", "rabbitmq", [str(RABBITMQ_SERVER)], rabbit_env, hide)
    redis_argv = ["redis-server", "--bind", cluster.addr("broker"), "--port", "6379", "--save", ""]
    redis_argv += ["--appendonly", "no", "--protected-mode", "no", "--dir", str(broker_dir)]
    return cluster.start("broker", "redis", redis_argv, clean_env(), hide)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    probe = f"loomprobe{uuid.uuid4().hex[:6]}"
    tried = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if tried.returncode != 0:
        pytest.skip(f"`ip netns add` is not permitted here (needs root): {tried.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if not RABBITMQ_SERVER.exists() or shutil.which("redis-server") is None:
        pytest.skip("RabbitMQ's server or redis-server is not installed")
    c = Cluster(tmp_path)
    try:
        c.build()
        yield c
    finally:
        c.close()


def test_rollout_hosts_without_a_shared_filesystem_serve_every_policy_version(
    cluster: Cluster, tmp_path: Path
) -> None:
    from gateway.keys import hash_key

    dirs = {host: tmp_path / host for host in HOSTS}
    for d in dirs.values():
        d.mkdir()
    learner_dir = dirs["learner"]
    for host, d in dirs.items():  # no host's directory is inside another's
        assert all(host == other or not d.is_relative_to(o) for other, o in dirs.items())

    hide_learner = [learner_dir]
    redis_log = start_broker(cluster, dirs["broker"], hide_learner)

    # --- the Loom processes: one settings set, each host its own data directory
    base = {
        **clean_env(),
        "LOOM_BROKER_URL": f"amqp://guest:guest@{cluster.addr('broker')}:5672//",
        "LOOM_RESULT_BACKEND": f"redis://{cluster.addr('broker')}:6379/0",
        "LOOM_MODEL": "tiny",
        "LOOM_SERVICE_TOKEN": TOKEN,
        "LOOM_TORCH_THREADS": "1",
        "LOOM_ROLLOUT_CONCURRENCY": "1",  # one group per replica at a time: both replicas get work
        "LOOM_LEARNER_PORT": str(LEARNER_PORT),
    }
    store_url = f"http://{cluster.addr('learner')}:{LEARNER_PORT}"

    def env(host: str, **extra: str) -> dict[str, str]:
        return {**base, "LOOM_DATA_DIR": str(dirs[host]), "LOOM_HOST": cluster.addr(host), **extra}

    remote = {"LOOM_POLICY_STORE_URL": store_url}
    loom = [sys.executable, "-m", "launch.cli"]
    cluster.wait_for(redis_log, "Ready to accept connections", READY_S)
    workers = {
        "learner-worker": ("learner", [*loom, "worker", "learner", "-c", "1"], env("learner"), []),
        "rollout-a": (
            "rollout-a",
            [*loom, "worker", "rollout", "-c", "1"],
            env("rollout-a", **remote),
            hide_learner,
        ),
        "rollout-b": (
            "rollout-b",
            [*loom, "worker", "rollout", "-c", "1"],
            env("rollout-b", **remote),
            hide_learner,
        ),
        "reward-worker": ("gateway", [*loom, "worker", "reward", "-c", "1"], env("gateway"), hide_learner),
    }
    gateway_env = env("gateway", LOOM_API_KEYS=f"runner:{hash_key(RUNS_KEY)}", **remote)
    apis = {
        "learner-api": ("learner", [*loom, "api", "learner"], env("learner"), []),
        "gateway-api": ("gateway", [*loom, "api", "gateway"], gateway_env, hide_learner),
    }
    # Celery retries the broker connection while RabbitMQ boots, so everything starts at once
    logs = {
        name: cluster.start(host, name, argv, e, hide)
        for name, (host, argv, e, hide) in {**workers, **apis}.items()
    }
    for name in workers:
        cluster.wait_for(logs[name], " ready.", READY_S)
    for name in apis:
        cluster.wait_for(logs[name], "Application startup complete", READY_S)

    dataset = "".join(json.dumps({"prompt": f"{a} + {a} = ?", "answer": str(2 * a)}) + "\n" for a in range(8))
    sampling = {"n": 4, "max_tokens": 16, "temperature": 1.3, "seed": 1}
    reward = {"components": [{"name": "accuracy", "weight": 1.0}, {"name": "length_kimi", "weight": 0.5}]}
    plan = {
        "run": {
            "run_key": "multihost",
            "dataset": {"jsonl": dataset},
            "sampling": sampling,
            "reward": reward,
            "estimator": "grpo",
            "schedule": {"steps": STEPS, "batch_size": 4, "staleness": 0},
        },
        "job": {
            "job_key": "multihost-after",
            "tasks": [{"prompt": f"{a} + 1 = ?", "label": str(a + 1)} for a in range(4)],
            "sampling": sampling,
            "reward": reward,
            "policy_version": STEPS,
        },
        "unknown_version_job": {
            "job_key": "multihost-unknown",
            "tasks": [{"prompt": "1 + 1 = ?"}],
            "sampling": sampling,
            "policy_version": 99,
        },
    }
    gateway_url = f"http://{cluster.addr('gateway')}:8400"
    client = [sys.executable, str(HERE / "client.py"), gateway_url, RUNS_KEY, str(FINAL_S)]
    seen = json.loads(cluster.run("gateway", client, json.dumps(plan), timeout=2 * FINAL_S + 60))

    assert seen["run"]["status"] == "succeeded", (seen["run"], cluster.logs())
    assert [m["policy_version"] for m in seen["metrics"]] == list(range(1, STEPS + 1))
    job = seen["job"]
    assert job["status"] == "succeeded", (job, cluster.logs())
    trajectories = [t for g in job["groups"] for t in g["group"]["trajectories"]]
    assert len(trajectories) == 16 and {t["policy_version"] for t in trajectories} == {STEPS}
    # the gateway answered from the remote manifests: version 99 is refused, naming the newest
    refused = seen["unknown_version_job"]
    assert refused["status_code"] == 422 and f"the newest is {STEPS}" in json.dumps(refused["body"])

    lineage = seen["run"]["lineage"]["namespace"]  # the run's versions: its own namespace
    learner_store = learner_dir / "policy" / "ns" / lineage
    # seen through each running process's own mount namespace (/proc/PID/root): the learner's store
    # exists for the learner only
    pids = {name: proc.pid for name, proc, _ in cluster.procs}
    for name in ("rollout-a", "rollout-b", "gateway-api", "reward-worker"):
        view = Path(f"/proc/{pids[name]}/root") / learner_store.relative_to("/")
        assert not view.exists(), f"{name} sees the learner's policy store"
    assert (Path(f"/proc/{pids['learner-api']}/root") / learner_store.relative_to("/") / "v1").is_dir()
    assert sorted(p.name for p in learner_store.glob("v*")) == [f"v{v}" for v in range(1, STEPS + 1)]
    # staleness 0: step k generated with version k, so each replica was asked for versions 1..STEPS-1
    # (and both served the job's groups at STEPS or at least one did: it holds what it was asked for)
    for host in ("rollout-a", "rollout-b"):
        cache = dirs[host] / "policy-cache" / "ns" / lineage
        pulled = sorted(int(p.name[1:]) for p in cache.glob("v*"))
        assert set(range(1, STEPS)) <= set(pulled), (host, pulled, cluster.logs())
        assert not (dirs[host] / "policy").exists()  # nothing read from a local store
        for v in pulled:  # the same bytes as the learner's, which this host could never see
            for f in json.loads((learner_store / f"v{v}" / "manifest.json").read_text()):
                if f["path"] != "policy.json":
                    assert (cache / f"v{v}" / f["path"]).read_bytes() == (
                        learner_store / f"v{v}" / f["path"]
                    ).read_bytes()
    assert not (dirs["gateway"] / "policy-cache").exists()  # the gateway pulled nothing


def test_a_version_uploaded_through_the_gateway_is_served_by_a_rollout_host_without_the_store(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Issue 34: a trainer on the gateway host publishes two versions of a checkpoint through the
    gateway (which forwards them to the learner's store); a rollout host that sees neither the
    trainer's files nor the store pulls the version each job names, and the trajectories carry it,
    "exact" included. A tampered upload is refused and the versions stay as they were."""
    from gateway.keys import hash_key
    from zoo.registry import resolve_model_path

    hosts = ("broker", "gateway", "rollout-a", "learner")
    dirs = {host: tmp_path / host for host in hosts}
    for d in dirs.values():
        d.mkdir()
    checkpoint = dirs["gateway"] / "trainer" / "step"
    shutil.copytree(resolve_model_path("tiny"), checkpoint)  # the trainer's checkpoint, on its host
    hidden = [dirs["learner"], dirs["gateway"]]  # the store's host, and the uploader's
    redis_log = start_broker(cluster, dirs["broker"], hidden)
    key = "loom_multihost_trainer_key"
    base = {
        **clean_env(),
        "LOOM_BROKER_URL": f"amqp://guest:guest@{cluster.addr('broker')}:5672//",
        "LOOM_RESULT_BACKEND": f"redis://{cluster.addr('broker')}:6379/0",
        "LOOM_MODEL": "tiny",
        "LOOM_SERVICE_TOKEN": TOKEN,
        "LOOM_TORCH_THREADS": "1",
        "LOOM_LEARNER_PORT": str(LEARNER_PORT),
    }
    remote = {"LOOM_POLICY_STORE_URL": f"http://{cluster.addr('learner')}:{LEARNER_PORT}"}

    def env(host: str, **extra: str) -> dict[str, str]:
        return {**base, "LOOM_DATA_DIR": str(dirs[host]), "LOOM_HOST": cluster.addr(host), **extra}

    loom = [sys.executable, "-m", "launch.cli"]
    cluster.wait_for(redis_log, "Ready to accept connections", READY_S)
    keys = {"LOOM_API_KEYS": f"trainer:{hash_key(key)}:jobs+policy"}
    procs = {
        "learner-api": ("learner", [*loom, "api", "learner"], env("learner"), [dirs["gateway"]]),
        "rollout-a": (
            "rollout-a",
            [*loom, "worker", "rollout", "-c", "1"],
            env("rollout-a", **remote),
            hidden,
        ),
        "reward-worker": (
            "gateway",
            [*loom, "worker", "reward", "-c", "1"],
            env("gateway"),
            [dirs["learner"]],
        ),
        "gateway-api": (
            "gateway",
            [*loom, "api", "gateway"],
            env("gateway", **remote, **keys),
            [dirs["learner"]],
        ),
    }
    logs = {name: cluster.start(host, name, argv, e, hide) for name, (host, argv, e, hide) in procs.items()}
    for name in ("rollout-a", "reward-worker"):
        cluster.wait_for(logs[name], " ready.", READY_S)
    for name in ("learner-api", "gateway-api"):
        cluster.wait_for(logs[name], "Application startup complete", READY_S)

    sampling = {"n": 2, "max_tokens": 8, "temperature": 1.0, "seed": 1}
    job = {"tasks": [{"prompt": "1 + 1 = ?", "label": "2"}], "sampling": sampling}
    plan = {
        "jobs": [
            {**job, "job_key": "at-2", "at": [2, "at_least"]},
            {**job, "job_key": "exactly-1", "at": [1, "exact"]},
        ]
    }
    gateway_url = f"http://{cluster.addr('gateway')}:8400"
    client = [
        sys.executable,
        str(HERE / "publish_client.py"),
        gateway_url,
        key,
        str(FINAL_S),
        str(checkpoint),
    ]
    seen = json.loads(cluster.run("gateway", client, json.dumps(plan), timeout=2 * FINAL_S + 120))

    assert [(r["namespace"], r["version"]) for r in seen["refs"]] == [("trainer", 1), ("trainer", 2)]
    put, commit = seen["tampered"]["put"], seen["tampered"]["commit"]
    assert put[0] == 422 and put[1]["error"] == "integrity_error" and "model.safetensors" in put[1]["detail"]
    assert commit[0] == 422 and [r["version"] for r in seen["listed"]] == [1, 2]
    for view, want in zip(seen["jobs"], (2, 1), strict=True):
        assert view["status"] == "succeeded", (view, cluster.logs())
        carried = {
            (t["policy_namespace"], t["policy_version"])
            for g in view["groups"]
            for t in g["group"]["trajectories"]
        }
        assert carried == {("trainer", want)}, (carried, cluster.logs())

    store = dirs["learner"] / "policy" / "ns" / "trainer"
    cache = dirs["rollout-a"] / "policy-cache" / "ns" / "trainer"
    assert sorted(p.name for p in store.glob("v*")) == ["v1", "v2"]
    assert sorted(p.name for p in cache.glob("v*")) == ["v1", "v2"]  # pulled each version a job named
    for v in ("v1", "v2"):  # the trainer's bytes, which the rollout host could never see
        for f in json.loads((store / v / "manifest.json").read_text()):
            assert (cache / v / f["path"]).read_bytes() == (checkpoint / f["path"]).read_bytes()
    pids = {name: proc.pid for name, proc, _ in cluster.procs}
    for other in (dirs["learner"], dirs["gateway"]):
        view = Path(f"/proc/{pids['rollout-a']}/root") / other.relative_to("/") / "policy"
        assert (
            not view.exists()
            and not (Path(f"/proc/{pids['rollout-a']}/root") / checkpoint.relative_to("/")).exists()
        )
    assert not (dirs["gateway"] / "policy").exists()  # the gateway forwarded, and kept nothing
