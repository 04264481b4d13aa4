"""Stand-in rank processes for tests/engine/test_tensor_parallel.py, spawned: this module imports only the standard
library, so a child starts at once and holds no threads that could keep it from exiting (the test module itself pulls in
torch, the engine and their threads)."""
import os
import time


def shard_rank(send, behaviour: str) -> None:
    """Send a KV shard's bytes, die before sending (exit code 3, as a crashed rank: no clean-up), or hang."""
    if behaviour == "send":
        send.send_bytes(b"shard")
    elif behaviour == "exit":
        os._exit(3)
    else:
        time.sleep(60)
