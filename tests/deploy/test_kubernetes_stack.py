"""The Kubernetes manifests run for real on loopback, with auth on as they ship.

The ConfigMap's config, the Secret's tokens and fleet secret, and each Deployment's args, env and
mounts are what the services start from; what a pod's container mounts is materialized under a
temporary directory, so a file the config names but the pod does not mount fails the test. The
only substitutions are the ones a laptop forces: the fixture's Redis for the cluster's Sentinel,
loopback ports for the pods' fixed ones, the tiny model on CPU in float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import redis.asyncio as aioredis
import yaml

from baton.cli import build_parser
from common.config import BatonConfig
from common.config_loading import load_config, with_overrides
from common.pb import executor_pb2 as epb
from common.pb import executor_pb2_grpc
from common.security import fleet_secret, load_tokens
from executor_service.server import start_executor
from scheduler_service.server import start_scheduler
from tests.deploy.test_kubernetes import _all, _container
from tests.gateway.serving import serve_gateway
from tests.stack import eventually


class Pod:
    """One Deployment's container: its args, its BATON_* env and the files its volumes mount."""

    def __init__(self, resources: dict[tuple[str, str], dict[str, Any]], name: str, root: Path) -> None:
        deployment = resources[("Deployment", f"baton-{name}")]
        spec = deployment["spec"]["template"]["spec"]
        self.container = _container(deployment, name)
        self.root = root
        self.files: set[str] = set()
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for mount in self.container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "configMap" in volume:
                source, items = resources[("ConfigMap", volume["configMap"]["name"])]["data"], None
            elif "secret" in volume:
                source = resources[("Secret", volume["secret"]["secretName"])]["stringData"]
                items = volume["secret"].get("items")
            else:
                continue  # emptyDir: models, caches
            paths = {i["path"]: i["key"] for i in items} if items else {key: key for key in source}
            if "subPath" in mount:
                self._write(mount["mountPath"], source[paths[mount["subPath"]]])
            else:
                for path, key in paths.items():
                    self._write(f"{mount['mountPath']}/{path}", source[key])

    def _write(self, pod_path: str, text: str) -> None:
        self.files.add(pod_path)
        local = self.root / pod_path.lstrip("/")
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(text)

    def local(self, pod_path: str) -> str:
        """Where a file the pod reads lies here; it must be one the pod mounts."""
        assert pod_path in self.files, f"{pod_path} is not mounted in the pod ({sorted(self.files)})"
        return str(self.root / pod_path.lstrip("/"))

    def args(self) -> Any:
        return build_parser().parse_args(self.container["args"])

    def config(self, redis_url: str) -> BatonConfig:
        env = {e["name"]: e["value"] for e in self.container.get("env", []) if e["name"].startswith("BATON_")}
        env["BATON_DISTRIBUTED__REDIS_URL"] = redis_url  # the cluster's Sentinel -> the fixture's Redis
        return load_config(self.local(self.args().config), environ=env)


async def test_the_manifests_serve_a_request_end_to_end_with_auth_on(
    redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    resources = _all()
    secret = resources[("Secret", "baton-secrets")]["stringData"]
    scheduler_pod, executor_pod, gateway_pod = (
        Pod(resources, name, tmp_path / name) for name in ("scheduler", "executor", "gateway")
    )
    local = {"monitoring": {"metrics_port": 0, "executor_metrics_port": 0}}

    shipped = executor_pod.config(redis_url)
    assert shipped.security.fleet_secret_file, "the manifests must turn executor auth on"
    executor_config = with_overrides(
        shipped,
        executor={
            "model": str(tiny_model_dir),
            "host": "127.0.0.1",
            "port": 0,
            "executor_id": "exec-k8s",
            "device": "cpu",
            "dtype": "float32",
            "kv_cache_memory_mb": 32,
        },
        security={"fleet_secret_file": executor_pod.local(shipped.security.fleet_secret_file)},
        **local,
    )
    shipped = scheduler_pod.config(redis_url)
    assert shipped.security.auth_tokens_file and shipped.security.fleet_secret_file
    scheduler_config = with_overrides(
        shipped,
        scheduler={"host": "127.0.0.1", "port": 0},
        security={
            "auth_tokens_file": scheduler_pod.local(shipped.security.auth_tokens_file),
            "fleet_secret_file": scheduler_pod.local(shipped.security.fleet_secret_file),
        },
        **local,
    )
    assert fleet_secret(executor_config.security) == fleet_secret(scheduler_config.security) == secret["fleet-secret"]

    gateway_args = gateway_pod.args()
    assert gateway_args.target.rpartition(":")[2] == str(shipped.scheduler.port)  # it dials the scheduler's port
    tokens = load_tokens(gateway_pod.local(gateway_args.auth_tokens_file))
    assert tokens == load_tokens(scheduler_config.security.auth_tokens_file)  # one tokens file for both
    key, tenant = next((k, t) for k, t in tokens.items() if t != "*")

    executor = await start_executor(executor_config)
    scheduler = await start_scheduler(scheduler_config)
    try:
        await eventually(
            lambda: bool((link := scheduler.dispatcher.links.get("exec-k8s")) and link.ready),
            "the scheduler to drive exec-k8s",
            60.0,
        )
        async with serve_gateway(f"127.0.0.1:{scheduler.port}", tokens) as base_url:
            async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0) as client:
                out = await client.completions.create(
                    model=str(tiny_model_dir), prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True}
                )
            async with httpx.AsyncClient(base_url=base_url) as http:
                anonymous = await http.post("/v1/completions", json={"model": "t", "prompt": "Hi"})
        assert out.usage is not None and out.usage.completion_tokens == 3
        store = aioredis.Redis.from_url(redis_url, decode_responses=True)
        try:
            assert await store.hget(f"{{baton}}:req:{out.id.removeprefix('cmpl-')}", "tenant") == tenant  # type: ignore[misc]
        finally:
            await store.aclose()
        assert anonymous.status_code == 401
        async with grpc.aio.insecure_channel(executor.address) as channel:  # a stranger at the executor's port
            try:
                await executor_pb2_grpc.ExecutorStub(channel).Info(epb.InfoRequest(), timeout=10)
                raise AssertionError("the executor answered a caller without the fleet secret")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await scheduler.stop(grace=0.5)
        await executor.stop(grace=0.5)


def test_the_materialized_pods_mount_only_what_they_need(tmp_path: Path) -> None:
    resources = _all()
    executor = Pod(resources, "executor", tmp_path / "executor")
    gateway = Pod(resources, "gateway", tmp_path / "gateway")
    # Executors hold the fleet secret and no API keys; the gateway the API keys and no fleet secret.
    assert executor.files == {"/etc/baton/baton.yaml", "/etc/baton/secrets/fleet-secret"}
    assert gateway.files == {"/etc/baton/secrets/tokens.yaml"}
    config = yaml.safe_load(resources[("ConfigMap", "baton-config")]["data"]["baton.yaml"])
    assert config["security"]["fleet_secret_file"] in executor.files
