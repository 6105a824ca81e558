"""The executors of one host find each other through their registration files (real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from executor_service.host_peers import HostPeers

# A second executor process as far as registration goes: it registers, says so, and waits.
PEER = """
import sys
from pathlib import Path
from executor_service.host_peers import HostPeers
HostPeers(Path(sys.argv[1]), cores=frozenset(int(c) for c in sys.argv[2].split(",")))
print("registered", flush=True)
sys.stdin.read()
"""
StartPeer = Callable[[str], "subprocess.Popen[str]"]


@pytest.fixture
def start_peer(tmp_path: Path) -> Iterator[StartPeer]:
    procs: list[subprocess.Popen[str]] = []

    def start(cores: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", PEER, str(tmp_path), cores], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == "registered\n"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_counts_live_executors_that_share_a_core(tmp_path: Path, start_peer: StartPeer) -> None:
    peers = HostPeers(tmp_path, cores=frozenset({0, 1}), refresh_s=0)
    assert peers() == 0
    sharing = start_peer("1,2")
    start_peer("5,6")  # other cores: no peer
    assert peers() == 1
    assert sharing.stdin is not None
    sharing.stdin.close()  # it exits and removes its file
    sharing.wait()
    assert peers() == 0
    assert not (tmp_path / str(sharing.pid)).exists()


def test_a_killed_executors_file_is_dropped(tmp_path: Path, start_peer: StartPeer) -> None:
    peers = HostPeers(tmp_path, cores=frozenset({0}), refresh_s=0)
    killed = start_peer("0")
    assert peers() == 1
    killed.kill()  # no chance to remove its file
    killed.wait()
    assert peers() == 0
    assert not (tmp_path / str(killed.pid)).exists()


def test_a_reused_pid_and_foreign_files_are_not_peers(tmp_path: Path) -> None:
    peers = HostPeers(tmp_path, cores=frozenset({0}), refresh_s=0)
    parent = os.getppid()  # alive, but started at another time than its file says
    (tmp_path / str(parent)).write_text(f"{psutil.Process(parent).create_time() - 10}\n0\n")
    (tmp_path / "notes.txt").write_text("not an executor")
    (tmp_path / "12").write_text("garbage")
    assert peers() == 0
    assert not (tmp_path / str(parent)).exists()


def test_the_count_is_refreshed_only_every_so_often(tmp_path: Path, start_peer: StartPeer) -> None:
    now = [0.0]
    peers = HostPeers(tmp_path, cores=frozenset({0}), refresh_s=2.0, clock=lambda: now[0])
    assert peers() == 0
    start_peer("0")
    now[0] = 1.0
    assert peers() == 0  # the last count stands
    now[0] = 2.0
    assert peers() == 1


def test_closing_removes_the_registration(tmp_path: Path) -> None:
    peers = HostPeers(tmp_path, cores=frozenset({0}))
    assert (tmp_path / str(os.getpid())).exists()
    peers.close()
    assert not (tmp_path / str(os.getpid())).exists()
