"""Shared engine code used by both workers: model loading and definition, block pool and KV cache manager,
scheduler, model runner, sampler and the engine core loop. Moving KV blocks between workers is `kv_transfer`'s.

Nothing here imports gRPC or protobuf: plain dataclasses cross every boundary.
"""
