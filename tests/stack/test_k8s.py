"""deploy/k8s is checked offline: every manifest against the Kubernetes 1.32 JSON schemas
(kubernetes-validate, strict: no unknown field), KEDA's objects against tests/stack/keda_schema.json,
the NetworkPolicies' meaning (only the gateway reachable from outside the namespace), GPU requests,
and that the manifests and docker-compose.yml name the same images, commands and LOOM_* settings."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from env_svc.config import EnvSettings
from gateway.config import GatewaySettings
from learner.config import LearnerSettings
from loom.contracts.reward_settings import RewardSettings
from loom.contracts.settings import SERVICES, Settings
from loom.queue import queue_name
from rollout_svc.config import RolloutSettings, VllmSettings

# each role's own settings (learner/config.py, gateway/config.py, rollout_svc/config.py) are LOOM_<ROLE>_*
# variables too
ROLE_VARIABLES = {
    f"{role.model_config['env_prefix']}{name.upper()}"
    for role in (LearnerSettings, GatewaySettings, RolloutSettings, VllmSettings, RewardSettings, EnvSettings)
    for name in role.model_fields
}
REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
COMPOSE = REPO / "docker-compose.yml"
KUBERNETES_VERSION = "1.32.0"  # pinned: a schema set kubernetes-validate ships (1.25 .. 1.37 in 1.37.0)
KEDA_KINDS = {"ScaledObject", "TriggerAuthentication"}
WORKLOADS = {"Deployment", "StatefulSet"}
GPU_CONTAINERS = {"vllm", "learner"}
NOT_ON_KUBERNETES = {"flower": "a debugging UI: `kubectl port-forward` to a Flower you run when you need it"}
# LOOM_* settings the manifests add to compose's: the remote policy store instead of a shared volume
# across nodes (docs/kubernetes.md), and the internal routes' token compose leaves to `loom up`
K8S_ONLY_SETTINGS = {"LOOM_POLICY_STORE_URL", "LOOM_POLICY_CACHE", "LOOM_SERVICE_TOKEN"}
# values that differ on purpose: a rollout pod talks to the vLLM in its own pod
DIFFERENT_VALUES = {("rollout", "LOOM_ENGINE_URL"): "http://127.0.0.1:8000"}
INTERPOLATION = re.compile(r"\$\{[A-Z0-9_]+(?::?-([^}]*))?\}")


def load_all() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


@pytest.fixture(scope="module")
def docs() -> list[tuple[str, dict[str, Any]]]:
    return load_all()


def by_kind(docs: list[tuple[str, dict[str, Any]]], *kinds: str) -> list[dict[str, Any]]:
    return [d for _, d in docs if d["kind"] in kinds]


def containers(docs: list[tuple[str, dict[str, Any]]]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Every (non-init) container by name, with its workload."""
    out: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for w in by_kind(docs, *WORKLOADS):
        for c in w["spec"]["template"]["spec"]["containers"]:
            assert c["name"] not in out, f"two containers are named {c['name']}"
            out[c["name"]] = (c, w)
    return out


def one(docs: list[tuple[str, dict[str, Any]]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in by_kind(docs, kind) if d["metadata"]["name"] == name]
    return found


def container_env(c: dict[str, Any], docs: list[tuple[str, dict[str, Any]]]) -> dict[str, str | None]:
    """The container's variables: a literal value, or None when it comes from the secret."""
    env: dict[str, str | None] = {}
    for ref in c.get("envFrom", []):
        env.update(one(docs, "ConfigMap", ref["configMapRef"]["name"])["data"])
    for e in c.get("env", []):
        env[e["name"]] = e.get("value")
    return env


def resolve(value: Any) -> Any:
    """A compose value with each ${VAR:-default} replaced by its default (what runs with no env file)."""
    if isinstance(value, list):
        return [resolve(v) for v in value]
    return INTERPOLATION.sub(lambda m: m.group(1) or "", str(value))


def test_every_manifest_is_valid_for_the_pinned_kubernetes_version(
    docs: list[tuple[str, dict[str, Any]]],
) -> None:
    checked = 0
    for name, doc in docs:
        if doc["kind"] in KEDA_KINDS:
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        assert doc["metadata"].get("namespace") == "loom" or doc["kind"] == "Namespace", name
        checked += 1
    kinds = {d["kind"] for _, d in docs}
    assert {"Deployment", "StatefulSet", "Service", "Secret", "ConfigMap", "NetworkPolicy"} <= kinds
    assert checked >= 20


def test_the_validator_refuses_an_unknown_field(docs: list[tuple[str, dict[str, Any]]]) -> None:
    bad = copy.deepcopy(one(docs, "Deployment", "gateway"))
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    assert kustomization["namespace"] == "loom"


def test_keda_scales_the_rollout_pods_on_the_rollout_queue(docs: list[tuple[str, dict[str, Any]]]) -> None:
    schemas = json.loads((Path(__file__).parent / "keda_schema.json").read_text())
    for doc in by_kind(docs, *KEDA_KINDS):
        schema = {**schemas[doc["kind"]], "definitions": schemas["definitions"]}
        jsonschema.validate(doc, schema)
    (scaled,) = by_kind(docs, "ScaledObject")
    target = one(docs, "Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    names = {c["name"] for c in target["spec"]["template"]["spec"]["containers"]}
    assert "rollout" in names and "replicas" in target["spec"]
    (trigger,) = scaled["spec"]["triggers"]
    # the queue a rollout pod consumes: its own settings (the manifests'), not this shell's LOOM_* variables
    rollout_env = container_env(containers(docs)["rollout"][0], docs)
    namespace = rollout_env.get("LOOM_QUEUE_NAMESPACE") or Settings.model_fields["queue_namespace"].default
    assert trigger["type"] == "rabbitmq" and trigger["metadata"]["queueName"] == queue_name(
        "rollout", Settings(queue_namespace=namespace)
    )
    auth = one(docs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    secret = one(docs, "Secret", "loom-secrets")
    refs = {r["parameter"]: r for r in auth["spec"]["secretTargetRef"]}
    assert refs["host"]["name"] == "loom-secrets" and refs["host"]["key"] in secret["stringData"]
    assert secret["stringData"][refs["host"]["key"]].startswith("amqp://")


def test_the_keda_schema_refuses_a_misspelt_field(docs: list[tuple[str, dict[str, Any]]]) -> None:
    schemas = json.loads((Path(__file__).parent / "keda_schema.json").read_text())
    bad = copy.deepcopy(by_kind(docs, "ScaledObject")[0])
    bad["spec"]["triggers"][0]["metadata"]["queue"] = bad["spec"]["triggers"][0]["metadata"].pop("queueName")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, {**schemas["ScaledObject"], "definitions": schemas["definitions"]})


def test_the_learner_pod_sets_its_ranks(docs: list[tuple[str, dict[str, Any]]]) -> None:
    learner, _ = containers(docs)["learner"]
    env = container_env(learner, docs)
    assert env["LOOM_LEARNER_NPROC"] == "1" and env["LOOM_LEARNER_SHARDING"] == "replicate"
    assert learner["resources"]["limits"]["nvidia.com/gpu"] == int(env["LOOM_LEARNER_NPROC"])


def test_gpus_are_requested_by_vllm_and_the_learner_only(docs: list[tuple[str, dict[str, Any]]]) -> None:
    for name, (c, _) in containers(docs).items():
        gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        assert (gpus == 1) == (name in GPU_CONTAINERS), name


def test_only_the_gateway_is_reachable_from_outside_the_namespace(
    docs: list[tuple[str, dict[str, Any]]],
) -> None:
    policies = by_kind(docs, "NetworkPolicy")

    def selects(policy: dict[str, Any], labels: dict[str, str]) -> bool:
        want = policy["spec"]["podSelector"].get("matchLabels", {})
        assert not policy["spec"]["podSelector"].get("matchExpressions")
        return all(labels.get(k) == v for k, v in want.items())

    def outside_allowed(rule: dict[str, Any]) -> bool:
        """A rule lets in traffic from outside the namespace unless every peer is a bare podSelector."""
        peers = rule.get("from")
        return not peers or any(set(p) != {"podSelector"} for p in peers)

    for w in by_kind(docs, *WORKLOADS):
        labels = w["spec"]["template"]["metadata"]["labels"]
        mine = [p for p in policies if selects(p, labels) and "Ingress" in p["spec"]["policyTypes"]]
        assert mine, f"{w['metadata']['name']} has no ingress policy: open to everyone"
        public = [r for p in mine for r in p["spec"].get("ingress", []) if outside_allowed(r)]
        if w["metadata"]["name"] == "gateway":
            assert public and all([pt["port"] for pt in r["ports"]] == [8400] for r in public)
        else:
            assert not public, w["metadata"]["name"]
    exposed = [
        s["metadata"]["name"]
        for s in by_kind(docs, "Service")
        if s["spec"].get("type") in ("LoadBalancer", "NodePort")
    ]
    assert exposed == ["gateway"]


def test_every_reference_names_an_object_and_every_loom_variable_is_a_setting(
    docs: list[tuple[str, dict[str, Any]]],
) -> None:
    fields = {f"LOOM_{name.upper()}" for name in Settings.model_fields} | ROLE_VARIABLES
    secret = one(docs, "Secret", "loom-secrets")
    for _, doc in docs:
        if doc["kind"] == "ConfigMap":
            assert set(doc["data"]) <= fields, set(doc["data"]) - fields
    for name, (c, _) in containers(docs).items():
        for e in c.get("env", []):
            if ref := e.get("valueFrom", {}).get("secretKeyRef"):
                assert ref["name"] == "loom-secrets" and ref["key"] in secret["stringData"], (name, e)
            if e["name"].startswith("LOOM_"):
                assert e["name"] in fields, f"{name}: {e['name']} is not a setting"
        for ref in c.get("envFrom", []):
            one(docs, "ConfigMap", ref["configMapRef"]["name"])
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    workloads = by_kind(docs, *WORKLOADS)
    for s in services.values():  # each Service selects a pod that listens on its port
        sel = s["spec"]["selector"]
        pods = [
            w
            for w in workloads
            if all(w["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in sel.items())
        ]
        ports = {
            p["containerPort"]
            for w in pods
            for c in w["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])
        }
        assert {p.get("targetPort", p["port"]) for p in s["spec"]["ports"]} <= ports, s["metadata"]["name"]
    for c, _ in containers(docs).values():  # every URL names a Service of the stack (or the pod itself)
        for value in container_env(c, docs).values():
            if value and "://" in value:
                host = re.sub(r"^\w+://([^@/]*@)?", "", value).split(":")[0].split("/")[0]
                assert host in services or host == "127.0.0.1", value


def test_manifests_and_compose_name_the_same_images_commands_and_settings(
    docs: list[tuple[str, dict[str, Any]]],
) -> None:
    compose = yaml.safe_load(COMPOSE.read_text())["services"]
    default = {name: svc for name, svc in compose.items() if not svc.get("profiles")}  # the GPU stack
    pods = containers(docs)
    assert set(default) - set(NOT_ON_KUBERNETES) == set(pods), "compose services and containers differ"
    roles: dict[str, set[str]] = {svc: set() for svc in SERVICES}
    for name, (c, _) in pods.items():
        svc = default[name]
        assert c["image"] == resolve(svc["image"]), name
        if "entrypoint" in svc:
            assert c["command"] == resolve(svc["entrypoint"]), name
        assert c.get("args") == (resolve(svc["command"]) if "command" in svc else None), name
        if c["image"].startswith("loom:"):
            assert c["args"][0] == "loom" and c["args"][1] in ("api", "worker") and c["args"][2] in SERVICES
            roles[c["args"][2]].add(c["args"][1])
            compose_env = {k: resolve(v) for k, v in svc["environment"].items()}
            ours = container_env(c, docs)
            assert set(compose_env) <= set(ours), (name, set(compose_env) - set(ours))
            assert set(ours) - set(compose_env) <= K8S_ONLY_SETTINGS, (name, set(ours) - set(compose_env))
            for var in set(compose_env) & set(ours):
                if ours[var] is None:  # from the secret: compose interpolates it from the env file
                    continue
                expected = DIFFERENT_VALUES.get((name, var), compose_env[var])
                assert ours[var] == expected, (name, var, ours[var], compose_env[var])
    assert all(r == {"api", "worker"} for r in roles.values()), roles
