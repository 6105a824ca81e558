"""bench/vllm_compare.py never runs in CI (it needs a vLLM venv and minutes); only its flags are checked."""

from __future__ import annotations

import argparse
import io
import subprocess
from pathlib import Path
from typing import Any

import pytest

from baton.bench.shared_prefix import SharedPrefixSpec
from bench import vllm_compare as compare
from bench import vllm_process


def test_defaults_alternate_three_pairs_on_both_models_and_dtypes() -> None:
    args = compare.parse_args([])
    assert args.sizes == ["tiny", "small"] and args.dtypes == ["bfloat16", "float32"]
    assert args.pairs == 3 and args.num_requests == 64
    assert args.threads == 0, "each side runs as it would by default on the machine"
    assert not args.vllm_multiprocess
    assert args.vllm_prefix_caching, "on as vLLM ships it; the worker empties it before every run"
    assert args.workload == "throughput"
    assert not args.vllm_default_malloc, "vLLM gets the allocator settings Baton's executor gives itself"
    assert args.stream_interval == 1, "Baton streams every token, as vLLM does by default"
    assert args.executors == 1
    assert args.rpc == "generate", "a Generate stream per request unless asked"


def test_flags() -> None:
    args = compare.parse_args(["--sizes", "tiny", "--dtypes", "float32", "--pairs", "5", "--threads", "2"])
    assert (args.sizes, args.dtypes, args.pairs, args.threads) == (["tiny"], ["float32"], 5, 2)
    assert compare.parse_args(["--stream-interval", "4"]).stream_interval == 4
    assert compare.parse_args(["--executors", "2"]).executors == 2
    assert compare.parse_args(["--rpc", "batch"]).rpc == "batch"
    assert compare.parse_args(["--request-stream-interval", "8"]).request_stream_interval == 8
    assert not compare.parse_args(["--no-vllm-prefix-caching"]).vllm_prefix_caching
    assert compare.parse_args(["--workload", "shared-prefix"]).workload == "shared-prefix"
    with pytest.raises(SystemExit):
        compare.parse_args(["--workload", "sharegpt"])
    with pytest.raises(SystemExit):
        compare.parse_args(["--executors", "0"])
    with pytest.raises(SystemExit):
        compare.parse_args(["--pairs", "0"])
    with pytest.raises(SystemExit):
        compare.parse_args(["--sizes", "huge"])


def test_same_openmp_settings_for_both_sides() -> None:
    assert compare.omp_env(2) == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}


def test_vllm_gets_the_intel_openmp_spin_its_own_workers_get() -> None:
    assert vllm_process.vllm_omp_env(2) == {**compare.omp_env(2), "KMP_BLOCKTIME": "5", "KMP_TPAUSE": "0"}


def test_default_threads_give_vllm_every_core() -> None:
    assert compare.vllm_threads(compare.parse_args([])) >= 1
    assert compare.vllm_threads(compare.parse_args(["--threads", "3"])) == 3


def test_shared_prefix_workload_is_baton_benchs_token_for_token() -> None:
    wl = compare.build_workload("shared-prefix", 64, seed=3)
    specs = SharedPrefixSpec(seed=3).build()
    assert wl.prompts == [list(s.prompt_ids) for s in specs] and wl.max_tokens == [s.output_len for s in specs]
    assert len(wl.prompts) == 96
    assert compare.build_workload("throughput", 5, seed=0) == compare.make_workload(5, 0)
    with pytest.raises(ValueError):
        compare.build_workload("sharegpt", 5, 0)


def test_preloads_tcmalloc_then_intel_openmp_when_found(tmp_path: Path) -> None:
    tcmalloc, venv = tmp_path / "libtcmalloc_minimal.so.4", tmp_path / "venv"
    assert vllm_process.preloads(venv, tcmalloc) == []
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").touch()
    tcmalloc.touch()
    libs = vllm_process.preloads(venv, tcmalloc)
    assert libs == [tcmalloc, venv / "lib" / "libiomp5.so"]
    env = vllm_process.allocator_env(libs, tcmalloc)
    assert env["LD_PRELOAD"].split(":")[:2] == [str(tcmalloc), str(venv / "lib" / "libiomp5.so")]
    assert "MALLOC_MMAP_THRESHOLD_" not in env, "tcmalloc replaces glibc's malloc: no thresholds"


def test_without_tcmalloc_glibc_keeps_the_thresholds_as_the_fallback(tmp_path: Path) -> None:
    iomp = tmp_path / "libiomp5.so"
    env = vllm_process.allocator_env([iomp], tmp_path / "libtcmalloc_minimal.so.4")
    assert env["LD_PRELOAD"].startswith(str(iomp)) and "MALLOC_MMAP_THRESHOLD_" in env
    assert vllm_process.allocator_env([], tmp_path / "missing", glibc_fallback=False) == {}


def test_prints_the_ld_preload_for_vllm_serve(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").touch()
    assert vllm_process.main(["--ld-preload", str(venv / "bin" / "python")]) == 0
    assert capsys.readouterr().out.strip().split(":")[-1] == str(venv / "lib" / "libiomp5.so")


class _FakeProc:
    pid = 0
    stdout = io.StringIO("")
    stdin = None


def test_worker_runs_with_vllms_batch_defaults_and_its_prefix_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def popen(cmd: list[str], **kwargs: Any) -> _FakeProc:
        seen.update(cmd=cmd, env=kwargs["env"])
        return _FakeProc()

    monkeypatch.setattr(subprocess, "Popen", popen)
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "lib" / "libiomp5.so").touch()
    args = compare.parse_args(["--vllm-threads-bind", ""])
    python = tmp_path / "venv" / "bin" / "python"
    vllm_process.start_vllm(python, tmp_path, "float32", tmp_path / "wl.json", 1, io.StringIO(), args)
    assert "--max-num-seqs" not in seen["cmd"] and "--max-num-batched-tokens" not in seen["cmd"]
    assert "--prefix-caching" in seen["cmd"]
    assert str(tmp_path / "venv" / "lib" / "libiomp5.so") in seen["env"]["LD_PRELOAD"]
    args = argparse.Namespace(**{**vars(args), "vllm_prefix_caching": False})
    vllm_process.start_vllm(python, tmp_path, "float32", tmp_path / "wl.json", 1, io.StringIO(), args)
    assert "--no-prefix-caching" in seen["cmd"]
