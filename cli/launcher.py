"""`pdserve serve`: start coordinator + workers as separate processes on this host and wait until they serve."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdserve_server.server_common.errors import CommandError
from pdserve_server.server_common.security import CLUSTER_SECRET_ENV

WAIT_NOTE_S = 30.0  # while starting, say what is still starting this often

# Set in every process the launcher starts: the pid of the launcher. The child shuts down cleanly when that process
# is gone (cli.main._run_server), so a `pdserve serve` or test run killed with SIGKILL leaves no server behind.
PARENT_PID_ENV = "PDSERVE_PARENT_PID"
RESTART_RESET_S = 30.0  # a process that ran this long before dying is restarted at once (its backoff resets)
RESTART_BACKOFF_MAX_S = 30.0  # the longest wait before restarting a process that keeps dying at start


@dataclass(frozen=True)
class ServeConfig:
    """The shape of a local cluster (the roles' own settings are their config dataclasses).

    Attributes:
        num_prefill / num_decode: worker processes per role; colocated, num_decode colocated workers (the
            coordinator routes each request to one of them, as it picks a decode worker). num_prefill None: 1
            (`pdserve serve` reads a given --num-prefill as asking for disaggregation, `cli.topology`).
        log_dir: write each process's output to <log_dir>/<name>.log; None = inherit stderr.
        start_timeout_s: how long to wait for every process to serve, seconds.
        num_coordinators: coordinator processes on the one public port (`CoordinatorConfig.reuse_port`), named
            "coordinator", "coordinator-1", ...; each polls every worker and routes on its own view.
        restart: `serve` restarts a process that died (on its old gRPC port, so the coordinator finds it again).
    """

    num_prefill: int | None = field(default=None, metadata={
        "min": 0, "help": "prefill worker processes (disaggregated; 1 when not given, and giving it means "
                          "--disaggregated)"})
    num_decode: int = field(default=1, metadata={
        "min": 1, "help": "decode (with --colocated: colocated) worker processes"})
    log_dir: str | None = field(default=None, metadata={"help": "write each process's log to a file here"})
    start_timeout_s: float = field(default=600.0, metadata={
        "gt": 0, "help": "wait for every process to serve, seconds"})
    restart: bool = field(default=False, metadata={"help": "restart a process that dies"})
    num_coordinators: int = field(default=1, metadata={
        "min": 1, "help": "coordinator processes serving the one public port (SO_REUSEPORT: the kernel spreads "
                          "client connections among them), each routing over every worker"})

    @property
    def prefill_workers(self) -> int:
        """Prefill worker processes of a disaggregated cluster."""
        return 1 if self.num_prefill is None else self.num_prefill


@dataclass
class Cluster:
    """Processes of a local cluster; `stop()` terminates them all.

    Attributes:
        address: the coordinator's "host:port".
        processes: process name ("coordinator", "prefill-0", "decode-1", ...) -> the process.
        worker_addresses: worker process name -> gRPC address.
        log_files: process name -> log path ("" when inheriting stderr).
        worker_metadata: gRPC metadata that authenticates a call to a worker (the cluster secret), for tools and
            tests that call the internal API directly.
        metrics_urls: process name -> its Prometheus endpoint (processes started with --metrics-port).
    """

    address: str
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    workdir: str = ""
    log_files: dict[str, str] = field(default_factory=dict)
    worker_addresses: dict[str, str] = field(default_factory=dict)
    worker_metadata: tuple[tuple[str, str], ...] = ()
    metrics_urls: dict[str, str] = field(default_factory=dict)
    _commands: dict[str, list[str]] = field(default_factory=dict)  # name -> the flags it was started with
    _env: dict = field(default_factory=dict)
    _log_dir: Path | None = None
    _stopping: threading.Event = field(default_factory=threading.Event)
    _spawning: threading.Lock = field(default_factory=threading.Lock)  # no restart starts once `stop` began

    def supervise(self, restart: bool, poll_s: float = 0.5) -> None:
        """Watch the processes until `stop` (or an interrupt): report each that exits and, with restart, start it
        again on the gRPC port it had (a worker comes back with a new KV port, which the coordinator re-reads; a
        worker whose engine faulted exits non-zero for exactly this). A process that dies within
        RESTART_RESET_S of its start waits before the next start, doubling up to RESTART_BACKOFF_MAX_S (a crash
        loop, e.g. a port taken, does not spin). Without restart, returns once the coordinator has exited: the
        cluster has no public endpoint left, and the caller should stop it (and exit non-zero, for a process
        manager to act on). A lost worker is only reported: the coordinator routes around it."""
        started = {name: time.monotonic() for name in self.processes}
        backoff: dict[str, float] = {}
        due: dict[str, float] = {}  # name -> when its restart may start (it has exited)
        while not self._stopping.is_set():
            for name, proc in list(self.processes.items()):
                if proc.poll() is None or self._stopping.is_set():
                    continue
                now = time.monotonic()
                if name not in due:
                    print(f"pdserve: {name} exited with code {proc.returncode}"
                          + (f" (log: {self.log_files[name]})" if self.log_files.get(name) else ""), flush=True)
                    if not restart:
                        del self.processes[name]
                        if not any(n.startswith("coordinator") for n in self.processes):
                            return  # no public endpoint left
                        continue
                    quick = now - started[name] < RESTART_RESET_S
                    backoff[name] = min(2 * (backoff.get(name) or 0.5), RESTART_BACKOFF_MAX_S) if quick else 0.0
                    due[name] = now + backoff[name]
                if now < due[name]:
                    continue
                del due[name]
                address = self.address if name.startswith("coordinator") else self.worker_addresses[name]
                args = [*self._commands[name], "--port", address.rsplit(":", 1)[1]]
                with self._spawning:
                    if self._stopping.is_set():
                        return
                    self.processes[name], _, _ = _spawn(args, name, Path(self.workdir), self._log_dir, self._env)
                started[name] = time.monotonic()
                print(f"pdserve: restarted {name} on {address}", flush=True)
            self._stopping.wait(poll_s)

    def stop(self, timeout_s: float = 20.0) -> None:
        """End `supervise` (no process is restarted from now on), SIGTERM every process, SIGKILL what has not
        exited within timeout_s, remove the working directory. Safe from another thread than `supervise`'s."""
        with self._spawning:
            self._stopping.set()
        for p in self.processes.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout_s
        for p in self.processes.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _spawn(args: list[str], name: str, workdir: Path, log_dir: Path | None,
           env: dict) -> tuple[subprocess.Popen, Path, str]:
    ready = workdir / f"{name}.ready"
    log_path = ""
    out = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = str(log_dir / f"{name}.log")
        out = open(log_path, "w")  # noqa: SIM115 - owned by the child for its lifetime
    # A session of its own: a signal to the launcher's process group (a terminal's Ctrl-C) reaches the launcher
    # alone, which stops the cluster in order, rather than each child on its own.
    proc = subprocess.Popen([sys.executable, "-m", "pdserve_server.cli.main", *args, "--ready-file", str(ready)],
                            stdout=out, stderr=subprocess.STDOUT if out else None,
                            env={**env, PARENT_PID_ENV: str(os.getpid())}, start_new_session=True)
    return proc, ready, log_path


def wait_ready(procs: list[tuple[str, subprocess.Popen, Path]], timeout_s: float,
               progress: Callable[[str], None] | None = None, counted: tuple[int, int] = (0, 0)) -> list[dict]:
    """Wait for every (name, process, ready file) to write its file (`server_common.grpc_server.write_ready_file`)
    and return their contents in order. `progress` (if given) hears each process as it gets ready, "<name> ready
    (k/N)", and every WAIT_NOTE_S what is still starting; `counted` = (processes already ready, N) for those lines
    (N = len(procs) if 0).

    Raises:
        CommandError: naming a process that exited or did not get ready within timeout_s.
    """
    start = time.monotonic()
    deadline, note = start + timeout_s, start + WAIT_NOTE_S
    done, total = counted[0], counted[1] or len(procs)
    found: dict[str, dict] = {}
    while len(found) < len(procs):
        for name, proc, ready in procs:
            if name in found:
                continue
            if ready.exists():
                found[name] = json.loads(ready.read_text())
                done += 1
                if progress:
                    progress(f"  {name} ready ({done}/{total})")
            elif proc.poll() is not None:
                raise CommandError(f"{name} exited with code {proc.returncode} before it was ready")
        now = time.monotonic()
        if len(found) < len(procs) and now > deadline:
            missing = next(name for name, _, _ in procs if name not in found)
            raise CommandError(f"{missing} not ready after {timeout_s:.0f}s")
        if progress and now > note and len(found) < len(procs):
            waiting = ", ".join(name for name, _, _ in procs if name not in found)
            progress(f"  still starting after {now - start:.0f} s: {waiting} (loading the model)")
            note = now + WAIT_NOTE_S
        if len(found) < len(procs):
            time.sleep(0.1)
    return [found[name] for name, _, _ in procs]


def worker_threads(num_workers: int, num_cpus: int | None = None) -> int:
    """Torch threads for each of num_workers workers sharing this host: its CPUs (affinity mask) split evenly, at
    least 1, so workers never oversubscribe the cores. The coordinator and clients get no CPU of their own.

    Measured on 2 cores, seed workload, bf16, one run (docs/history/benchmarks.md, "Thread split, again"): one colocated
    worker with 2 threads gave 1.47x / 1.44x the output tok/s of 1 thread at concurrency 16 / 64, and 1.27x two
    1-thread workers at 64. (An earlier rule kept one CPU for the coordinator; its measurement had every served
    worker's OpenMP threads slowed by a second thread pool, `engine.hardware.set_threads`.) Hosts with more cores
    are not measured yet.
    """
    cpus = num_cpus if num_cpus is not None else len(os.sched_getaffinity(0))
    return max(1, cpus // max(1, num_workers))


def start_cluster(model_dir: str, model_name: str, config: ServeConfig = ServeConfig(), colocated: bool = False,
                  worker_args: list[str] | None = None, coordinator_args: list[str] | None = None,
                  env: dict | None = None, devices: tuple[str, ...] = (),
                  progress: Callable[[str], None] | None = None) -> Cluster:
    """Start the topology and return once the coordinator serves.

    Args:
        model_dir: resolved HF-format model directory (see `cli.models.resolve_model`).
        model_name: the coordinator's served model name.
        config: how many workers, where logs go, how long to wait.
        colocated: `config.num_decode` colocated workers instead of prefill + decode workers.
        worker_args / coordinator_args: flags passed to every worker / the coordinator (e.g. from
            `cli.args.dataclass_to_argv`); the coordinator binds port 0 unless they say otherwise. Workers get
            `--threads` from `worker_threads` unless these flags set it.
        env: the children's environment (default: this process's).
        devices: each worker's `--device`, prefill workers first (`cli.topology.Topology.devices`); empty = as
            worker_args say.
        progress: hears each process as it gets ready, and what is still starting (`wait_ready`).

    Unless the flags or the environment name a cluster secret, a random one is written (mode 0600) to the
    cluster's working directory and given to every process: the workers' APIs and KV ports then refuse anyone
    else on this host.

    Raises:
        CommandError: a process died or did not become ready; everything started is stopped first.
    """
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-"))
    env = dict(os.environ if env is None else env)
    logs = Path(config.log_dir) if config.log_dir else None
    cluster = Cluster(address="", workdir=str(workdir), _env=env, _log_dir=logs)
    worker_args, coordinator_args = list(worker_args or []), list(coordinator_args or [])
    if "--threads" not in worker_args:
        worker_args += ["--threads", str(worker_threads(config.num_decode if colocated
                                                        else config.prefill_workers + config.num_decode))]
    if "--cluster-secret-file" not in worker_args and CLUSTER_SECRET_ENV not in env:
        secret_file = workdir / "cluster.secret"
        secret_file.touch(mode=0o600)
        secret_file.write_text(secrets.token_urlsafe(32))
        worker_args += ["--cluster-secret-file", str(secret_file)]
        coordinator_args += ["--cluster-secret-file", str(secret_file)]
    if "--cluster-secret-file" in worker_args:
        secret = Path(worker_args[worker_args.index("--cluster-secret-file") + 1]).read_text().strip()
    else:
        secret = env[CLUSTER_SECRET_ENV].strip()
    cluster.worker_metadata = (("authorization", f"Bearer {secret}"),)
    try:
        waits = []
        roles = [("colocated", config.num_decode)] if colocated else [("prefill", config.prefill_workers),
                                                                     ("decode", config.num_decode)]
        names = [f"{role}-{i}" for role, n in roles for i in range(n)]
        placed = dict(zip(names, devices))
        for role, n in roles:
            for i in range(n):
                name = f"{role}-{i}"
                cluster._commands[name] = [role, "--model", model_dir, "--served-model-name", model_name,
                                           *worker_args, *(["--device", placed[name]] if name in placed else [])]
                proc, ready, log_path = _spawn(cluster._commands[name], name, workdir, logs, env)
                cluster.processes[name] = proc
                cluster.log_files[name] = log_path
                waits.append((name, proc, ready, role))
        total = len(waits) + config.num_coordinators
        infos = wait_ready([(n, p, r) for n, p, r, _ in waits], config.start_timeout_s, progress, (0, total))
        cluster.worker_addresses = {w[0]: i["address"] for i, w in zip(infos, waits)}
        cluster.metrics_urls = {w[0]: i["metrics_url"] for i, w in zip(infos, waits) if "metrics_url" in i}
        args = ["coordinator", "--model", model_dir, "--served-model-name", model_name,
                *(["--colocated"] if colocated else []), *coordinator_args,
                *(["--reuse-port"] if config.num_coordinators > 1 else [])]
        for info, (_, _, _, role) in zip(infos, waits):
            args += ["--prefill" if role == "prefill" else "--decode", info["address"]]
        for k in range(config.num_coordinators):  # the first picks the port (0: any free one), the rest join it
            name = "coordinator" if k == 0 else f"coordinator-{k}"
            extra = [] if k == 0 else ["--port", cluster.address.rsplit(":", 1)[1],
                                       *(["--metrics-port", "0"] if "--metrics-port" in args else [])]
            cluster._commands[name] = [*args, *extra]
            proc, ready, log_path = _spawn(cluster._commands[name], name, workdir, logs, env)
            cluster.processes[name] = proc
            cluster.log_files[name] = log_path
            info = wait_ready([(name, proc, ready)], config.start_timeout_s, progress, (len(waits) + k, total))[0]
            cluster.address = cluster.address or info["address"]
            if "metrics_url" in info:
                cluster.metrics_urls[name] = info["metrics_url"]
        return cluster
    except BaseException:
        cluster.stop()
        raise
