"""A worker process's configuration: the one definition its CLI flags (and `pdserve serve`'s) are built from."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve_server.engine.args import DEFAULT_MAX_UNREAD_TOKENS, EngineArgs
from pdserve_server.kv_transfer import BACKEND_NAMES
from pdserve_server.server_common.config import ServerArgs

WORKER_ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class WorkerConfig:
    """Configuration of one worker process, read once from the CLI.

    Attributes:
        role: "prefill", "decode" or "colocated" (the command, not a flag).
        engine: engine knobs.
        served_model_name: the name the coordinator serves the model as (--served-model-name, as the
            coordinator's): the model_name label of this worker's metrics, so dashboards join both; "" = the model
            directory's name.
        server: gRPC bind settings.
        connector: KV connector a decode worker listens on: "auto", or one of `kv_transfer.BACKEND_NAMES`.
        kv_port: decode: the KV listener's port (0 = any free port); fix it to publish or firewall it.
        kv_timeout_s: decode: how long reserved blocks wait for their KV (the lease), seconds.
        transfer_timeout_s: bound on one request's KV transfer, seconds.
        kv_layerwise: prefill: stream each layer's KV as the last prefill chunk writes it, overlapping the
            transfer with the forward, instead of sending whole blocks after the first token.
        engine_process: run the engine core (scheduler, model, KV cache) in a process of its own
            (`engine.core.process_engine`), else on a thread of the worker's process.
        engine_restart: when the engine process dies, restart it in place (`worker_common.supervisor`) instead of
            exiting non-zero for the orchestrator (or `serve --restart`) to restart the worker.
        max_unread_tokens: tokens a request may have waiting unread (its client reads slower than it decodes)
            before it is paused: out of the batch, its KV kept while blocks allow; resumed when the reader catches
            up (`engine.core.async_engine.RequestStream`). 0 = never pause.
        stream_interval: a decode stream's tokens are sent N at a time (the first token and a finish at once).
        log_level / log_format: the process's logging (the global --log-level / --log-format), which an engine
            process is given too.
    """

    role: str = field(metadata={"cli": False})
    engine: EngineArgs
    served_model_name: str = field(default="", metadata={"cli": False})
    server: ServerArgs = ServerArgs()
    connector: str = field(default="auto", metadata={
        "choices": ("auto", *BACKEND_NAMES),
        "help": "KV transfer connector decode workers listen on (auto = ucx on CUDA if it handshakes, else tcp;"
                " nccl = torch.distributed point-to-point: NCCL on CUDA, gloo on CPU)"})
    kv_port: int = field(default=0, metadata={
        "min": 0, "max": 65535, "help": "decode: KV listener port (0 = any free port)"})
    kv_timeout_s: float = field(default=60.0, metadata={
        "gt": 0, "help": "lease on decode blocks reserved for KV, seconds"})
    transfer_timeout_s: float = field(default=30.0, metadata={"gt": 0, "help": "bound on one KV transfer, seconds"})
    kv_layerwise: bool = field(default=False, metadata={
        "help": "prefill: stream each layer's KV while the last prefill chunk computes (else whole blocks after "
                "the first token)"})
    engine_process: bool = field(default=True, metadata={
        "help": "run the engine core (scheduler, model, KV cache) in a process of its own, so its steps and this "
                "process's gRPC and KV transfers never share a GIL and a crash there fails requests cleanly "
                "(--no-engine-process: a thread of the worker's process)"})
    engine_restart: bool = field(default=False, metadata={
        "help": "when the engine process dies (killed, crashed), restart it in place with a bounded backoff (else "
                "fail what is in flight, drain and exit non-zero, for the orchestrator to restart the worker)"})
    max_unread_tokens: int = field(default=DEFAULT_MAX_UNREAD_TOKENS, metadata={
        "min": 0, "help": "pause a request whose client has this many tokens unread (frees its batch slot; KV kept "
                          "while blocks allow); 0 = never"})
    stream_interval: int = field(default=1, metadata={
        "min": 1, "help": "decode: tokens a request's stream sends together (vLLM's and SGLang's --stream-interval): "
                          "1 = each token as it is sampled; N = every N tokens, the first and the last at once "
                          "(N-fold fewer messages for the coordinator to relay, a chunk up to N-1 steps later)"})
    log_level: str = field(default="info", metadata={"cli": False})
    log_format: str = field(default="text", metadata={"cli": False})
