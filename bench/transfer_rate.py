"""KV-transfer micro-benchmark: bytes/s of each connector moving one request's KV between two processes, against
a plain-socket ceiling measured in the same run, and the share of TTFT the transfer costs.

For prompts of 128 / 512 / 2048 tokens of the default model (SmolLM2-135M, fp32 KV, block 16: 30 layers x K,V x
16 tokens x 3 heads x 64 dims x 4 B = 720 KiB per block) it measures, median of --repeats after one warm-up:
- each connector (ucx, tcp, nccl): `KvSender.send` to a `KvReceiver` in a spawned process, receiver writing straight
  into its cache tensor (the production path, one message per block, channel reused as in serving); ucx once per
  `--ucx-tls` setting (UCX's TCP transport alone, and with its shared-memory ones: `sm` = posix/sysv shared
  memory + cma single-copy between processes; tcp stays listed because UCX's sockaddr connection setup needs it:
  with `sm,self` alone the first transfer never completes); nccl runs its gloo backend for this CPU cache;
- each of those again as `<name>+layers`: `KvSender.send_layers` with every layer already written, i.e. the
  layer-wise streaming protocol's own cost (one message per block and layer: 30x the messages) without the
  forward it overlaps in serving (bench/layerwise.py measures that end to end);
- plain socket: one `sendall` of the same bytes over a fresh-process TCP socket with a 1-byte ack (the ceiling);
- prefill: the engine's own prefill step for that prompt on this machine (1 torch thread, as a worker runs);
and prints transfer time / (prefill + transfer), the share of a disaggregated TTFT spent moving KV.

Usage: python bench/transfer_rate.py [--repeats 5] [--ucx-tls tcp,self --ucx-tls sm,tcp,self] [--out kv_transfer.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

PROMPTS = (128, 512, 2048)


def _block_geometry(model_dir: str, block_size: int) -> tuple[int, int]:
    """(bytes of one KV block (all layers, K and V) of the model in fp32, as the workers allocate it, layers)."""
    from transformers import AutoConfig

    from pdserve_server.engine.config import kv_bytes_per_block

    from pdserve_server.engine.models.config import ModelConfig

    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir), name="m", path=model_dir, dtype="float32")
    return kv_bytes_per_block(cfg, block_size), cfg.num_layers


def _receiver_main(backend: str, block_nbytes: int, num_blocks: int, conn) -> None:
    """Spawned process: serve KV offers into a preallocated cache until told to stop."""
    from pdserve_server.kv_transfer import get_backend, release_transports
    from pdserve_server.kv_transfer.receiver import KvReceiver

    import torch

    cache = torch.zeros((num_blocks, block_nbytes), dtype=torch.uint8)  # rows: 1-D uint8 block views, as KVCache

    class Sink:
        def begin_receive(self, request_id, first_block, n, num_tokens, trace_context):
            return list(range(n))

        def end_receive(self, request_id, first_token, error):
            pass

    async def main():
        receiver = KvReceiver(get_backend(backend), "bench", lambda b: [cache[b]], Sink(), timeout_s=120)
        conn.send(await receiver.start("127.0.0.1"))
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # wait for "stop"
        receiver.close()
        release_transports()

    asyncio.run(main())


def _socket_receiver(port_conn, total: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_conn.send(srv.getsockname()[1])
    sock, _ = srv.accept()
    buf = memoryview(bytearray(total))
    while True:
        got = 0
        while got < total:
            n = sock.recv_into(buf[got:])
            if n == 0:
                return
            got += n
        sock.sendall(b"k")


def plain_socket(nbytes: int, repeats: int) -> float:
    """Median seconds to push nbytes through a loopback TCP socket to another process (with a 1-byte ack)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_socket_receiver, args=(child, nbytes), daemon=True)
    proc.start()
    sock = socket.create_connection(("127.0.0.1", parent.recv()))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        sock.sendall(memoryview(data))
        sock.recv(1)
        if i:
            times.append(time.perf_counter() - t)
    sock.close()
    proc.join(5)
    return statistics.median(times)


def connector(backend: str, block_nbytes: int, num_blocks: int, repeats: int, layers: int = 0) -> float:
    """Median seconds of KvSender.send for num_blocks blocks to a receiver process over `backend`; with `layers`,
    of KvSender.send_layers with every layer already written (the layer-wise protocol's own cost: a message per
    block and layer, no compute to overlap)."""
    from pdserve_server.engine.kv_stream import KvLayerProgress
    from pdserve_server.kv_transfer import release_transports
    from pdserve_server.kv_transfer.sender import KvSender

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(backend, block_nbytes, num_blocks, child), daemon=True)
    proc.start()
    address = parent.recv()
    import torch

    gen = torch.Generator().manual_seed(1)
    src = torch.randint(0, 256, (num_blocks, block_nbytes), dtype=torch.uint8, generator=gen)

    async def main():
        sender = KvSender("bench", lambda b: [src[b]], timeout_s=120)
        times = []
        for i in range(repeats + 1):  # the first send also connects: left out
            if layers:
                progress = KvLayerProgress(layers)
                progress.begin(list(range(num_blocks)), num_blocks * 16)
                for layer in range(layers):
                    progress.layer_written(layer, torch.device("cpu"))
                await asyncio.sleep(0)  # the engine-side calls post to the loop: let them land before the token
                progress.finish(0)
                stats = await sender.send_layers(address, f"r{i}", progress)
            else:
                stats = await sender.send(address, f"r{i}", 0, list(range(num_blocks)), num_blocks * 16)
            if i:
                times.append(stats.seconds)
        sender.close()
        release_transports()  # UCX's context is bound to this loop; the next measurement runs another
        return statistics.median(times)

    try:
        return asyncio.run(main())
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def prefill_seconds(model_dir: str, prompt_len: int, repeats: int) -> float:
    """Median seconds of the engine's prefill step (whole prompt in one step, 1 thread, no prefix cache hit)."""
    import torch

    from pdserve_server.engine.args import EngineArgs
    from pdserve_server.engine.builder import build_engine
    from pdserve_server.engine.offline import run_until_idle
    from pdserve_server.engine.request import Request, SamplingParams

    torch.set_num_threads(1)
    parts = build_engine(EngineArgs(model_dir=model_dir, kv_tokens=4 * 2048, max_num_batched_tokens=2048,
                                    max_model_len=4096, enable_prefix_caching=False))
    times = []
    rng = np.random.default_rng(prompt_len)
    for i in range(repeats + 1):
        req = Request(f"p{i}", rng.integers(3, 40000, prompt_len).tolist(),
                      SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        parts.scheduler.add_request(req)
        out = parts.scheduler.schedule()
        t = time.perf_counter()
        sampled = parts.runner.execute(out)
        if i:
            times.append(time.perf_counter() - t)
        parts.scheduler.update(out, sampled)
        run_until_idle(parts)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompts", default=",".join(map(str, PROMPTS)), help="prompt lengths in tokens")
    p.add_argument("--ucx-tls", action="append", default=None,
                   help="UCX_TLS for a ucx measurement; repeat for several (default: tcp,self and sm,tcp,self)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from pdserve_server.cli.models import resolve_model
    from pdserve_server.kv_transfer import available_backends

    model_dir = args.model_dir or str(resolve_model(None))
    block_nbytes, num_layers = _block_geometry(model_dir, 16)
    rows = []
    for n in (int(x) for x in args.prompts.split(",")):
        blocks = -(-n // 16)
        nbytes = blocks * block_nbytes
        row = {"prompt_tokens": n, "blocks": blocks, "mib": nbytes / 2 ** 20,
               "plain_socket_mib_s": nbytes / 2 ** 20 / plain_socket(nbytes, args.repeats),
               "prefill_ms": prefill_seconds(model_dir, n, min(args.repeats, 3)) * 1e3}
        runs = [("tcp", "tcp", None)]
        if "ucx" in available_backends():
            runs += [(f"ucx[{tls}]", "ucx", tls) for tls in args.ucx_tls or ["tcp,self", "sm,tcp,self"]]
        if "nccl" in available_backends():  # torch.distributed point-to-point: gloo for this CPU cache
            runs.append(("nccl[gloo]", "nccl", None))
        runs += [(f"{name}+layers", backend, tls) for name, backend, tls in runs]
        for name, backend, tls in runs:
            if tls:  # read by UCX when the context starts: the receiver process inherits it, the sender restarts UCX
                os.environ["UCX_TLS"] = tls
            s = connector(backend, block_nbytes, blocks, args.repeats, num_layers if "+layers" in name else 0)
            row[f"{name}_ms"] = s * 1e3
            row[f"{name}_mib_s"] = nbytes / 2 ** 20 / s
            row[f"{name}_vs_socket"] = row[f"{name}_mib_s"] / row["plain_socket_mib_s"]
            row[f"{name}_ttft_share"] = s * 1e3 / (row["prefill_ms"] + s * 1e3)
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
