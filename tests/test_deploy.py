"""Static checks of the container deployment: Dockerfile, docker-compose.yml, .dockerignore.

No docker daemon is needed: the compose file is validated against the compose-spec JSON
schema (check-jsonschema's vendored copy), by `docker-compose config -q` / `docker compose
config -q` where such a binary exists, and structurally with yaml.safe_load.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from baton.cli import build_parser
from common.config import SecurityConfig
from common.security import fleet_secret

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

LONG_RUNNING = ("redis", "scheduler", "executor", "gateway")
BATON_SERVICES = ("model", "fleet-secret", "scheduler", "executor", "gateway")  # built from this repository's image
ONE_SHOT = ("model", "fleet-secret")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("BATON_REDIS_PASSWORD", "test-password")
    return env


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


# --- schema and tool validation ---------------------------------------------------------


def test_compose_matches_compose_spec_schema() -> None:
    exe = Path(sys.executable).parent / "check-jsonschema"
    if not exe.exists():
        found = shutil.which("check-jsonschema")
        if found is None:
            pytest.fail("check-jsonschema is not installed (it is in the dev extra)")
        exe = Path(found)
    result = subprocess.run(
        [str(exe), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _compose_commands() -> list[Any]:
    params: list[Any] = []
    legacy = shutil.which("docker-compose")
    params.append(
        pytest.param(
            [legacy] if legacy else None,
            id="docker-compose",
            marks=()
            if legacy
            else pytest.mark.skip(reason="no docker-compose binary (apt-get install docker-compose)"),
        )
    )
    docker = shutil.which("docker")
    plugin = False
    if docker:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, timeout=60)
        plugin = probe.returncode == 0
    params.append(
        pytest.param(
            [docker, "compose"] if plugin else None,
            id="docker-compose-plugin",
            marks=() if plugin else pytest.mark.skip(reason="no `docker compose` plugin"),
        )
    )
    return params


@pytest.mark.parametrize("command", _compose_commands())
def test_compose_config_accepts_file(command: list[str], tmp_path: Path) -> None:
    # `config` only parses and interpolates; it does not talk to a docker daemon.
    result = subprocess.run(
        [*command, "--project-directory", str(ROOT), "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- compose structure -------------------------------------------------------------------


def test_no_version_key(compose: dict[str, Any]) -> None:
    assert "version" not in compose


def test_expected_services_and_volumes(compose: dict[str, Any], services: dict[str, Any]) -> None:
    assert set(services) == {"redis", "model", "fleet-secret", "scheduler", "executor", "gateway"}
    assert {"redis-data", "models", "secrets"} <= set(compose["volumes"])


def test_only_scheduler_and_gateway_publish_ports(services: dict[str, Any]) -> None:
    publishing = {name for name, svc in services.items() if svc.get("ports")}
    assert publishing == {"scheduler", "gateway"}
    assert services["scheduler"]["ports"] == ["${BATON_PORT:-50051}:50051"]
    assert services["gateway"]["ports"] == ["${BATON_HTTP_PORT:-8000}:8000"]


def test_executor_is_scalable(services: dict[str, Any]) -> None:
    executor = services["executor"]
    assert "ports" not in executor
    assert "container_name" not in executor
    assert "hostname" not in executor  # each replica must register its own, distinct name


def test_long_running_services_have_healthchecks(services: dict[str, Any]) -> None:
    for name in LONG_RUNNING:
        check = services[name].get("healthcheck")
        assert check and check.get("test") and not check.get("disable"), name
    assert services["scheduler"]["healthcheck"]["test"] == ["CMD", "baton", "health", "--target", "127.0.0.1:50051"]
    assert services["executor"]["healthcheck"]["test"] == ["CMD", "baton", "health", "--target", "127.0.0.1:50061"]
    gateway_test = services["gateway"]["healthcheck"]["test"]
    assert gateway_test[:2] == ["CMD", "python"] and "http://127.0.0.1:8000/health" in gateway_test[-1]
    redis_test = " ".join(services["redis"]["healthcheck"]["test"])
    assert "redis-cli" in redis_test and "-a" in redis_test and "ping" in redis_test


def test_depends_on_uses_conditions(services: dict[str, Any]) -> None:
    for name, svc in services.items():
        deps = svc.get("depends_on")
        if deps is None:
            continue
        assert isinstance(deps, dict), f"{name}: depends_on must be the long form with conditions"
        for dep, spec in deps.items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            assert spec.get("condition") in ("service_healthy", "service_completed_successfully", "service_started"), (
                name,
                dep,
            )
    for name in ("scheduler", "executor"):
        deps = services[name]["depends_on"]
        assert deps["redis"]["condition"] == "service_healthy"
        assert deps["model"]["condition"] == "service_completed_successfully"
        assert deps["fleet-secret"]["condition"] == "service_completed_successfully"
    assert services["gateway"]["depends_on"] == {"scheduler": {"condition": "service_healthy"}}


def test_redis_persistence_and_password(services: dict[str, Any]) -> None:
    redis = services["redis"]
    assert redis["image"].startswith("redis:7")
    command = redis["command"]
    args = command if isinstance(command, list) else command.split()
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == "everysec"
    assert args[args.index("--requirepass") + 1] == "${BATON_REDIS_PASSWORD:-baton}"
    assert any(str(v).startswith("redis-data:") for v in redis["volumes"])


def test_model_job(services: dict[str, Any]) -> None:
    model = services["model"]
    assert model["restart"] == "no"
    assert "healthcheck" not in model
    assert "models:/models" in model["volumes"]
    script = " ".join(model["command"]) if isinstance(model["command"], list) else model["command"]
    assert "config.json" in script
    assert "baton make-model --out /models/tiny" in script
    assert model["environment"]["BATON_MODEL"] == "${BATON_MODEL:-/models/tiny}"


@pytest.mark.parametrize(
    "model_env,expect_rc,expect_generate",
    [
        ("org/some-model", 0, False),  # hub id: nothing to do
        ("PRESENT", 0, False),  # a directory with config.json: nothing to do
        ("/models/tiny", 0, True),  # default path, empty: generate
        ("/nowhere/custom", 1, False),  # a custom path without a model: a clear error
    ],
)
def test_model_job_script(
    services: dict[str, Any], tmp_path: Path, model_env: str, expect_rc: int, expect_generate: bool
) -> None:
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no sh")
    if model_env == "PRESENT":
        (tmp_path / "config.json").write_text("{}")
        model_env = str(tmp_path)
    command = services["model"]["command"]
    script = command[0] if isinstance(command, list) else command
    script = script.replace("$$", "$").replace("exec baton make-model", "echo GENERATE baton make-model")
    result = subprocess.run(
        [sh, "-c", script], env={**_env(), "BATON_MODEL": model_env}, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == expect_rc, result.stdout + result.stderr
    assert ("GENERATE" in result.stdout) == expect_generate


def test_fleet_secret_job(services: dict[str, Any]) -> None:
    job = services["fleet-secret"]
    assert job["restart"] == "no"
    assert "healthcheck" not in job
    assert job["volumes"] == ["secrets:/secrets"]
    for name in ("scheduler", "executor"):
        svc = services[name]
        assert svc["environment"]["BATON_SECURITY__FLEET_SECRET_FILE"] == "/secrets/fleet-secret"
        assert "secrets:/secrets:ro" in svc["volumes"]
    assert "volumes" not in services["gateway"]  # the gateway never calls an executor


def test_fleet_secret_job_script_generates_once(services: dict[str, Any], tmp_path: Path) -> None:
    """First start writes a random secret Baton accepts; later starts keep it."""
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no sh")
    command = services["fleet-secret"]["command"]
    script = command[0] if isinstance(command, list) else command
    script = script.replace("$$", "$").replace("/secrets/", f"{tmp_path}/").replace("python ", f"{sys.executable} ")

    def run() -> str:
        result = subprocess.run([sh, "-c", script], env=_env(), capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stdout + result.stderr
        return (tmp_path / "fleet-secret").read_text()

    first = run()
    assert re.fullmatch(r"[0-9a-f]{64}\n", first)
    assert (tmp_path / "fleet-secret").stat().st_mode & 0o077 == 0  # readable by its owner only
    assert run() == first
    assert not (tmp_path / "fleet-secret.tmp").exists()
    assert fleet_secret(SecurityConfig(fleet_secret_file=str(tmp_path / "fleet-secret"))) == first.strip()


def test_baton_services_share_one_image(services: dict[str, Any]) -> None:
    images = {services[name]["image"] for name in BATON_SERVICES}
    assert len(images) == 1
    for name in BATON_SERVICES:
        assert services[name]["build"]["context"] == "."


def test_scheduler_and_executor_settings(services: dict[str, Any]) -> None:
    url = "redis://:${BATON_REDIS_PASSWORD:-baton}@redis:6379/0"
    scheduler, executor = services["scheduler"], services["executor"]
    for svc in (scheduler, executor):
        assert svc["environment"]["BATON_DISTRIBUTED__REDIS_URL"] == url
        assert url in svc["command"]
        assert "models:/models:ro" in svc["volumes"]
    assert scheduler["command"][0] == "scheduler"
    assert executor["command"][0] == "executor"
    assert executor["environment"]["BATON_EXECUTOR__MODEL"] == "${BATON_MODEL:-/models/tiny}"


def test_gateway_settings(services: dict[str, Any]) -> None:
    gateway = services["gateway"]
    assert gateway["command"] == [
        "gateway",
        "--port",
        "8000",
        "--target",
        "scheduler:50051",
        "--tool-call-parser",
        "${BATON_TOOL_CALL_PARSER:-}",  # empty, the default, is a value the gateway takes: no parser
        "--reasoning-parser",
        "${BATON_REASONING_PARSER:-}",
    ]
    args = build_parser().parse_args(["gateway", "--tool-call-parser", "", "--reasoning-parser", ""])
    assert args.tool_call_parser == args.reasoning_parser == ""
    assert gateway["restart"] == "unless-stopped"
    assert "volumes" not in gateway  # it needs no model or Redis: it only speaks gRPC to the scheduler


def test_executor_reserves_a_gpu(services: dict[str, Any]) -> None:
    devices = services["executor"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


# --- Dockerfile and .dockerignore --------------------------------------------------------


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, rest = full.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    assert not pending, "dangling line continuation"
    return instructions


def _run_lines_with_args_resolved() -> list[str]:
    args: dict[str, str] = {}
    runs: list[str] = []
    for keyword, rest in _dockerfile_instructions():
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default.strip().strip('"')
        elif keyword == "RUN":
            runs.append(re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), rest))
    return runs


def test_dockerfile_basics() -> None:
    instructions = _dockerfile_instructions()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    users = [rest for keyword, rest in instructions if keyword == "USER"]
    assert users and users[-1] not in ("root", "0")
    entry = [rest for keyword, rest in instructions if keyword == "ENTRYPOINT"]
    assert entry == ['["baton"]']


def test_dockerfile_installs_like_ci() -> None:
    runs = _run_lines_with_args_resolved()
    torch_idx = next(i for i, run in enumerate(runs) if "pip install torch==2.13.0" in run)
    project_idx = next(i for i, run in enumerate(runs) if re.search(r"pip install -c constraints\.txt \.(\s|$)", run))
    assert torch_idx < project_idx
    # The pinned versions CI tests are the ones the image installs.
    assert all("-c constraints.txt" in run for run in runs if "pip install" in run and "torch==" not in run)
    # The CUDA swap is a build arg with the CI requirement as its default.
    assert ("ARG", 'TORCH_SPEC="torch==2.13.0"') in _dockerfile_instructions()


def test_dockerfile_copies_pyproject_before_source() -> None:
    copies = [rest for keyword, rest in _dockerfile_instructions() if keyword == "COPY"]
    assert copies[0].startswith("pyproject.toml")
    assert copies[-1] == ". ."


def test_dockerignore_excludes_local_state() -> None:
    patterns = {
        line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")
    }
    for needed in (".venv", ".git", "models"):
        assert needed in patterns, needed
    assert any("__pycache__" in p for p in patterns)
    assert "pyproject.toml" not in patterns and "README.md" not in patterns


def test_the_constraints_pin_the_stack_within_pyproject_ranges() -> None:
    """constraints.txt pins one tested point inside every range pyproject.toml declares."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = Version(version)
    for needed in ("grpcio", "protobuf", "redis", "transformers", "tokenizers", "torch"):
        assert needed in pins, needed
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    for requirement in map(Requirement, declared):
        pinned = pins.get(canonicalize_name(requirement.name))
        if pinned is not None:
            assert requirement.specifier.contains(pinned), (requirement, pinned)
    install = (ROOT / "scripts" / "install.sh").read_text()
    assert install.count("-c constraints.txt") == 2
