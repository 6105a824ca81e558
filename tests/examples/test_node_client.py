"""The Node.js example client (examples/node) streams a completion from a real stack."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.stack import Stack

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "node"
NPM_TIMEOUT_S = 180
_NETWORK_ERRORS = re.compile(r"ENOTFOUND|EAI_AGAIN|ECONNREFUSED|ECONNRESET|ETIMEDOUT|ENETUNREACH|network", re.I)


@pytest.fixture(scope="module")
def node_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example's directory with its dependencies installed: in place when already there, else a temp copy."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are needed for the Node.js example (apt-get install nodejs npm)")
    if (EXAMPLE / "node_modules" / "@grpc" / "grpc-js").is_dir():
        return EXAMPLE
    # A copy keeps the checkout clean; generate.js finds the .proto at ../../proto, so it goes along.
    root = tmp_path_factory.mktemp("node-example")
    copy = root / "examples" / "node"
    shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns("node_modules"))
    shutil.copytree(ROOT / "proto", root / "proto")
    try:
        result = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"], cwd=copy, capture_output=True, text=True, timeout=NPM_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        pytest.skip(f"npm ci took over {NPM_TIMEOUT_S} s (no registry access?)")
    if result.returncode != 0:
        if _NETWORK_ERRORS.search(result.stderr):
            pytest.skip(f"npm ci could not reach the registry: {result.stderr.strip().splitlines()[-1]}")
        pytest.fail(f"npm ci failed:\n{result.stdout}\n{result.stderr}")
    return copy


async def _run_node(example: Path, target: str, *args: str) -> tuple[int, str, str]:
    # An asyncio subprocess: the stack serves from this event loop, so it must not be blocked.
    process = await asyncio.create_subprocess_exec(
        "node",
        "generate.js",
        *args,
        cwd=example,
        env={"PATH": str(Path(shutil.which("node") or "node").parent), "BATON_TARGET": target},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), 60)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_node_client_streams_a_completion(node_example: Path, stack: Stack) -> None:
    code, out, err = await _run_node(node_example, stack.target, "Hello", "--max-tokens", "8", "--ignore-eos")
    assert code == 0, err
    finish = re.search(r"\[finish_reason=(FINISH_REASON_\w+) completion_tokens=(\d+)", out)
    assert finish is not None, out
    assert finish.groups() == ("FINISH_REASON_LENGTH", "8")


async def test_node_client_reports_a_refused_request(node_example: Path, stack: Stack) -> None:
    code, _, err = await _run_node(node_example, stack.target, "Hello", "--temperature", "-1")
    assert code == 2 and "temperature" in err  # refused locally, before any call
    code, _, err = await _run_node(node_example, stack.target, "Hello", "--priority", "42")
    assert code == 1 and "INVALID_ARGUMENT" in err
