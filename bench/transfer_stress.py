"""KV transfer under random cancellation: hundreds of concurrent transfers between two processes, each cancelled at
a random moment (or not), then a check that the receiver is alive, holds no block mid-receive, received intact
bytes for every transfer it completed, and that one more transfer still works.

    .venv/bin/python bench/transfer_stress.py --backend ucx --transfers 2000 [--concurrency 64] [--out FILE]

The receiver runs in a child process (as a decode worker does) with its own free list of blocks; the sender runs
here (as a prefill worker does). Block j of transfer i carries the bytes of source block (i + j) % SOURCE_BLOCKS,
each source block filled with one byte value, so the receiver checks content without being told it. A quarter of
the cancels come at once (they always land mid-transfer); the other moments are scaled to this machine's own median
transfer time (`--cancel-window`), measured first on uncancelled transfers.
tests/kv_transfer/test_transfer.py::test_transfer_stress_with_random_cancellations runs a short form of it in CI.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SOURCE_BLOCKS = 97
COMPAT = "stress"
EARLY_CANCELS = 0.25  # share of the cancels issued at the transfer's first await rather than at a random moment


def _block_value(source_block: int) -> int:
    return (source_block * 37 + 11) % 251


class _Sink:
    """A decode worker's reservations, reduced: any id may send; blocks come from a free list and go back to it
    only when the receiver says its writes stopped (end_receive)."""

    def __init__(self, blocks):
        self.blocks = blocks
        self.free = list(range(len(blocks)))
        self.receiving: dict[str, list[int]] = {}
        self.completed = self.failed = self.rejected = self.corrupt = 0

    def begin_receive(self, rid, first_block, num_blocks, num_tokens, trace_context):
        if num_blocks > len(self.free):
            self.rejected += 1
            raise LookupError(f"no room for {rid}")
        ids = [self.free.pop() for _ in range(num_blocks)]
        self.receiving[rid] = ids
        return ids

    def end_receive(self, rid, first_token, error):
        ids = self.receiving.pop(rid)
        if error:
            self.failed += 1
        else:
            self.completed += 1
            for j, b in enumerate(ids):  # first_token carries the transfer index i
                want = _block_value((first_token + j) % SOURCE_BLOCKS)
                if not bool((self.blocks[b] == want).all()):
                    self.corrupt += 1
                    break
        self.free.extend(ids)


def _receiver_main(backend_name: str, num_blocks: int, block_nbytes: int, conn) -> None:
    """Child process: listen, report the address, then answer "report" requests until told to stop."""
    import torch

    from pdserve_server.kv_transfer import get_backend, release_transports
    from pdserve_server.kv_transfer.receiver import KvReceiver

    async def main() -> None:
        blocks = [torch.zeros(block_nbytes, dtype=torch.uint8) for _ in range(num_blocks)]
        sink = _Sink(blocks)
        receiver = KvReceiver(get_backend(backend_name), COMPAT, lambda b: [blocks[b]], sink, timeout_s=10)
        conn.send(await receiver.start("127.0.0.1"))
        loop = asyncio.get_running_loop()
        while True:
            cmd = await loop.run_in_executor(None, conn.recv)
            if cmd == "stop":
                receiver.close()
                release_transports()
                return
            conn.send({"completed": sink.completed, "failed": sink.failed, "rejected": sink.rejected,
                       "corrupt": sink.corrupt, "receiving": len(sink.receiving),
                       "free": len(sink.free), "total": num_blocks})

    asyncio.run(main())


async def _sender(backend_name: str, address: str, transfers: int, concurrency: int, blocks_per: tuple[int, int],
                  block_nbytes: int, cancel_fraction: float, cancel_window: float, seed: int) -> dict:
    import torch

    from pdserve_server.kv_transfer import release_transports
    from pdserve_server.kv_transfer.sender import KvSender, TransferError

    rng = random.Random(seed)
    source = [torch.full((block_nbytes,), _block_value(k), dtype=torch.uint8) for k in range(SOURCE_BLOCKS)]
    sender = KvSender(COMPAT, lambda b: [source[b]], timeout_s=15)
    outcomes: dict[str, int] = {}
    gate = asyncio.Semaphore(concurrency)

    async def timed(i: int) -> float:
        n = blocks_per[1]
        start = time.monotonic()
        await sender.send(address, f"calibrate{i}", i, [(i + j) % SOURCE_BLOCKS for j in range(n)], num_tokens=n * 16)
        return time.monotonic() - start

    # The cancel moments are drawn in units of this machine's own transfer time: a wave of `concurrency` uncancelled
    # transfers of the largest size opens the connections, a second is timed, and cancels land at uniform(0,
    # cancel_window x its median). A fixed window in ms let a fast machine finish most transfers first (55 of 280
    # cancels landed in time on an AMD EPYC VM where an Intel one had over 100).
    for wave in range(2):
        durations = sorted(await asyncio.gather(*(timed(transfers + 1 + wave * concurrency + k)
                                                  for k in range(concurrency))))
    max_cancel_s = cancel_window * durations[len(durations) // 2]

    async def one(i: int) -> None:
        async with gate:
            n = rng.randint(*blocks_per)
            ids = [(i + j) % SOURCE_BLOCKS for j in range(n)]
            task = asyncio.create_task(sender.send(address, f"r{i}", i, ids, num_tokens=n * 16))
            if rng.random() < cancel_fraction:
                # A quarter of the cancels come at the first await (the send has at least a network round trip to
                # go, so they always land mid-transfer, however busy the machine); the rest at random moments.
                await asyncio.sleep(0 if rng.random() < EARLY_CANCELS else rng.uniform(0, max_cancel_s))
                task.cancel()
            try:
                await task
                kind = "ok"
            except asyncio.CancelledError:
                kind = "cancelled"
            except TransferError as e:
                kind = e.kind.name
            outcomes[kind] = outcomes.get(kind, 0) + 1

    start = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(transfers)))
    elapsed = time.monotonic() - start
    # The sender must still work after all that.
    try:
        await sender.send(address, "final", transfers, [transfers % SOURCE_BLOCKS], num_tokens=16)
        final = "ok"
    except TransferError as e:
        final = f"{e.kind.name}: {e}"
    sender.close()
    release_transports()
    return {"outcomes": outcomes, "final_transfer": final, "seconds": round(elapsed, 2),
            "cancel_window_ms": round(max_cancel_s * 1e3, 3)}


def run(backend: str, transfers: int = 300, concurrency: int = 64, blocks_per: tuple[int, int] = (1, 8),
        block_nbytes: int = 1 << 16, cancel_fraction: float = 0.7, cancel_window: float = 2.0, seed: int = 0,
        settle_s: float = 20.0) -> dict:
    """Run the stress and return the report; `report["ok"]` says whether every check held."""
    ctx = mp.get_context("spawn")  # UCX must not be initialised before a fork
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(backend, concurrency * blocks_per[1], block_nbytes, child),
                       daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("receiver did not start within 60 s")
        address = parent.recv()
        sent = asyncio.run(_sender(backend, address, transfers, concurrency, blocks_per, block_nbytes,
                                   cancel_fraction, cancel_window, seed))
        deadline = time.monotonic() + settle_s
        while True:  # the receiver's own timeout bounds any receive whose sender vanished
            parent.send("report")
            received = parent.recv() if parent.poll(10) else {"error": "receiver did not answer"}
            if "error" in received or (received["receiving"] == 0 and received["free"] == received["total"]):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        alive = proc.is_alive()
        parent.send("stop")
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
    ok = (alive and sent["final_transfer"] == "ok" and "error" not in received and received["receiving"] == 0
          and received["free"] == received["total"] and received["corrupt"] == 0
          and received["completed"] >= sent["outcomes"].get("ok", 0))
    return {"backend": backend, "transfers": transfers, "concurrency": concurrency, "sender": sent,
            "receiver": received, "receiver_alive": alive, "receiver_exitcode": proc.exitcode, "ok": ok}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="ucx")
    p.add_argument("--transfers", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--cancel-fraction", type=float, default=0.7)
    p.add_argument("--cancel-window", type=float, default=2.0,
                   help="cancels land at uniform(0, this x the median time of an uncancelled transfer)")
    p.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(2), "little"))
    p.add_argument("--out")
    a = p.parse_args()
    report = run(a.backend, a.transfers, a.concurrency, cancel_fraction=a.cancel_fraction,
                 cancel_window=a.cancel_window, seed=a.seed)
    report["seed"] = a.seed
    print(json.dumps(report, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
