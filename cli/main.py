"""pdserve: gRPC LLM inference with disaggregated prefill and decode.

Commands: serve (a whole local cluster), coordinator / prefill / decode / colocated (one role per process, as
compose.yaml runs them), generate (stream a completion from a running coordinator), key-id (an API key's id, as
logs and --tenant-weights name it).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

from pdserve_server.cli.args import add_dataclass_args, bounded_type, dataclass_from_args, dataclass_to_argv
from pdserve_server.server_common.config import ServerArgs
from pdserve_server.server_common.logs import configure_logging


@dataclass(frozen=True)
class Command:
    """One subcommand: its help line, how to add its flags, and how to run it. Each imports only what it needs
    (a role's config and server), so `pdserve coordinator` never loads torch or the engine."""

    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], None]
    log_level: str = "INFO"


def _add_model_args(p: argparse.ArgumentParser, served_name: bool = False) -> None:
    p.add_argument("--model", default=os.environ.get("PDSERVE_MODEL"),
                   help="HF-format directory or .gguf file (default: $PDSERVE_MODEL, else the packaged "
                        "SmolLM2-135M-Instruct)")
    if served_name:
        p.add_argument("--served-model-name", default=None,
                       help="name clients pass as model, and the model_name label of metrics (default: from --model)")


def _resolved(args: argparse.Namespace) -> tuple[str, str]:
    """(model directory, served name) for --model; converts a GGUF once, in a child process.

    Raises:
        CommandError: the path does not exist or holds no model.
    """
    from pdserve_server.cli.models import resolve_model, served_name
    from pdserve_server.server_common.errors import CommandError

    try:
        model_dir = resolve_model(args.model)
    except FileNotFoundError as e:
        raise CommandError(f"{e} (--model)") from None
    return str(model_dir), getattr(args, "served_model_name", None) or served_name(args.model)


def _run_server(coro: Coroutine) -> None:
    """Run a server coroutine until SIGINT or SIGTERM, or until the launcher that started it is gone
    (`cli.launcher.PARENT_PID_ENV`), then let it shut down cleanly and exit 0 (`engine.core.lifetime.exit_now`).
    An exception (a CommandError, say) leaves as before, for `main` to report."""
    from pdserve_server.cli.launcher import PARENT_PID_ENV

    async def main() -> None:
        task = asyncio.create_task(coro)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        parent = os.environ.get(PARENT_PID_ENV)
        watch = asyncio.create_task(_stop_without_parent(int(parent), task)) if parent else None
        try:
            await task
        except asyncio.CancelledError:
            pass
        finally:
            if watch is not None:
                watch.cancel()
    asyncio.run(main())
    from pdserve_server.engine.core.lifetime import exit_now

    exit_now(0)  # the server has shut down: skip the interpreter's teardown (torch's alone is ~0.5 s)


async def _stop_without_parent(parent_pid: int, server: asyncio.Task, poll_s: float = 1.0) -> None:
    """Cancel `server` (its clean shutdown, as SIGTERM does) once the process that started this one has exited:
    the orphan is re-parented, so getppid() changes. A launcher killed with SIGKILL cannot stop its children, which
    kept their ports, memory and CPU (seen: clusters of killed test runs idling through benchmarks)."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(poll_s)
    logging.getLogger(__name__).warning("the launcher (pid %d) is gone: shutting down", parent_pid)
    server.cancel()


# ---- roles ------------------------------------------------------------------------------------------------------
def _worker_args(p: argparse.ArgumentParser) -> None:
    from pdserve_server.worker_common.config import WorkerConfig

    _add_model_args(p, served_name=True)
    add_dataclass_args(p, WorkerConfig)


def _run_worker(role: str) -> Callable[[argparse.Namespace], None]:
    def run(args: argparse.Namespace) -> None:
        from pdserve_server.worker_common.config import WorkerConfig

        from pdserve_server.cli.models import default_cache_dir

        model_dir, name = _resolved(args)
        config = dataclass_from_args(WorkerConfig, args, role=role, model_dir=model_dir, served_model_name=name,
                                     log_level=args.log_level, log_format=args.log_format,
                                     model_cache_dir=str(default_cache_dir() / "model-configs"))
        if role == "prefill":
            from pdserve_server.prefill_worker.server import serve
        else:
            from pdserve_server.decode_worker.server import serve
        _run_server(serve(config))
    return run


def _coordinator_args(p: argparse.ArgumentParser) -> None:
    from pdserve_server.coordinator.config import CoordinatorConfig

    _add_model_args(p, served_name=True)
    add_dataclass_args(p, CoordinatorConfig)


def _run_coordinator(args: argparse.Namespace) -> None:
    from pdserve_server.coordinator.config import CoordinatorConfig
    from pdserve_server.coordinator.app import serve

    model_dir, name = _resolved(args)
    _run_server(serve(dataclass_from_args(CoordinatorConfig, args, model_dir=model_dir, model_name=name)))


# ---- serve: the whole cluster on this host -----------------------------------------------------------------------
# Settings that belong to the cluster's shape, not to one process: `serve` fills them in per process.
_PER_PROCESS = frozenset({"port", "ready_file", "prefill", "decode", "colocated"})
# TLS is the public port's, so the coordinator's alone: serve's workers talk on loopback, authenticated by the
# cluster secret. The other server settings (host, secret, drain...) every process shares; the workers' group of
# flags carries them.
_TLS = frozenset({"tls_cert", "tls_key", "tls_client_ca"})
_SHARED = frozenset(f.name for f in dataclasses.fields(ServerArgs)) - _TLS
SERVE_WORKER_SKIP = _PER_PROCESS | _TLS
SERVE_COORDINATOR_SKIP = _PER_PROCESS | _SHARED


def _serve_args(p: argparse.ArgumentParser) -> None:
    from pdserve_server.cli.launcher import ServeConfig
    from pdserve_server.coordinator.config import CoordinatorConfig
    from pdserve_server.worker_common.config import WorkerConfig

    _add_model_args(p, served_name=True)
    add_dataclass_args(p, ServeConfig)
    p.add_argument("--port", type=bounded_type(int, {"min": 0, "max": 65535}), default=50051,
                   help="coordinator port (0 = any free port)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--colocated", action="store_const", dest="topology", const="colocated",
                       help="one worker runs both phases (default on CPU hosts and on one GPU: see `cli.topology`)")
    shape.add_argument("--disaggregated", action="store_const", dest="topology", const="disaggregated",
                       help="prefill and decode workers apart, KV moved between them (default with a GPU for each)")
    add_dataclass_args(p.add_argument_group("workers"), WorkerConfig, skip=SERVE_WORKER_SKIP)
    add_dataclass_args(p.add_argument_group("coordinator"), CoordinatorConfig, skip=SERVE_COORDINATOR_SKIP)
    p.add_argument("--demo", nargs="?", const="Explain in two sentences why the sky is blue.", default=None,
                   help="send one chat request, stream it, then shut down")
    p.add_argument("--demo-max-tokens", type=int, default=64)


def _preflight(worker, coordinator) -> None:
    """What would stop the cluster, found before any process is spawned (a worker takes up to a minute to load its
    weights, and each would report the same problem): the coordinator's port, and the model's config.json against
    the engine's checks (architecture, RoPE type, KV budget, tensor parallelism) as every worker will run them.

    Raises:
        CommandError: naming the problem.
    """
    from pdserve_server.engine.builder import resolve_configs
    from pdserve_server.server_common.errors import CommandError
    from pdserve_server.server_common.grpc_server import bind_problem

    server = coordinator.server
    if server.port and (problem := bind_problem(server.host, server.port)):
        raise CommandError(problem)
    try:
        resolve_configs(worker.engine)
    except (ValueError, OSError) as e:
        raise CommandError(f"{worker.engine.model_dir}: {e}") from None


def _run_serve(args: argparse.Namespace) -> None:
    from pdserve_server.cli.launcher import ServeConfig, start_cluster
    from pdserve_server.coordinator.config import CoordinatorConfig
    from pdserve_server.worker_common.config import WorkerConfig

    from pdserve_server.cli.topology import Hardware, choose_topology
    from pdserve_server.server_common.errors import CommandError

    serve_config = dataclass_from_args(ServeConfig, args)
    try:  # before the model is resolved (a GGUF conversion can take minutes): a contradiction fails at once
        topology = choose_topology(Hardware.detect(args.device), args.topology, serve_config.num_prefill,
                                   serve_config.num_decode, args.tensor_parallel_size)
    except ValueError as e:
        raise CommandError(str(e)) from None
    model_dir, name = _resolved(args)
    # Built from the same dataclasses the roles parse, then turned back into flags: every knob reaches its process.
    worker = dataclass_from_args(WorkerConfig, args, role="decode", model_dir=model_dir, port=0)
    coordinator = dataclass_from_args(CoordinatorConfig, args, model_dir=model_dir, model_name=name,
                                      colocated=topology.colocated)
    _preflight(worker, coordinator)
    logs = ["--log-level", args.log_level, "--log-format", args.log_format]
    print(f"starting pdserve ({topology.name}: {topology.why}) with {name} ...", flush=True)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM stops the cluster like Ctrl-C, never orphans it
    cluster = start_cluster(model_dir, name, serve_config, colocated=topology.colocated,
                            worker_args=dataclass_to_argv(worker, skip=SERVE_WORKER_SKIP) + logs,
                            coordinator_args=dataclass_to_argv(coordinator, skip=_PER_PROCESS - {"port"}) + logs,
                            devices=topology.devices, progress=lambda line: print(line, flush=True))
    lost = False
    try:  # from here on a SIGTERM stops the cluster: one right after "ready" once left it running (exit 130)
        print(f"pdserve ready on {cluster.address}", flush=True)
        for process, url in cluster.metrics_urls.items():
            print(f"  metrics of {process}: {url}", flush=True)
        if args.demo is not None:
            from pdserve_server.server_common.security import read_api_keys

            keys = read_api_keys(coordinator.api_keys_file)
            _stream(cluster.address, args.demo, args.demo_max_tokens, 0.0, chat=True, api_key=keys[0] if keys else None)
        else:
            cluster.supervise(restart=serve_config.restart)
            lost = True  # it returns only when the coordinator is gone
    except KeyboardInterrupt:
        pass
    finally:
        # Each process drains for up to its --drain-timeout-s, then a worker stops its engine process (10 s at
        # most): killing children earlier cut streams the drain had promised to finish.
        cluster.stop(timeout_s=max(worker.server.drain_timeout_s, coordinator.server.drain_timeout_s) + 15)
    if lost:
        raise SystemExit("pdserve: the coordinator exited; stopped the workers")


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


# ---- generate: an SDK client --------------------------------------------------------------------------------------
def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text (with --chat: one user message)")
    p.add_argument("--address", default=os.environ.get("PDSERVE_ADDRESS", "127.0.0.1:50051"),
                   help="the coordinator's host:port ($PDSERVE_ADDRESS)")
    p.add_argument("--max-tokens", type=bounded_type(int, {"min": 1}), default=64, help="most tokens to generate")
    p.add_argument("--temperature", type=bounded_type(float, {"min": 0}), default=0.0,
                   help="sampling temperature (0 = greedy)")
    p.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"), help="API key ($PDSERVE_API_KEY)")
    p.add_argument("--tls-ca", default=None, help="PEM CA of the coordinator's certificate: connect with TLS")
    p.add_argument("--timeout", type=bounded_type(float, {"gt": 0}), default=300.0,
                   help="give up on the request after this many seconds")
    p.add_argument("--priority", type=bounded_type(int, {"min": -2**31, "max": 2**31 - 1}), default=0,
                   help="scheduling priority: lower runs sooner")
    p.add_argument("--tenant", default="", help="whose fair share the request counts against (coordinators "
                                                "without API keys; default: this client's address)")
    p.add_argument("--ttft-slo-ms", type=bounded_type(int, {"min": 0, "max": 2**32 - 1}), default=0,
                   help="refuse the request (DEADLINE_EXCEEDED) unless its first token can come within this many "
                        "ms; 0 = no objective")


def _run_generate(args: argparse.Namespace) -> None:
    import grpc

    from pdserve import tls_credentials
    from pdserve_server.server_common.errors import CommandError

    credentials = tls_credentials(ca_file=args.tls_ca) if args.tls_ca else None
    try:
        _stream(args.address, args.prompt, args.max_tokens, args.temperature, chat=args.chat,
                credentials=credentials, api_key=args.api_key, timeout_s=args.timeout,
                scheduling={"priority": args.priority, "tenant": args.tenant, "ttft_slo_ms": args.ttft_slo_ms})
    except grpc.RpcError as e:  # the server's status, as one line (a traceback told the user nothing more)
        hint = {grpc.StatusCode.UNAVAILABLE: f"; is a coordinator serving on {args.address} (--address)?",
                grpc.StatusCode.DEADLINE_EXCEEDED: f" after {args.timeout:g} s (--timeout)",
                grpc.StatusCode.UNAUTHENTICATED: " (--api-key or $PDSERVE_API_KEY)"}.get(e.code(), "")
        if "cannot come in time" in (e.details() or ""):  # refused early for --ttft-slo-ms: --timeout is not why
            hint = ""
        raise CommandError(f"{e.code().name}: {e.details()}{hint}") from None


def _stream(address: str, prompt: str, max_tokens: int, temperature: float, chat: bool, credentials=None,
            api_key: str | None = None, timeout_s: float | None = None, scheduling: dict | None = None) -> None:
    """Stream one completion to stdout. scheduling: `Client.generate`'s priority / tenant / ttft_slo_ms."""
    from pdserve import Client, SamplingParams

    with Client(address, credentials=credentials, api_key=api_key) as client:
        request = [{"role": "user", "content": prompt}] if chat else prompt
        print(f">>> {prompt}", flush=True)
        for chunk in client.generate(request, SamplingParams(max_tokens=max_tokens, temperature=temperature),
                                     timeout=timeout_s, **(scheduling or {})):
            if chunk.final is not None:
                f = chunk.final
                print(f"\n[{f.finish_reason}] {f.prompt_tokens} prompt + {f.completion_tokens} completion tokens; "
                      f"TTFT {f.timings['ttft_ms']:.0f} ms, transfer {f.timings['transfer_ms']:.1f} ms, "
                      f"total {f.timings['e2e_ms']:.0f} ms", flush=True)
            else:
                print(chunk.text, end="", flush=True)


# ---- key-id: the name of an API key in logs and --tenant-weights -------------------------------------------------
def _key_id_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("keys", nargs="*", help="API keys (default: read them from stdin, one per line, which keeps them "
                                           "out of the shell's history and the process list)")


def _run_key_id(args: argparse.Namespace) -> None:
    from pdserve_server.server_common.security import key_id

    keys = args.keys or [line.strip() for line in sys.stdin if line.strip() and not line.lstrip().startswith("#")]
    for key in keys:
        print(f"key:{key_id(key)}", flush=True)


COMMANDS: dict[str, Command] = {
    "serve": Command("start coordinator + workers on this host and wait until they serve", _serve_args, _run_serve),
    "coordinator": Command("run the public gRPC server in front of running workers", _coordinator_args,
                           _run_coordinator),
    "prefill": Command("run one prefill worker", _worker_args, _run_worker("prefill")),
    "decode": Command("run one decode worker", _worker_args, _run_worker("decode")),
    "colocated": Command("run one worker that does both phases", _worker_args, _run_worker("colocated")),
    "generate": Command("stream a completion from a running coordinator", _generate_args, _run_generate),
    "key-id": Command("print the id of each API key (key:<id>), as --tenant-weights and the logs name it",
                      _key_id_args, _run_key_id, log_level="WARNING"),
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is None or the help already explains it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def build_parser(command: str) -> argparse.ArgumentParser:
    """The parser of one command (importing only that command's configuration)."""
    cmd = COMMANDS[command]
    parser = argparse.ArgumentParser(prog=f"pdserve {command}", description=cmd.help,
                                     formatter_class=_HelpFormatter)
    cmd.add_args(parser)
    parser.add_argument("--log-level", default=cmd.log_level, type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log messages at this level and above")
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="json: one JSON object per line (the access log's fields become keys)")
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    top = argparse.ArgumentParser(prog="pdserve", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        sub.add_parser(name, help=cmd.help, add_help=False)
    command = top.parse_args(argv[:1]).command  # only the name: each command builds its own flags lazily
    args = build_parser(command).parse_args(argv[1:])
    configure_logging(args.log_level, args.log_format)
    from pdserve_server.server_common.errors import CommandError

    try:
        COMMANDS[command].run(args)
    except CommandError as e:  # the operator can fix it: one line, exit status 1
        raise SystemExit(f"pdserve {command}: {e}") from None
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's status for SIGINT, not a traceback
        print(f"\npdserve {command}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
