"""The coordinator's public doors: each maps its protocol onto the one request path (`coordinator.request_path`)
and back, and a RequestError onto its own wire. `generation` is pdserve.v1.Generation, `vllm_engine` vLLM's gRPC
engine service (for the smg gateway), `kserve` KServe v2 / Triton's inference service; `grpc_call` is what every
gRPC door does with its call (the caller's identity, the deadline, writes a stalled client cannot hold)."""
