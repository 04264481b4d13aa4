"""The `pdserve` command line: serve (whole local cluster), coordinator / prefill / decode / colocated (one role),
and generate (stream a completion from a running coordinator)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and KV dtype (fp32 is fastest on CPUs without bf16 units)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-tokens", type=int, default=None, help="KV budget in tokens (default 16384)")
    g.add_argument("--kv-bytes", type=int, default=None, help="KV budget in bytes (instead of --kv-tokens)")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per engine step")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests in the running batch")
    g.add_argument("--max-model-len", type=int, default=4096, help="most prompt + output tokens per request")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    g.add_argument("--threads", type=int, default=1, help="torch threads per worker process")
    g.add_argument("--device", default="cpu")
    g.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "torch"],
                   help="paged attention ops (auto = Triton kernels on CUDA, torch reference on CPU)")
    g.add_argument("--connector", default="auto", choices=["auto", "ucx", "tcp"],
                   help="KV transfer connector (decode workers listen on it; auto = ucx if it handshakes, else tcp)")
    g.add_argument("--kv-timeout-s", type=float, default=60.0, help="lease on reserved decode blocks")
    g.add_argument("--transfer-timeout-s", type=float, default=30.0, help="bound on one KV transfer")
    g.add_argument("--random-weights", action="store_true", help="random weights from the model's config")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0 = any free port; see --ready-file)")
    p.add_argument("--ready-file", default=None, help="write {\"address\": ...} here once serving")
    p.add_argument("--log-level", default="INFO")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: packaged SmolLM2-135M)")
    p.add_argument("--model-dir", default=None, help="already-resolved HF directory (skips GGUF conversion)")


def _resolve(args) -> tuple[str, str]:
    """(model_dir, served name)."""
    from engine.loader import default_model_path, resolve_model

    if args.model_dir:
        return args.model_dir, Path(args.model_dir).name
    source = Path(args.model) if args.model else default_model_path()
    return str(resolve_model(args.model)), source.name.split(".")[0] if source.suffix == ".gguf" else source.name


def _worker_config(role: str, args):
    from engine.builder import EngineArgs
    from worker_common.worker import WorkerConfig

    model_dir, _ = _resolve(args)
    kv_tokens = args.kv_tokens if args.kv_tokens is not None or args.kv_bytes is not None else 16384
    engine = EngineArgs(model_dir=model_dir, dtype=args.dtype, block_size=args.block_size,
                        kv_tokens=kv_tokens, kv_bytes=args.kv_bytes,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                        device=args.device, seed=args.seed, attention_backend=args.attention_backend)
    return WorkerConfig(role=role, engine=engine, host=args.host, port=args.port, threads=args.threads,
                        connector=args.connector, kv_timeout_s=args.kv_timeout_s,
                        transfer_timeout_s=args.transfer_timeout_s, ready_file=args.ready_file,
                        random_weights=args.random_weights)


def _run(coro) -> None:
    """Run a server coroutine until SIGINT/SIGTERM."""
    async def main():
        task = asyncio.create_task(coro)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass
    asyncio.run(main())


def cmd_worker(args) -> None:
    config = _worker_config(args.command, args)
    if args.command == "prefill":
        from prefill_worker.server import serve
    else:
        from decode_worker.server import serve
    _run(serve(config))


def cmd_coordinator(args) -> None:
    from coordinator.server import CoordinatorConfig, serve

    model_dir, name = _resolve(args)
    config = CoordinatorConfig(model_dir=model_dir, model_name=args.served_model_name or name,
                               decode_addresses=tuple(args.decode), prefill_addresses=tuple(args.prefill),
                               colocated=args.colocated, host=args.host, port=args.port,
                               max_in_flight=args.max_in_flight, kv_timeout_ms=int(args.kv_timeout_s * 1000),
                               ready_file=args.ready_file)
    _run(serve(config))


def cmd_serve(args) -> None:
    from pdserve.launcher import start_cluster

    model_dir, name = _resolve(args)
    worker_args = ["--threads", str(args.threads), "--dtype", args.dtype, "--block-size", str(args.block_size),
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs",
                   str(args.max_num_seqs), "--max-model-len", str(args.max_model_len), "--connector", args.connector,
                   "--device", args.device, "--seed", str(args.seed), "--attention-backend", args.attention_backend,
                   "--kv-timeout-s", str(args.kv_timeout_s), "--transfer-timeout-s", str(args.transfer_timeout_s),
                   "--log-level", args.log_level]
    if args.kv_tokens is not None:
        worker_args += ["--kv-tokens", str(args.kv_tokens)]
    if args.kv_bytes is not None:
        worker_args += ["--kv-bytes", str(args.kv_bytes)]
    if args.no_prefix_caching:
        worker_args.append("--no-prefix-caching")
    if args.random_weights:
        worker_args.append("--random-weights")
    print(f"starting pdserve ({'colocated' if args.colocated else 'disaggregated'}) with {name} ...", flush=True)
    cluster = start_cluster(model_dir, name, num_prefill=args.num_prefill, num_decode=args.num_decode,
                            colocated=args.colocated, port=args.port, worker_args=worker_args,
                            coordinator_args=["--log-level", args.log_level], log_dir=args.log_dir)
    print(f"pdserve ready on {cluster.address}", flush=True)
    try:
        if args.demo is not None:
            _stream(cluster.address, args.demo, args.demo_max_tokens, 0.0, chat=True)
        else:
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()


def _stream(address: str, prompt: str, max_tokens: int, temperature: float, chat: bool) -> None:
    from pdserve.client import Client, SamplingParams

    with Client(address) as client:
        request = [{"role": "user", "content": prompt}] if chat else prompt
        print(f">>> {prompt}", flush=True)
        for chunk in client.generate(request, SamplingParams(max_tokens=max_tokens, temperature=temperature)):
            if chunk.final is not None:
                f = chunk.final
                print(f"\n[{f.finish_reason}] {f.prompt_tokens} prompt + {f.completion_tokens} completion tokens; "
                      f"TTFT {f.timings['ttft_ms']:.0f} ms, transfer {f.timings['transfer_ms']:.1f} ms, "
                      f"total {f.timings['e2e_ms']:.0f} ms", flush=True)
            else:
                print(chunk.text, end="", flush=True)


def cmd_generate(args) -> None:
    _stream(args.address, args.prompt, args.max_tokens, args.temperature, chat=args.chat)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="start coordinator + workers on localhost and wait until healthy")
    _model_args(p)
    _add_engine_args(p)
    p.add_argument("--port", type=int, default=50051, help="coordinator port (0 = any free port)")
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--colocated", action="store_true", help="one worker runs both phases (baseline)")
    p.add_argument("--log-dir", default=None, help="write each process's log to a file here")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--demo", nargs="?", const="Explain in two sentences why the sky is blue.", default=None,
                   help="send one chat request, stream it, then shut down")
    p.add_argument("--demo-max-tokens", type=int, default=64)
    p.set_defaults(func=cmd_serve)

    for role in ("prefill", "decode", "colocated"):
        p = sub.add_parser(role, help=f"run one {role} worker")
        _model_args(p)
        _add_engine_args(p)
        _add_common(p)
        p.set_defaults(func=cmd_worker)

    p = sub.add_parser("coordinator", help="run the public gRPC server in front of running workers")
    _model_args(p)
    _add_common(p)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--prefill", action="append", default=[], help="prefill worker address (repeat)")
    p.add_argument("--decode", action="append", default=[], help="decode (or colocated) worker address (repeat)")
    p.add_argument("--colocated", action="store_true")
    p.add_argument("--max-in-flight", type=int, default=256)
    p.add_argument("--kv-timeout-s", type=float, default=60.0)
    p.set_defaults(func=cmd_coordinator)

    p = sub.add_parser("generate", help="stream a completion from a running coordinator")
    p.add_argument("prompt")
    p.add_argument("--address", default=os.environ.get("PDSERVE_ADDRESS", "127.0.0.1:50051"))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
    p.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
