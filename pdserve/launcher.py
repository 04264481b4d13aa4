"""`pdserve serve`: start coordinator + workers as separate processes on localhost and wait until they serve."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Cluster:
    """Processes of a local cluster; `stop()` terminates them all."""

    address: str
    processes: list[subprocess.Popen] = field(default_factory=list)
    workdir: str = ""
    log_files: dict[str, str] = field(default_factory=dict)
    worker_addresses: dict[str, str] = field(default_factory=dict)  # name ("prefill-0", ...) -> gRPC address

    def stop(self, timeout_s: float = 20.0) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout_s
        for p in self.processes:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _spawn(args: list[str], name: str, workdir: Path, log_dir: Path | None, env: dict) -> tuple[subprocess.Popen, Path, str]:
    ready = workdir / f"{name}.ready"
    log_path = ""
    out = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = str(log_dir / f"{name}.log")
        out = open(log_path, "w")  # noqa: SIM115 - owned by the child for its lifetime
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *args, "--ready-file", str(ready)],
                            stdout=out, stderr=subprocess.STDOUT if out else None, env=env)
    return proc, ready, log_path


def wait_ready(procs: list[tuple[str, subprocess.Popen, Path]], timeout_s: float) -> list[dict]:
    """Wait for every (name, process, ready file) to write its file (`worker_common.worker.write_ready_file`)
    and return their contents in order. Raises RuntimeError naming a process that exited or timed out."""
    deadline = time.monotonic() + timeout_s
    out = []
    for name, proc, ready in procs:
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready after {timeout_s:.0f}s")
            time.sleep(0.1)
        out.append(json.loads(ready.read_text()))
    return out


def start_cluster(model_dir: str, model_name: str, num_prefill: int = 1, num_decode: int = 1,
                  colocated: bool = False, port: int = 0, worker_args: list[str] | None = None,
                  coordinator_args: list[str] | None = None, log_dir: str | None = None,
                  timeout_s: float = 600.0, env: dict | None = None) -> Cluster:
    """Start the topology and return once the coordinator serves.

    Args:
        model_dir: resolved HF-format model directory (see engine.loader.resolve_model).
        worker_args / coordinator_args: extra CLI flags passed to every worker / the coordinator.
        log_dir: write each process's output to <log_dir>/<name>.log (else inherit stderr).
        timeout_s: how long to wait for every process, seconds.

    Raises:
        RuntimeError: a process died or did not become ready; everything started is stopped first.
    """
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-"))
    env = dict(os.environ if env is None else env)
    logs = Path(log_dir) if log_dir else None
    cluster = Cluster(address="", workdir=str(workdir))
    common = ["--model-dir", model_dir, *(worker_args or [])]
    try:
        waits = []
        roles = [("colocated", 1)] if colocated else [("prefill", num_prefill), ("decode", num_decode)]
        for role, n in roles:
            for i in range(n):
                name = f"{role}-{i}"
                proc, ready, log_path = _spawn([role, *common], name, workdir, logs, env)
                cluster.processes.append(proc)
                cluster.log_files[name] = log_path
                waits.append((name, proc, ready, role))
        infos = wait_ready([(n, p, r) for n, p, r, _ in waits], timeout_s)
        cluster.worker_addresses = {w[0]: i["address"] for i, w in zip(infos, waits)}
        prefill = [i["address"] for i, w in zip(infos, waits) if w[3] == "prefill"]
        decode = [i["address"] for i, w in zip(infos, waits) if w[3] != "prefill"]
        args = ["coordinator", "--model-dir", model_dir, "--served-model-name", model_name, "--port", str(port),
                *(["--colocated"] if colocated else []), *(coordinator_args or [])]
        for a in prefill:
            args += ["--prefill", a]
        for a in decode:
            args += ["--decode", a]
        proc, ready, log_path = _spawn(args, "coordinator", workdir, logs, env)
        cluster.processes.append(proc)
        cluster.log_files["coordinator"] = log_path
        cluster.address = wait_ready([("coordinator", proc, ready)], timeout_s)[0]["address"]
        return cluster
    except BaseException:
        cluster.stop()
        raise
