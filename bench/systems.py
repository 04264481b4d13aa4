"""Start and stop the systems a sweep compares, each on localhost ports chosen at run time.

- `pdserve-disagg`: coordinator + 1 prefill + 1 decode worker (`cli.launcher.start_cluster`);
- `pdserve-colocated`: coordinator + 1 worker running both phases (same engine, no KV transfer);
- `pdserve-disagg-observed`: pdserve-disagg exporting every trace (OTLP to an in-process sink) and serving
  /metrics scraped each second: the cost of observability, against pdserve-disagg in the same run;
- `naive`: `naive_server.py`, HF `generate()` one request at a time (seed 004's baseline);
- `llamacpp`: llama.cpp's `llama-server` on the packaged GGUF (its Q4_1 weights), started here, one slot per
  request of the highest concurrency level; `llamacpp-f32` / `-bf16` / `-q8_0` on GGUFs of the same weights
  (build and convert: bench/install_peers.sh);
- peers: any OpenAI-compatible server already running (`--peer name=url`), see bench/README.md.
Every system gets the whole machine: `threads` CPUs. pdserve's workers split them as `pdserve serve` does
(`cli.launcher.worker_threads`: evenly, every CPU to the workers).
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

from backends import OpenAIBackend, PdserveBackend
from observe import OtlpSink, Scraper

HERE = Path(__file__).resolve().parent


@dataclass
class RunningSystem:
    """A started system: how to make its client backend (inside the event loop that will use it: gRPC aio
    channels bind to the loop that creates them) and how to stop it."""

    name: str
    make_backend: Callable[[], object]
    stop: Callable[[], None] = field(default=lambda: None)
    metrics_urls: dict[str, str] = field(default_factory=dict)  # process -> /metrics (started with --metrics-port)


def start_pdserve(name: str, model_dir: str, colocated: bool, threads: int, log_dir: str | None,
                  extra_args: list[str], observed: bool = False, workers: int = 1,
                  coordinator_args: list[str] = ()) -> RunningSystem:
    """observed: every process exports traces (OTLP, to an in-process sink) and serves /metrics, scraped each
    second, as in production; the cost of observability is this system's throughput against the plain one.
    workers: colocated workers, or decode workers beside the one prefill worker (`ServeConfig.num_decode`).
    extra_args / coordinator_args: flags for every worker / the coordinator.

    Raises RuntimeError if a process dies or is not ready in 10 minutes."""
    from pdserve_server.cli.launcher import ServeConfig, start_cluster, worker_threads

    sink = OtlpSink() if observed else None
    if observed:
        extra_args = [*extra_args, "--metrics-port", "0"]
    per_worker = worker_threads(workers if colocated else 1 + workers, num_cpus=threads)  # as `pdserve serve` splits
    cluster = start_cluster(model_dir, Path(model_dir).name, ServeConfig(num_decode=workers, log_dir=log_dir),
                            colocated=colocated,
                            env=sink.env() if sink else None,
                            worker_args=["--threads", str(per_worker), "--log-level", "WARNING", *extra_args],
                            coordinator_args=["--log-level", "WARNING", *coordinator_args,
                                              *(["--metrics-port", "0"] if observed else [])])
    if not observed:
        return RunningSystem(name, lambda: PdserveBackend(cluster.address), cluster.stop, cluster.metrics_urls)
    scraper = Scraper(list(cluster.metrics_urls.values()))

    def stop() -> None:
        scraper.stop()
        cluster.stop()
        sink.stop()
        print(f"{name}: {len(sink.spans)} spans exported, {scraper.scrapes} scrapes ({scraper.bytes} bytes)")
    return RunningSystem(name, lambda: PdserveBackend(cluster.address), stop)


def start_naive(model_dir: str, threads: int, log_dir: str | None, timeout_s: float = 600.0) -> RunningSystem:
    """Raises RuntimeError if the server dies or is not ready within timeout_s."""
    from pdserve_server.cli.launcher import wait_ready

    ready = Path(tempfile.mkdtemp(prefix="pdserve-bench-")) / "naive.ready"
    log = open(Path(log_dir) / "naive.log", "w") if log_dir else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, str(HERE / "naive_server.py"), "--model-dir", model_dir, "--port", "0",
                             "--threads", str(threads), "--ready-file", str(ready)], stdout=log, stderr=log)
    try:
        address = wait_ready([("naive server", proc, ready)], timeout_s)[0]["address"]
    except RuntimeError:
        proc.kill()
        raise

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    return RunningSystem("naive", lambda: OpenAIBackend(address, "naive"), stop)


GGUF_TYPES = ("q4_1", "q8_0", "bf16", "f32")  # llama.cpp's weights: the packaged file's, and bench/install_peers.sh's


def peers_dir() -> Path:
    """Where bench/install_peers.sh puts the peers: $PEERS_DIR, else ~/.cache."""
    import os

    return Path(os.environ.get("PEERS_DIR") or Path.home() / ".cache")


def find_llama_server() -> str | None:
    """$LLAMA_SERVER, else a llama-server built by bench/install_peers.sh (under <peers_dir>/llamacpp), else PATH."""
    import glob
    import os
    import shutil

    if os.environ.get("LLAMA_SERVER"):
        return os.environ["LLAMA_SERVER"]
    built = sorted(glob.glob(str(peers_dir() / "llamacpp/*/llama.cpp/build/bin/llama-server")))
    return built[-1] if built else shutil.which("llama-server")


def find_gguf(kind: str) -> Path:
    """The GGUF of the packaged model's weights in `kind` (one of GGUF_TYPES): "q4_1" is the packaged file itself;
    the others are converted from the same weights by bench/install_peers.sh.

    Raises:
        FileNotFoundError: not made yet (the message says how).
    """
    from pdserve_server.cli.models import default_model_path, served_name

    if kind == "q4_1":
        return default_model_path()
    path = peers_dir() / "llamacpp" / "gguf" / f"{served_name(None)}.{kind}.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: run `bash bench/install_peers.sh gguf`")
    return path


def free_port() -> int:
    """A free localhost port, for servers that cannot report the one they chose."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_http_server(name: str, argv: list[str], port: int, model: str, log_dir: str | None,
                      env: dict | None = None, timeout_s: float = 600.0) -> RunningSystem:
    """Start an OpenAI-compatible server (`argv`, listening on `port`) and wait for its /health to answer 200.

    Raises:
        RuntimeError: it exited or was not ready within timeout_s (its log, <log_dir>/<name>.log, says why).
        FileNotFoundError: argv[0] does not exist.
    """
    import time
    import urllib.request

    log = open(Path(log_dir) / f"{name}.log", "w") if log_dir else subprocess.DEVNULL
    proc = subprocess.Popen(argv, stdout=log, stderr=log, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s

    def stop() -> None:
        import os
        import signal

        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # the whole group: vLLM's engine runs in child processes
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} (see {name}.log)")
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop()
            raise RuntimeError(f"{name} not ready within {timeout_s:.0f} s")
        time.sleep(1.0)
    return RunningSystem(name, lambda: OpenAIBackend(url, model), stop)


def start_llama_server(name: str, binary: str, gguf: str, threads: int, slots: int, ctx_per_slot: int,
                       log_dir: str | None) -> RunningSystem:
    """llama-server (system `name`) with `slots` parallel slots (continuous batching) and `threads` threads, on the
    GGUF's own weights."""
    port = free_port()
    return start_http_server(name, [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                                    "-t", str(threads), "-tb", str(threads), "-np", str(slots),
                                    "-c", str(slots * ctx_per_slot), "--no-webui"], port, name, log_dir)


def find_vllm() -> str | None:
    """$VLLM, else the `vllm` of the venv bench/install_peers.sh makes (<peers_dir>/vllm-venv), else PATH."""
    import os
    import shutil

    venv = peers_dir() / "vllm-venv/bin/vllm"
    return os.environ.get("VLLM") or (str(venv) if venv.exists() else shutil.which("vllm"))


def start_vllm(binary: str, model_dir: str, threads: int, max_num_seqs: int, log_dir: str | None,
               all_cores: bool, dtype: str = "float32") -> RunningSystem:
    """vLLM's CPU build serving the HF directory in `dtype` (float32 or bfloat16). all_cores=False
    keeps vLLM's default placement (on this 2-core machine: the model's OpenMP threads on one core, the other left
    to its scheduler and API server); True binds its OpenMP threads to all `threads` cores."""
    import os

    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2")
    if all_cores:
        env.update(OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
    name = ("vllm-all-cores" if all_cores else "vllm") + ("-bf16" if dtype == "bfloat16" else "")
    return start_http_server(name, [binary, "serve", model_dir, "--port", str(port), "--host", "127.0.0.1",
                                    "--served-model-name", name, "--dtype", dtype,
                                    "--max-num-seqs", str(max_num_seqs), "--max-model-len", "2048"],
                             port, name, log_dir, env=env, timeout_s=900.0)


def peer(spec: str) -> RunningSystem:
    """`name=http://host:port[,model]` -> an already-running OpenAI-compatible server (not stopped by us)."""
    name, _, rest = spec.partition("=")
    url, _, model = rest.partition(",")
    if not name or not url.startswith("http"):
        raise ValueError(f"--peer wants name=http://host:port[,model], got {spec!r}")
    return RunningSystem(name, lambda: OpenAIBackend(url, model or name))
