"""Contract tests every KV connector must pass: bytes land intact in the right blocks, rejections and
incompatible peers give clear errors, and peer death on either side ends in an error, not a hang."""
import asyncio

import numpy as np
import pytest

from engine.errors import ErrorKind
from engine.transfer import available_backends, get_backend
from engine.transfer.protocol import KvReceiver, KvSender, TransferError

BACKENDS = available_backends()
BLOCK = 4096


class FakeCache:
    def __init__(self, num_blocks, seed, block_nbytes=BLOCK):
        rng = np.random.default_rng(seed)
        self.blocks = [rng.integers(0, 256, block_nbytes, dtype=np.uint8) for _ in range(num_blocks)]

    def view(self, b):
        return self.blocks[b]


class Sink:
    def __init__(self):
        self.reserved = {}
        self.ended = {}
        self.on_begin = None

    def begin_receive(self, rid, num_blocks, num_tokens, trace_context):
        if rid not in self.reserved:
            raise LookupError(f"no reservation for {rid}")
        if self.on_begin:
            self.on_begin()
        return self.reserved[rid]

    def end_receive(self, rid, first_token, error):
        self.ended[rid] = (first_token, error)


async def _pair(backend_name, sink, dst, compat="abc", timeout_s=5.0):
    receiver = KvReceiver(get_backend(backend_name), compat, dst.view, sink, timeout_s=timeout_s)
    address = await receiver.start("127.0.0.1")
    return receiver, address


@pytest.mark.parametrize("backend", BACKENDS)
def test_blocks_arrive_in_reserved_blocks(backend):
    async def main():
        src, dst, sink = FakeCache(8, 1), FakeCache(8, 2), Sink()
        receiver, address = await _pair(backend, sink, dst)
        sender = KvSender("abc", src.view, timeout_s=10)
        try:
            sink.reserved["r1"] = [6, 0, 3]
            stats = await sender.send(address, "r1", 42, [1, 2, 5], num_tokens=10)
            assert stats.num_blocks == 3 and stats.num_bytes == 3 * BLOCK
            for s, d in zip([1, 2, 5], [6, 0, 3]):
                np.testing.assert_array_equal(dst.blocks[d], src.blocks[s])
            assert sink.ended["r1"] == (42, None)
            sink.reserved["r2"] = [7]  # the pooled channel is reused for the next request
            await sender.send(address, "r2", 7, [4], num_tokens=3)
            np.testing.assert_array_equal(dst.blocks[7], src.blocks[4])
        finally:
            sender.close()
            receiver.close()
    asyncio.run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_unknown_request_rejected_and_channel_still_usable(backend):
    async def main():
        src, dst, sink = FakeCache(4, 1), FakeCache(4, 2), Sink()
        receiver, address = await _pair(backend, sink, dst)
        sender = KvSender("abc", src.view, timeout_s=10)
        try:
            with pytest.raises(TransferError) as e:
                await sender.send(address, "ghost", 1, [0], num_tokens=1)
            assert e.value.kind == ErrorKind.TRANSFER_REJECTED and "no reservation" in str(e.value)
            sink.reserved["ok"] = [1]
            await sender.send(address, "ok", 1, [0], num_tokens=1)
            np.testing.assert_array_equal(dst.blocks[1], src.blocks[0])
        finally:
            sender.close()
            receiver.close()
    asyncio.run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_incompatible_layout_refused_at_handshake(backend):
    async def main():
        src, dst, sink = FakeCache(2, 1), FakeCache(2, 2), Sink()
        receiver, address = await _pair(backend, sink, dst, compat="abc")
        sender = KvSender("xyz", src.view, timeout_s=10)
        try:
            with pytest.raises(TransferError) as e:
                await sender.send(address, "r", 1, [0], num_tokens=1)
            assert e.value.kind == ErrorKind.INCOMPATIBLE_PEER and "incompatible" in str(e.value)
        finally:
            sender.close()
            receiver.close()
    asyncio.run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_receiver_death_mid_transfer_is_an_error_not_a_hang(backend):
    async def main():
        big = 256  # 64 MiB: far more than the socket buffers hold, so the transfer is mid-flight at close
        src, dst, sink = FakeCache(big, 1, 1 << 18), FakeCache(big, 2, 1 << 18), Sink()
        receiver, address = await _pair(backend, sink, dst)
        sender = KvSender("abc", src.view, timeout_s=10)
        sink.reserved["r"] = list(range(big))
        sink.on_begin = lambda: asyncio.get_running_loop().call_soon(receiver.close)
        try:
            with pytest.raises(TransferError) as e:
                await asyncio.wait_for(sender.send(address, "r", 1, list(range(big)), num_tokens=big), 20)
            assert e.value.kind in (ErrorKind.TRANSFER_FAILED, ErrorKind.KV_TIMEOUT)
        finally:
            sender.close()
            receiver.close()
    asyncio.run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_cancel_mid_transfer_reports_failure_to_receiver(backend):
    async def main():
        big = 256
        src, dst, sink = FakeCache(big, 1, 1 << 18), FakeCache(big, 2, 1 << 18), Sink()
        receiver, address = await _pair(backend, sink, dst)
        sender = KvSender("abc", src.view, timeout_s=10)
        sink.reserved["r"] = list(range(big))
        started = asyncio.Event()
        sink.on_begin = started.set
        try:
            task = asyncio.create_task(sender.send(address, "r", 1, list(range(big)), num_tokens=big))
            await asyncio.wait_for(started.wait(), 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(200):
                if "r" in sink.ended:
                    break
                await asyncio.sleep(0.05)
            first, error = sink.ended["r"]
            assert error and "interrupted" in error
        finally:
            sender.close()
            receiver.close()
    asyncio.run(main())


def test_ucx_is_available_here():
    """The flagship connector must import and run on the CI machine (ucxx-cu12 is a declared dependency)."""
    assert "ucx" in BACKENDS
