"""docker-compose.yml is checked statically (Docker does not run here): every Loom container runs a real
``loom`` entrypoint and sets only real settings; only the gateway is published; GPUs where needed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from env_svc.config import EnvSettings
from gateway.config import GatewaySettings
from launch import SERVICE_PACKAGES
from launch.cli import COMMANDS
from learner.config import LearnerSettings
from loom.contracts.reward_settings import RewardSettings
from loom.contracts.settings import SERVICES, Settings
from rollout_svc.config import RolloutSettings, VllmSettings

# each role's own settings (learner/config.py, gateway/config.py, rollout_svc/config.py) are LOOM_<ROLE>_*
# variables too
ROLE_VARIABLES = {
    f"{role.model_config['env_prefix']}{name.upper()}"
    for role in (LearnerSettings, GatewaySettings, RolloutSettings, VllmSettings, RewardSettings, EnvSettings)
    for name in role.model_fields
}
REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / "deploy" / "loom.env.example"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
INFRA = {"rabbitmq", "redis", "vllm", "flower"}
GPU_SERVICES = {"vllm", "learner"}
INTERPOLATION = re.compile(r"\$\{([A-Z0-9_]+)(?::?-[^}]*)?\}")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def loom_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose["services"].items() if name not in INFRA}


def _gpu_reserved(svc: dict[str, Any]) -> bool:
    devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return any("gpu" in d.get("capabilities", []) for d in devices)


def _env(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): str(v) for k, v in env.items()}


def test_compose_has_the_whole_stack(compose: dict[str, Any], loom_services: dict[str, Any]) -> None:
    assert INFRA <= set(compose["services"])
    assert {"gateway", "rollout", "reward", "reflect", "learner"} <= set(loom_services)


def test_every_loom_command_is_a_real_entrypoint(loom_services: dict[str, Any]) -> None:
    roles: dict[str, set[str]] = {svc: set() for svc in SERVICES}
    for name, svc in loom_services.items():
        cmd = svc["command"]
        assert isinstance(cmd, list) and cmd[0] == "loom", (name, cmd)
        assert cmd[1] in COMMANDS, (name, cmd)
        assert cmd[1] in ("api", "worker"), f"{name}: services run `loom api` or `loom worker`, not {cmd[1]}"
        assert cmd[2] in SERVICES, (name, cmd)
        roles[cmd[2]].add(cmd[1])
        assert svc["image"].startswith("loom:") and svc["build"]["dockerfile"] == "deploy/Dockerfile", name
    assert all(r == {"api", "worker"} for r in roles.values()), (
        f"each service needs an API and a worker: {roles}"
    )


def test_every_loom_variable_is_a_setting(loom_services: dict[str, Any]) -> None:
    fields = {f"LOOM_{name.upper()}" for name in Settings.model_fields} | ROLE_VARIABLES
    for name, svc in loom_services.items():
        env = _env(svc)
        assert env, f"{name} sets no environment"
        for var in env:
            assert var.startswith("LOOM_"), f"{name}: {var} (Loom containers take LOOM_* variables only)"
            assert var in fields, f"{name}: {var} is not a setting (Settings or a role's own class)"
        assert env.get("LOOM_BROKER_URL", "").startswith("amqp://"), name


def test_env_example_variables_are_used_by_compose() -> None:
    used = set(INTERPOLATION.findall(COMPOSE.read_text()))
    used |= set(INTERPOLATION.findall((REPO / "deploy" / "compose.flower.yml").read_text()))
    example = [
        line.split("=", 1)[0]
        for line in ENV_EXAMPLE.read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert example, "the example env file is empty"
    for var in example:
        assert var.startswith("LOOM_"), var
        assert var in used, f"{var} in loom.env.example is not used by the compose files"
    assert used <= set(example), f"compose variables missing from the example: {sorted(used - set(example))}"


def test_only_the_gateway_publishes_a_port(compose: dict[str, Any], loom_services: dict[str, Any]) -> None:
    published = {name for name, svc in compose["services"].items() if svc.get("ports")}
    assert published == {"gateway"}, published
    assert loom_services["gateway"]["command"][:3] == ["loom", "api", "gateway"]


def test_rollout_scales(loom_services: dict[str, Any]) -> None:
    rollout = loom_services["rollout"]
    assert "container_name" not in rollout
    assert rollout["command"][:3] == ["loom", "worker", "rollout"]
    assert not rollout.get("ports")


def test_the_learner_takes_its_ranks_from_a_setting(compose: dict[str, Any]) -> None:
    """`loom worker learner` reads --nproc from LOOM_LEARNER_NPROC (launch/cli.py): one rank per GPU."""
    from learner.config import LearnerSettings

    env = _env(compose["services"]["learner"])
    assert env["LOOM_LEARNER_NPROC"] == "${LOOM_LEARNER_NPROC:-1}"
    assert env["LOOM_LEARNER_SHARDING"] == "${LOOM_LEARNER_SHARDING:-replicate}"
    assert LearnerSettings(nproc=2, sharding="fsdp").nproc == 2
    cpu = yaml.load((REPO / "deploy" / "compose.cpu.yml").read_text(), Loader=_ComposeTagLoader)
    assert _env(cpu["services"]["learner"])["LOOM_LEARNER_NPROC"] == "${LOOM_LEARNER_NPROC:-1}"
    assert _env(cpu["services"]["learner"])["LOOM_DEVICE"] == "cpu"


def test_gpu_reservations(compose: dict[str, Any]) -> None:
    for name in GPU_SERVICES:
        assert _gpu_reserved(compose["services"][name]), name
    for name in ("gateway", "reward", "reflect", "rollout", "flower", "redis", "rabbitmq"):
        assert not _gpu_reserved(compose["services"][name]), name


def test_vllm_serves_runtime_loras(compose: dict[str, Any]) -> None:
    vllm = compose["services"]["vllm"]
    assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+", vllm["image"]), "pin a vLLM version"
    assert vllm["environment"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "--enable-lora" in vllm["command"]
    assert vllm["command"][0].startswith("${LOOM_MODEL"), "the model comes from the environment"


def test_vllm_runs_the_version_and_flags_loom_drives(compose: dict[str, Any]) -> None:
    """docs/vllm.md: vLLM 0.32, dev mode, Loom's worker extension on PYTHONPATH, the log-prob mode
    and cached-token counts."""
    from rollout_svc.engines.vllm import VLLM_VERSION
    from rollout_svc.engines.vllm_launch import WORKER_EXTENSION

    vllm = compose["services"]["vllm"]
    assert vllm["image"] == f"vllm/vllm-openai:v{VLLM_VERSION}"
    assert vllm["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
    assert f"--worker-extension-cls={WORKER_EXTENSION}" in vllm["command"]
    assert any(c.startswith("--logprobs-mode=") for c in vllm["command"])
    assert "--enable-prompt-tokens-details" in vllm["command"]
    root = vllm["environment"]["PYTHONPATH"]
    assert any(
        v.startswith("./rollout_svc:") and v.split(":")[1] == f"{root}/rollout_svc" for v in vllm["volumes"]
    )


def test_healthchecks_and_dependency_conditions(
    compose: dict[str, Any], loom_services: dict[str, Any]
) -> None:
    services = compose["services"]
    for name, svc in services.items():
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    assert "rabbitmq-diagnostics" in services["rabbitmq"]["healthcheck"]["test"]
    assert "redis-cli" in services["redis"]["healthcheck"]["test"]
    for name, svc in loom_services.items():
        test = " ".join(svc["healthcheck"]["test"])
        role, service = svc["command"][1], svc["command"][2]
        if role == "api":
            port = Settings().service_port(service)
            assert f"curl -fsS http://localhost:{port}/readyz" in test, (name, test)
        else:  # the worker answers a ping addressed to the node name its command sets
            node = svc["command"][svc["command"].index("-n") + 1].split("@")[0]
            # through loom.ping's light app: the worker's own module (torch for the learner) took longer
            # to import than the check's time limit on a loaded host
            assert f"celery -A loom.ping:celery_app inspect ping -d {node}@" in test, (
                name,
                test,
            )
        depends = svc.get("depends_on", {})
        for dep in ("rabbitmq", "redis"):
            assert depends.get(dep, {}).get("condition") == "service_healthy", (name, dep)
    for name in ("rollout", "reflect"):
        assert services[name]["depends_on"]["vllm"]["condition"] == "service_healthy"


def test_dockerfile_builds_cpu_and_cuda_variants() -> None:
    text = DOCKERFILE.read_text()
    assert "ARG VARIANT" in text and "cpu)" in text and "cuda)" in text
    # the CPU variant installs torch's CPU wheel that deploy/images/build.sh copies into the context
    assert "COPY deploy/images/wheels/ /tmp/wheels/" in text and "--find-links /tmp/wheels" in text
    for pkg in ("loom", "launch", *SERVICE_PACKAGES.values()):
        assert f"COPY {pkg} ./{pkg}" in text, pkg
    assert "curl" in text, "API healthchecks use curl"


def test_every_image_is_built_from_the_local_base() -> None:
    """No registry is needed: every FROM names the base image deploy/images/build.sh imports, and no
    `# syntax=` line sends BuildKit to a registry for its frontend."""
    build = (REPO / "deploy" / "images" / "build.sh").read_text()
    assert "debootstrap --variant=minbase" in build and "docker import" in build
    dockerfiles = [DOCKERFILE, *sorted((REPO / "deploy" / "images").glob("*.Dockerfile"))]
    assert len(dockerfiles) >= 4, dockerfiles  # loom, rabbitmq, redis, vllm-cpu
    for path in dockerfiles:
        text = path.read_text()
        assert "ARG BASE_IMAGE=loom/debian:bookworm" in text, path
        assert [ln for ln in text.splitlines() if ln.startswith("FROM")] == ["FROM ${BASE_IMAGE}"], path
        assert "# syntax" not in text, path
        assert path.name in build or path == DOCKERFILE, f"build.sh does not build {path.name}"


def test_cpu_profile_runs_local_images_and_publishes_only_the_gateway(compose: dict[str, Any]) -> None:
    cpu = yaml.load((REPO / "deploy" / "compose.cpu.yml").read_text(), Loader=_ComposeTagLoader)
    services = cpu["services"]
    assert set(services) <= set(compose["services"]), "the CPU file only overrides services"
    for name, svc in services.items():
        if name == "flower":  # mher/flower is not built here: the CPU profile leaves it out by default
            assert svc["profiles"] == ["flower"]
            continue
        assert svc["image"].startswith(("loom:", "loom/")), (name, svc["image"])
        assert svc["pull_policy"] == "never", name
        if name not in INFRA:
            assert svc["image"] == "loom:cpu" and _env(svc)["LOOM_MODEL"] == "tiny", name
    # the torch engine behind vLLM's protocol takes the vllm service's place, on its port
    vllm = services["vllm"]
    assert vllm["entrypoint"] == ["loom", "engine"] and "--port" in vllm["command"]
    assert vllm["command"][vllm["command"].index("--port") + 1] == "8000"
    assert services["learner"]["deploy"] == {} and services["vllm"]["deploy"] == {}, "no GPU reservation"
    published = {name for name, svc in services.items() if svc.get("ports")}
    assert published == {"gateway"}, published
    assert services["gateway"]["ports"] == ["127.0.0.1:${LOOM_GATEWAY_PORT:-8400}:8400"]
    for name, svc in compose["services"].items():  # init: a PID 1 that reaps and forwards signals
        if name != "flower":
            assert svc.get("init") is True or services[name].get("init") is True, name


class _ComposeTagLoader(yaml.SafeLoader):
    """Reads compose's merge tags (!reset, !override) as the value they carry."""


def _tagged(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)  # type: ignore[arg-type]


for _tag in ("!reset", "!override"):
    _ComposeTagLoader.add_constructor(_tag, _tagged)


def test_every_path_the_dockerfile_copies_is_in_its_build_context() -> None:
    """deploy/images/build.sh stages the image's context path by path: a package the Dockerfile copies
    but the stage line leaves out fails the build (``COPY failed: file not found``)."""
    build = (REPO / "deploy" / "images" / "build.sh").read_text()
    body = build[build.index("build_loom() {") :]
    line = next(ln for ln in body.splitlines() if ln.strip().startswith('stage "$ctx"'))  # loom's image
    staged = set(line.split()[2:])
    copied = {
        parts[1].rstrip("/").split("/")[0]
        for ln in DOCKERFILE.read_text().splitlines()
        if (parts := ln.split()) and parts[0] == "COPY" and not parts[1].startswith("deploy/")
    }
    assert copied <= staged, copied - staged
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests", "bench"}
    assert packages <= copied, packages - copied  # every first-party package goes into the image
