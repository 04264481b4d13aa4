"""The coordinator process's configuration: the one definition its CLI flags (and `pdserve serve`'s) are built from."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve_server.coordinator.scheduling import SCHEDULING_POLICIES
from pdserve_server.server_common.config import ServerArgs


@dataclass(frozen=True)
class CoordinatorConfig:
    """Coordinator process configuration.

    Attributes:
        model_dir: HF-format directory (for the tokenizer and chat template only).
        model_name: the name clients may pass in GenerateRequest.model.
        server: gRPC bind settings of the public API.
        prefill / decode: worker addresses; colocated mode uses `decode` only. Each is "host:port" (a DNS name is
            re-resolved and stands for every address it resolves to) or "@FILE" (host:port lines, re-read).
        colocated: route each request to one worker that runs both phases.
        max_in_flight: sequences admitted at once (a request of n samples counts n); more get RESOURCE_EXHAUSTED.
        max_in_flight_per_caller: the most sequences one caller (API key, else peer address) may have in flight, so
            one client cannot take every batch slot; 0 = no per-caller limit. Past it: RESOURCE_EXHAUSTED with a
            retry hint.
        max_queued_tokens_per_caller: the most prompt tokens one caller may have in requests still waiting for
            their first token; past it RESOURCE_EXHAUSTED with a retry hint (a prompt longer than the limit on its
            own: INVALID_ARGUMENT); 0 = no limit.
        tenant_weights: file of "NAME WEIGHT [PRIORITY_FLOOR]" lines ('#' comments): each tenant's share of the
            workers' token budget while tenants compete, and the most urgent priority it is granted
            (`coordinator.scheduling.read_tenants`); unnamed tenants weigh 1.
        scheduling_policy: "fcfs" (every request priority 0; a nonzero priority is refused) or "priority" (requests
            run at their priority, bounded by their tenant's floor: `coordinator.scheduling.grant_priority`).
        isolate_prefix_cache_by_tenant: each tenant's prompts share prefix-cache blocks (pool, offload tiers) only
            with that tenant's (the tenant is the workers' cache salt, `SchedulingHints.cache_salt`).
        kv_events_relay: serve the followed workers' KV events on the vLLM door's SubscribeKvEvents
            (`coordinator.kv_relay`), for a gateway's event-driven cache-aware routing.
        planner_profile: a step-time profile of the workers' device and model; with it the coordinator exports the
            planner's worker counts for the traffic it sees (`coordinator.capacity`); "" = off.
        planner_ttft_ms / planner_itl_ms: the objectives it plans for, ms. planner_max_workers: the most workers a
            plan may use. planner_window_s: seconds of finished requests a plan is for.
        reuse_port: bind the public port with SO_REUSEPORT, so several coordinator processes serve one address.
        request_timeout_s: deadline of each worker call, seconds.
        connect_timeout_s: at start, how long to wait for a live worker of every role, seconds.
        stats_interval_s: how often each worker's health and load (KV headroom, queue) are polled, seconds.
        discovery_interval_s: how often the addresses are re-resolved (DNS names, @FILE lists), seconds.
        api_keys_file: keys clients must present, one per line (plus $PDSERVE_API_KEYS, comma-separated); none
            configured = the public port is open.
        worker_tls_ca: PEM CA to verify workers that serve TLS; None = dial workers in plaintext.
        stall_timeout_s: a client that takes none of its stream for this long is dropped (its KV freed), seconds.
        max_migrations: how many times a request may resume on other workers after losing one (then UNAVAILABLE).
        local_prefill_tokens: disaggregated mode: a request with at most this many context tokens its decode
            worker must compute (not in its prefix cache, as far as this coordinator knows) is prefilled there,
            with no prefill worker and no KV transfer (NVIDIA Dynamo's conditional disaggregation); 0 = never.
        local_prefill_fallback: disaggregated mode: while no prefill worker is live, decode workers prefill
            locally (Dynamo's fallback to decode-only) instead of failing requests with UNAVAILABLE.
        local_prefill_queue: disaggregated mode: a decode worker prefills a request itself when it is predicted to
            give the first token sooner than the prefill workers' queues would, each at its measured rate.
        (The three make `coordinator.router.LocalPrefillPolicy`.)
        token_streams: read each decode worker's tokens from one stream per worker that carries every request's,
            a message per engine step (worker.proto's StreamTokens), instead of from each request's Decode call;
            workers that do not serve one are read per call.
        token_streams_min_requests: a request joins its worker's token stream only when this coordinator has at
            least this many other requests on that worker (0: every request): with a request or two a worker step
            a message per request costs less (no shared stream to keep moving) and adds no hop (docs/benchmarks.md,
            "Token streams").
        max_request_bytes: the largest request message the public port takes, bytes (gRPC refuses a larger one
            with RESOURCE_EXHAUSTED before parsing it); 0 = sized from the context window
            (`validation.request_bytes_limit`).
        rate_limit_requests_per_s / rate_limit_tokens_per_s: per API key (or per peer without keys), requests and
            tokens (prompt + n x max_tokens, charged at admission) per second; 0 = unlimited. Bursts of
            rate_limit_burst_s seconds' worth are allowed.
    """

    model_dir: str = field(metadata={"cli": False})
    model_name: str = field(metadata={"cli": False})
    server: ServerArgs = ServerArgs()
    prefill: tuple[str, ...] = field(default=(), metadata={
        "help": "prefill workers: host:port (DNS names re-resolved to every replica) or @FILE of host:port lines"})
    decode: tuple[str, ...] = field(default=(), metadata={
        "help": "decode (or colocated) workers: host:port or @FILE, as --prefill"})
    colocated: bool = field(default=False, metadata={"help": "one worker runs both phases (the baseline)"})
    max_in_flight: int = field(default=256, metadata={
        "min": 1, "help": "sequences admitted at once, a request of n samples counting n (more: RESOURCE_EXHAUSTED)"})
    max_in_flight_per_caller: int = field(default=0, metadata={"min": 0,
        "help": "sequences one caller (API key, else peer) may have in flight, n samples counting n; 0 = no "
                "per-caller limit"})
    max_queued_tokens_per_caller: int = field(default=0, metadata={"min": 0,
        "help": "prompt tokens one caller (API key, else peer) may have in requests not yet at their first token; "
                "0 = no limit"})
    tenant_weights: str | None = field(default=None, metadata={
        "help": "file of 'NAME WEIGHT [PRIORITY_FLOOR]' lines ('#' comments; read at start): fair-share weights of "
                "tenants (unnamed ones weigh 1) and, under --scheduling-policy priority, the most urgent priority "
                "each may use (unnamed API keys: 0). NAME is a request's tenant field, 'peer:ipv4:<ip>' for a "
                "keyless client without one, or 'key:<id>' for an API key: `pdserve key-id` prints a key's id (the "
                "first 8 hex digits of its SHA-256; the coordinator also logs its keys' ids at start)"})
    scheduling_policy: str = field(default="fcfs", metadata={"choices": SCHEDULING_POLICIES,
        "help": "fcfs: requests run in arrival order within their tenant's share, a nonzero priority is refused; "
                "priority: lower priority runs sooner (and may preempt), bounded by each tenant's floor in "
                "--tenant-weights"})
    isolate_prefix_cache_by_tenant: bool = field(default=False, metadata={
        "help": "a tenant's cached prompt blocks (KV pool and offload tiers) serve only that tenant's requests, so "
                "no tenant can learn from TTFT whether another sent a prompt; as strong as the tenant's identity: "
                "with API keys the key decides, without them the request's tenant field or the peer address"})
    kv_events_relay: bool = field(default=False, metadata={
        "help": "relay the workers' KV events (workers started with --kv-events) on the vLLM door's "
                "SubscribeKvEvents, as vLLM's, for smg's event-driven cache-aware routing; the stream shows every "
                "cached prompt's tokens, so only for a port whose callers are trusted (the gateway)"})
    planner_profile: str = field(default="", metadata={
        "help": "export how many prefill and decode workers the traffic seen needs (pdserve:planner_recommended_"
                "workers{role}, for an autoscaler), planned on this step-time profile of the workers' device and "
                "model: a shipped name (llama-3.1-8b-h200, smollm2-135m-h200) or a profile file; empty = off"})
    planner_ttft_ms: float = field(default=2000.0, metadata={"gt": 0, "help": "the planner's TTFT objective, ms"})
    planner_itl_ms: float = field(default=50.0, metadata={"gt": 0, "help": "the planner's ITL objective, ms"})
    planner_max_workers: int = field(default=64, metadata={"min": 2, "help": "the most workers a plan may use"})
    planner_window_s: float = field(default=60.0, metadata={"gt": 0,
        "help": "seconds of finished requests the plan is for (re-planned every quarter of it)"})
    reuse_port: bool = field(default=False, metadata={
        "help": "share the port with other coordinators that ask for it too (SO_REUSEPORT: the kernel spreads "
                "client connections among them; vLLM's --api-server-count); each keeps its own routing view"})
    request_timeout_s: float = field(default=600.0, metadata={"gt": 0, "help": "deadline of each worker call, seconds"})
    connect_timeout_s: float = field(default=300.0, metadata={"gt": 0,
        "help": "at start, wait this long for a live worker of every role, seconds"})
    stats_interval_s: float = field(default=1.0, metadata={"gt": 0, "help": "worker health and load polling period, s"})
    discovery_interval_s: float = field(default=5.0, metadata={
        "gt": 0, "help": "re-resolve worker addresses this often, s"})
    stall_timeout_s: float = field(default=30.0, metadata={"gt": 0,
        "help": "drop a client that reads nothing for this long (frees its batch slot and KV), seconds"})
    max_migrations: int = field(default=2, metadata={
        "min": 0, "help": "resumptions on other workers after a worker is lost"})
    api_keys_file: str | None = field(default=None, metadata={
        "help": "file of API keys clients must send as 'authorization: Bearer <key>' (also $PDSERVE_API_KEYS)"})
    worker_tls_ca: str | None = field(default=None, metadata={"help": "PEM CA of workers that serve TLS"})
    local_prefill_tokens: int = field(default=0, metadata={"min": 0,
        "help": "disaggregated: prefill on the decode worker when at most this many tokens are not in its prefix "
                "cache (no prefill worker, no KV transfer); 0 = never"})
    local_prefill_fallback: bool = field(default=True, metadata={
        "help": "disaggregated: decode workers prefill locally while no prefill worker is live (else UNAVAILABLE)"})
    local_prefill_queue: bool = field(default=True, metadata={
        "help": "disaggregated: a decode worker prefills a request itself when it would give the first token "
                "sooner than the prefill workers' queues (measured rates)"})
    token_streams: bool = field(default=True, metadata={
        "help": "read a decode worker's tokens for every request from one stream, a message per engine step, "
                "instead of a message per request per step on each request's call (off: per call)"})
    token_streams_min_requests: int = field(default=4, metadata={"min": 0,
        "help": "a request joins its worker's token stream when this coordinator has at least this many other "
                "requests on that worker (0: every request); fewer read per call, which costs less there"})
    max_request_bytes: int = field(default=0, metadata={"min": 0,
        "help": "largest request message on the public port, bytes (0 = sized from the model's context window)"})
    rate_limit_requests_per_s: float = field(default=0.0, metadata={"min": 0, "help": "per key; 0 = unlimited"})
    rate_limit_tokens_per_s: float = field(default=0.0, metadata={"min": 0,
        "help": "per key, prompt + n x max_tokens charged at admission; 0 = unlimited"})
    rate_limit_burst_s: float = field(default=1.0, metadata={"gt": 0, "help": "bursts of this many seconds' worth"})
