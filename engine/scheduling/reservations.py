"""Remote-KV reservations: on a decode worker of a disaggregated cluster a request's prompt KV is computed elsewhere,
so before anything runs it needs blocks reserved for that KV to land in. `Reservations` queues such requests in
policy order and reserves their blocks while the pool allows; each reservation is answered with `Reserved` (the
block table the sender writes into, and how many leading blocks this worker holds already). The request then
waits for its KV (`Scheduler.kv_arrived`) and joins the batch with its first token. Engine thread only.
"""
from __future__ import annotations

from pdserve_server.engine.scheduling.kv_cache_manager import KVCacheManager
from pdserve_server.engine.outputs import Reserved
from pdserve_server.engine.scheduling.policy import RequestQueue, SchedulingPolicy
from pdserve_server.engine.request import Request, RequestStatus


class Reservations:
    """Remote-KV requests waiting for blocks (status WAITING_FOR_BLOCKS), in policy order.

    Args:
        policy: the scheduler's policy (the order reservations are made in).
        kv: the block tables and pool the blocks come from.
    """

    def __init__(self, policy: SchedulingPolicy, kv: KVCacheManager):
        self.queue = RequestQueue(policy)
        self.kv = kv

    def __len__(self) -> int:
        return len(self.queue)

    def push(self, req: Request) -> None:
        """Queue a new remote-KV request."""
        req.status = RequestStatus.WAITING_FOR_BLOCKS
        self.queue.push(req)

    def remove(self, req: Request) -> None:
        """Drop req if queued (an abort)."""
        self.queue.remove(req)

    def reserve(self, owed: int) -> list[Reserved]:
        """Reserve blocks for queued requests, in policy order, while the pool keeps `owed` blocks free (what the
        requests already admitted still need: `Scheduler.reserve`). A reserved request is WAITING_FOR_KV; blocks
        this worker holds already for its prompt (prefix cache) are reused and reported, not sent again."""
        out: list[Reserved] = []
        while (req := self.queue.peek()) is not None:
            cached = self.kv.get_computed_blocks(req)  # KV this worker already holds need not be sent again
            # Under a sliding window the blocks behind the window of the first token decoded here take none of the
            # pool: null from the start, never hashed, never sent (the prefill worker gives back the same ones:
            # same tokens, window and block size, the cluster's layout hash, and sends only the rest).
            take = self.kv.num_blocks_to_allocate(req.request_id, req.num_tokens, cached, req.num_tokens)
            if self.kv.pool.num_free_blocks - take < owed \
                    or not self.kv.allocate_slots(req.request_id, req.num_tokens, cached, req.num_tokens):
                break
            self.queue.remove(req)
            self.kv.record_prefix_query(req.num_tokens, len(cached) * self.kv.block_size)
            req.status = RequestStatus.WAITING_FOR_KV
            skip = max(len(cached), self.kv.num_released(req.request_id))
            out.append(Reserved(req.request_id, list(self.kv.get_block_table(req.request_id)), skip))
        return out
