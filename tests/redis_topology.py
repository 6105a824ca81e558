"""Real multi-process Redis topologies for tests: a 3-primary Redis Cluster, and a Sentinel-managed
primary with a replica. Every process binds loopback on free ports and runs in a temp directory.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.conftest import RedisServer, free_port


def _redis_server() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    return binary


def redis_cli(port: int, *args: str, check: bool = True) -> str:
    done = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=10)
    if check and done.returncode != 0:
        raise RuntimeError(f"redis-cli -p {port} {' '.join(args)}: {done.stderr or done.stdout}")
    return done.stdout


def _wait(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


@dataclass
class _Node:
    port: int
    process: subprocess.Popen[bytes]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=10)


def _spawn(args: list[str], workdir: Path, name: str) -> subprocess.Popen[bytes]:
    log = open(workdir / f"{name}.log", "ab")  # noqa: SIM115 - the process owns it
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)


@dataclass
class RedisClusterProcesses:
    """Three primaries (no replicas), all 16384 slots assigned, created with ``redis-cli --cluster create``."""

    workdir: Path
    nodes: list[_Node] = field(default_factory=list)

    def start(self, size: int = 3) -> None:
        for i in range(size):
            port, bus = free_port(), free_port()
            node_dir = self.workdir / f"node{i}"
            node_dir.mkdir(parents=True, exist_ok=True)
            args = [
                _redis_server(),
                "--port", str(port), "--bind", "127.0.0.1",
                "--cluster-enabled", "yes", "--cluster-port", str(bus),
                "--cluster-config-file", str(node_dir / "nodes.conf"),
                "--cluster-node-timeout", "2000",
                "--save", "", "--appendonly", "no", "--dir", str(node_dir),
            ]  # fmt: skip
            self.nodes.append(_Node(port, _spawn(args, self.workdir, f"node{i}")))
        for node in self.nodes:
            RedisServer._wait_ready_on(node.port)
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        done = subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
        # Every node must agree the cluster is up before a client's first CLUSTER SLOTS.
        _wait(lambda: all("cluster_state:ok" in redis_cli(n.port, "CLUSTER", "INFO") for n in self.nodes), "cluster ok")

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def flush(self) -> None:
        for node in self.nodes:
            redis_cli(node.port, "FLUSHALL")

    def key_counts(self) -> list[int]:
        """Keys held by each primary: shows whether data spread over the shards."""
        return [int(redis_cli(n.port, "DBSIZE").strip()) for n in self.nodes]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@dataclass
class SentinelGroup:
    """A primary, one replica and one sentinel (quorum 1) watching them under ``service``.

    Timeouts are small so a failover completes in a couple of seconds.
    """

    workdir: Path
    service: str = "baton"
    primary: _Node | None = None
    replica: _Node | None = None
    sentinel: _Node | None = None

    def _data_node(self, name: str, replica_of: int | None) -> _Node:
        port = free_port()
        node_dir = self.workdir / name
        node_dir.mkdir(parents=True, exist_ok=True)
        args = [
            _redis_server(), "--port", str(port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(node_dir),
            # Redis waits 5 s for more replicas before a diskless full sync by default.
            "--repl-diskless-sync-delay", "0",
        ]  # fmt: skip
        if replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(replica_of)]
        node = _Node(port, _spawn(args, self.workdir, name))
        RedisServer._wait_ready_on(port)
        return node

    def start(self) -> None:
        self.primary = self._data_node("primary", None)
        self.replica = self._data_node("replica", self.primary.port)
        primary_port = self.primary.port
        _wait(lambda: "master_link_status:up" in redis_cli(self.replica_port, "INFO", "replication"), "replica sync")
        port = free_port()
        conf = self.workdir / "sentinel.conf"
        conf.write_text(
            "\n".join(
                [
                    f"port {port}",
                    "bind 127.0.0.1",
                    f"dir {self.workdir}",
                    f"sentinel monitor {self.service} 127.0.0.1 {primary_port} 1",
                    f"sentinel down-after-milliseconds {self.service} 1000",
                    f"sentinel failover-timeout {self.service} 5000",
                    f"sentinel parallel-syncs {self.service} 1",
                    "",
                ]
            )
        )
        self.sentinel = _Node(port, _spawn([_redis_server(), str(conf), "--sentinel"], self.workdir, "sentinel"))
        RedisServer._wait_ready_on(port)
        _wait(lambda: self.master_port() == primary_port, "the sentinel to see the primary")
        # The sentinel learns about the replica through the primary's INFO; failover needs it.
        _wait(
            lambda: f"{self.replica_port}" in redis_cli(port, "SENTINEL", "REPLICAS", self.service),
            "the sentinel to see the replica",
        )

    @property
    def replica_port(self) -> int:
        assert self.replica is not None
        return self.replica.port

    @property
    def url(self) -> str:
        assert self.sentinel is not None
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{self.service}"

    def master_port(self) -> int:
        assert self.sentinel is not None
        out = redis_cli(self.sentinel.port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service, check=False)
        lines = out.split()
        return int(lines[1]) if len(lines) == 2 else -1

    def failover(self) -> int:
        """Ask the sentinel to promote the replica now; return the new primary's port once it took over."""
        assert self.sentinel is not None and self.primary is not None
        old = self.primary.port
        redis_cli(self.sentinel.port, "SENTINEL", "FAILOVER", self.service)
        _wait(lambda: self.master_port() not in (old, -1), "the sentinel to promote the replica")
        new = self.master_port()
        _wait(lambda: "role:master" in redis_cli(new, "INFO", "replication"), "the new primary to take writes")
        return new

    def kill_primary(self) -> int:
        """SIGKILL the primary; return the new primary's port once the sentinel promoted the replica."""
        assert self.primary is not None
        old = self.primary.port
        # Replication is asynchronous, and right after a full sync the primary only streams to the
        # replica once the replica's first acknowledgement arrives (up to a second later). Killed
        # in that window, the primary takes every write so far with it, and the test would be
        # about Redis losing data rather than about Baton riding out a failover. So the replica
        # first acknowledges what was written until now; later writes may still be lost, which
        # Baton must handle (a record behind its executor).
        # WAIT counts from the calling connection's own last write, hence the probe first.
        with redis.Redis(port=old) as direct:
            direct.set("failover-probe", "1")
            acked = direct.wait(1, 10_000)
        if acked != 1:
            raise RuntimeError("the replica did not acknowledge the primary's writes within 10 s")
        self.primary.stop(signal.SIGKILL)
        _wait(lambda: self.master_port() not in (old, -1), "the sentinel to promote the replica", timeout=30)
        new = self.master_port()
        _wait(lambda: "role:master" in redis_cli(new, "INFO", "replication"), "the new primary to take writes")
        return new

    def stop(self) -> None:
        for node in (self.sentinel, self.replica, self.primary):
            if node is not None:
                node.stop()
