"""Shared engine code used by both workers: model loading and definition, block pool and KV cache manager,
scheduler, model runner, sampler, engine core loop and the KV transfer connectors.

Nothing here imports gRPC or protobuf: plain dataclasses cross every boundary.
"""
