"""The Kubernetes manifests under deploy/kubernetes/: schema-valid for real (kubernetes-validate's
bundled OpenAPI schemas, strict: unknown fields fail), and consistent with Baton itself (its config
loader, key schema, URL parser and metric names)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from common.config_loading import load_config
from common.keys import KeySchema
from common.redis_client import connect
from common.redis_url import RedisKind, parse_redis_url
from common.sampling_params import SamplingParams
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.requests import NewRequest
from scheduler_service.store import Store

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUBERNETES_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
NOT_MANIFESTS = {"redis-values.yaml", "redis-cluster-values.yaml", "kustomization.yaml"}


def _documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def _all() -> dict[tuple[str, str], dict[str, Any]]:
    """Every resource of the kustomization and the KEDA file, by (kind, name)."""
    names = [*yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"], "keda-scaledobject.yaml"]
    return {(d["kind"], d["metadata"]["name"]): d for name in names for d in _documents(name)}


def _container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def test_every_yaml_file_is_accounted_for() -> None:
    listed = set(yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in DEPLOY.glob("*.yaml")}
    assert on_disk == listed | NOT_MANIFESTS | {"keda-scaledobject.yaml"}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_core_manifests_pass_strict_schema_validation(version: str) -> None:
    checked = 0
    for resource in _all().values():
        if resource["apiVersion"].startswith("keda.sh/"):
            continue  # KEDA's CRDs have no bundled schema; checked field by field below
        kubernetes_validate.validate(resource, version, strict=True)
        checked += 1
    assert checked >= 9


def test_strict_validation_catches_a_misspelt_field() -> None:
    deployment = _all()[("Deployment", "baton-executor")]
    broken = yaml.safe_load(yaml.safe_dump(deployment).replace("readinessProbe", "readinesProbe"))
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_executor_requests_a_gpu_probes_grpc_and_advertises_its_pod_ip() -> None:
    executor = _all()[("Deployment", "baton-executor")]
    container = _container(executor, "executor")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == port, probe
    assert _env(container)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    config = yaml.safe_load(_all()[("ConfigMap", "baton-config")]["data"]["baton.yaml"])
    assert config["executor"]["port"] == port
    assert "advertise_address" not in config["executor"]  # the POD_IP default is what makes it reachable


def test_scheduler_service_reaches_the_scheduler_pods() -> None:
    resources = _all()
    scheduler = resources[("Deployment", "baton-scheduler")]
    service = resources[("Service", "baton-scheduler")]
    labels = scheduler["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    container = _container(scheduler, "scheduler")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    assert container["readinessProbe"]["grpc"]["port"] == ports["grpc"]
    config = yaml.safe_load(resources[("ConfigMap", "baton-config")]["data"]["baton.yaml"])
    assert config["scheduler"]["port"] == ports["grpc"]
    assert config["monitoring"]["metrics_port"] == ports["metrics"]


def test_configmap_is_a_valid_baton_config_and_the_env_url_parses(tmp_path: Path) -> None:
    resources = _all()
    config_file = tmp_path / "baton.yaml"
    config_file.write_text(resources[("ConfigMap", "baton-config")]["data"]["baton.yaml"])
    secret = resources[("Secret", "baton-secrets")]["stringData"]
    for deployment in ("baton-scheduler", "baton-executor"):
        container = _container(resources[("Deployment", deployment)], deployment.removeprefix("baton-"))
        env = _env(container)
        ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "baton-secrets" and ref["key"] in secret
        url = env["BATON_DISTRIBUTED__REDIS_URL"]["value"].replace("$(REDIS_PASSWORD)", "0123abcd")
        target = parse_redis_url(url)
        assert target.kind is RedisKind.SENTINEL and target.password == "0123abcd"
        config = load_config(config_file, environ={"BATON_DISTRIBUTED__REDIS_URL": url})
        assert config.distributed.redis_url == url
        assert config.security.auth_tokens_file.endswith("/tokens.yaml")
    tokens = yaml.safe_load(secret["tokens.yaml"])
    assert isinstance(tokens, dict) and "*" in tokens.values()


def test_referenced_configmaps_and_secrets_exist() -> None:
    resources = _all()
    text = yaml.safe_dump_all(list(resources.values()))
    secrets = re.findall(r"secretName: (\S+)", text)
    config_maps = re.findall(r"configMap:\n\s+name: (\S+)", text)
    assert secrets and config_maps
    for name in secrets:
        assert ("Secret", name) in resources, name
    for name in config_maps:
        assert ("ConfigMap", name) in resources, name
    for values in ("redis-values.yaml", "redis-cluster-values.yaml"):
        chart = yaml.safe_load((DEPLOY / values).read_text())
        auth = chart.get("auth", chart)
        assert auth["existingSecret"] == "baton-secrets"
        assert auth["existingSecretPasswordKey"] in resources[("Secret", "baton-secrets")]["stringData"]


def test_keda_triggers_name_the_real_queue_and_metrics() -> None:
    scaled = _all()[("ScaledObject", "baton-executor")]
    assert scaled["spec"]["scaleTargetRef"]["name"] == "baton-executor"
    triggers = scaled["spec"]["triggers"]
    redis_trigger = next(t for t in triggers if t["type"].startswith("redis"))
    assert redis_trigger["metadata"]["listName"] == KeySchema().pending
    assert redis_trigger["authenticationRef"]["name"] == "baton-redis"
    exported = {m.name for m in SchedulerMetrics().registry.collect()}
    queries = [t["metadata"]["query"] for t in triggers if t["type"] == "prometheus"]
    assert queries
    for query in queries:
        for metric in re.findall(r"baton:[a-z_]+", query):
            assert metric in exported, f"{metric} is not a metric Baton exports"


async def test_the_queue_is_a_sorted_set_whose_length_keda_reads(redis_url: str) -> None:
    """KEDA's Redis scalers take a sorted set's length with TYPE + ZCARD: the queue must be one."""
    client = connect(redis_url)
    try:
        store = Store(client, KeySchema(), request_ttl_s=60)
        for i in range(3):
            await store.requests.enqueue(
                NewRequest(f"k{i}", (1, 5), SamplingParams(max_tokens=4), 5, "t", 0, i), float(i), 10
            )
        assert await client.type(KeySchema().pending) == "zset"
        assert await client.zcard(KeySchema().pending) == await store.queue.length() == 3
    finally:
        await client.aclose()
