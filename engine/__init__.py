"""The engine every worker runs, in five rooms and the types they share:

- `scheduling/`: what each step computes and the KV blocks it needs (scheduler, policy, step budget and cost model,
  admission, remote-KV reservations, parallel sampling's fork, stop rule, KV cache manager, block pool);
- `execution/`: running a step (model runner, sampler, the KV cache tensors, CPU linears and decode stack, CUDA
  graphs, weight loading);
- `core/`: the engine loop (`engine_core`) and its clients in this process or another (`async_engine`,
  `process_engine`, `core_process`), the commands it takes, the messages that cross the process boundary, and the
  tensor-parallel ranks 1..N-1 as processes (`ranks`);
- `parallel/`: tensor parallelism's group and collectives (which heads a rank holds, all-reduce over shared memory
  or torch.distributed);
- `offload/`: KV tiers under the pool (host memory, disk): evicted prefix-cache blocks kept, and loaded back by a
  lookup that misses the pool;
- beside them: `models/` (architectures; `models/sharding.py` says how each parameter splits across ranks),
  `mock/` (the simulated engine), the builder and the offline API, and what several rooms share: settings (`args`,
  `config`, `hardware`), records (`request`, `outputs`, `errors`, `attention`'s metadata, `kv_stream`) and the two
  features both the scheduler and the runner take part in (`speculative`, `structured`).

Moving KV blocks between workers is `kv_transfer`'s. Nothing here imports gRPC or protobuf: plain dataclasses cross
every boundary.
"""
