"""The engine's knobs and their defaults: the one definition the workers, `pdserve serve` and the CLI flags are
built from. No torch here, so the command line can read it without loading torch."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve_server.kernels.backends import BACKENDS as ATTENTION_BACKENDS

DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = ("auto",) + DTYPE_NAMES
QUANTIZATION_CHOICES = ("none", "int8", "int4", "gguf", "w8a8_int8")
KV_OFFLOAD_STORE_CHOICES = ("evicted", "computed")
KV_OFFLOAD_LOAD_CHOICES = ("cost", "always")
# Tokens a request's stream may hold unread before the request is paused (`engine.core.async_engine.RequestStream`): far
# more than a reader that keeps up ever leaves (it takes every queued token at each read), small enough that a
# stalled client costs little memory.
DEFAULT_MAX_UNREAD_TOKENS = 256


@dataclass(frozen=True)
class EngineArgs:
    """Engine knobs shared by every worker role. Field metadata carries each flag's help text.

    Attributes:
        model_dir: resolved HF-format directory (see `cli.models.resolve_model`).
        model_cache_dir: where the engine keeps what it reads from the model directory once (its ModelConfig:
            `engine.models.config_cache`); "" keeps nothing (engines built directly, as tests do).
        dtype: weights and KV dtype, or "auto" (the default: `engine.hardware.resolve_dtype`, the fastest dtype the
            device computes well, as vLLM's default is).
        kv_cache_dtype: the KV cache's dtype, or "auto" (the default: `dtype`'s); "bfloat16" under a float32 model
            halves the cache's bytes on the cpu backend (`engine.config.resolve_cache_dtype`).
        quantization: "none", "int8" or "int4": weight-only quantized linears (`engine.execution.quantization`; int4 in
            groups of 32 input channels; both need a bf16/fp16 dtype); "gguf": a GGUF model's exact blocks
            (`engine.execution.packing.gguf_blocks`) against decode rows quantized to 8 bits, as llama.cpp computes
            (`packing.use_q8_activations`; float32); "w8a8_int8": float32 linears (decoder layers and LM head) computed
            as 8-bit integer products, prefill chunks and decode steps (`packing.use_w8a8`; the cpu backend; a GGUF
            model's batch-1 rows read its blocks as "gguf" does).
        block_size: tokens per KV block.
        kv_tokens: KV budget in tokens; ignored when kv_bytes is set. None with kv_bytes None: sized from the memory
            free at start (`engine.config.auto_kv_tokens`).
        kv_bytes: KV budget in bytes (overrides kv_tokens); None = use kv_tokens.
        max_num_batched_tokens: token budget per engine step (prefill chunks + one token per decode).
        itl_target_ms: the prefill cap while requests decode (`SchedulerConfig.itl_target_ms`), ms; 0 = none.
        burst_prefill_tokens: `SchedulerConfig.burst_prefill_tokens`, 8,192 by default (vLLM's step budget for a
            server on an H100/H200; its CPU server takes 2,048 every step); 0 = off.
        max_num_seqs: most requests in the running batch.
        max_model_len: most prompt + output tokens per request; 0 = the model's max_position_embeddings.
        enable_prefix_caching: reuse cached full KV blocks with the same chained token hash.
        kv_events: record the prefix cache's block stored / removed events for the worker's KV event stream.
        kv_offload_cpu_bytes: a host-memory tier under the KV pool, bytes (0 = none; `engine.offload`).
        kv_offload_disk_dir / kv_offload_disk_bytes: a disk tier in this directory ("" = none), bounded in bytes.
        kv_offload_redis_url: a shared tier on this Redis server ("" = none; `engine.offload.redis_tier`).
        kv_offload_store: which blocks the tiers receive: "evicted" (as the pool evicts a cached block) or "computed"
            (every full block as it enters the prefix cache, so workers sharing a directory find it at once).
        kv_offload_load: when a tier's block is loaded rather than recomputed: "cost" (when its measured load time
            is under the measured prefill time of a block, `engine.offload.offloader.KvOffloader.load`) or "always".
        kv_offload_prefetch_bytes: blocks read ahead from the disk and Redis tiers for queued requests, staged in
            memory up to this many bytes (`engine.offload.prefetch`); 0 = no read-ahead.
        device: torch device of weights and KV cache.
        seed: sampler seed for unseeded requests (and random weights).
        packed_weights: the linears' CPU forms (`engine.execution.packing`): bf16 prepacked for oneDNN, fp32 decode
        batches
            through the cpu backend's small-batch kernel.
        attention_backend: "auto" (Triton kernels on CUDA, the C decode kernel on CPU), "triton", "cpu" or "torch".
        speculative_ngram_tokens: n-gram (prompt-lookup) draft tokens per decode step; 0 = off
            (`engine.speculative`).
        speculative_ngram_max / speculative_ngram_min: longest / shortest n-gram looked up, in tokens.
        speculative_disable_batch_size: no drafts while more requests than this are running.
        threads: torch intra-op threads for the process; 0 = one per CPU the process may run on
            (`engine.hardware.set_threads`). `pdserve serve` splits its host's CPUs among its workers instead.
        tensor_parallel_size: ranks, one process each, that split the model (`engine.parallel.tensor_parallel`); 1 =
        none. On CUDA
            rank r runs on the device's index + r (`engine.parallel.tensor_parallel.rank_device`).
        random_weights: build the model from its config with random weights (tests, GPU-less benchmarks).
        mock_engine: "" for the real model; else a step-time profile (`engine.mock.step_model.load_profile`): the
            runner computes nothing and sleeps each step's modelled time (`engine.mock.runner.MockRunner`).
        mock_speedup: the mock engine's time runs this many times faster than its profile's device.
        enforce_eager: run every step eagerly, op by op from Python: on CUDA instead of replaying captured graphs of
            all-decode steps (`engine.execution.cuda_graphs`; vLLM's flag of the same name), on CPU instead of the cpu
            backend's one-call decode loop (`engine.execution.cpu_decode_stack`).
    """

    model_dir: str = field(metadata={"cli": False})
    model_cache_dir: str = field(default="", metadata={"cli": False})
    dtype: str = field(default="auto", metadata={
        "choices": DTYPE_CHOICES,
        "help": "weights and KV dtype; auto = bfloat16 on CPUs with AVX512_BF16/AMX and bf16 GPUs, else float32 "
                "(float16 on older GPUs); float32 for exact parity with an fp32 reference"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "choices": DTYPE_CHOICES,
        "help": "KV cache dtype; auto = --dtype's; bfloat16 under a float32 model (cpu backend): half the KV bytes, so "
                "faster long-context decode and twice the tokens per --kv-bytes, K/V rounded to bf16 (not exact)"})
    quantization: str = field(default="none", metadata={
        "choices": QUANTIZATION_CHOICES,
        "help": "int8 / int4 = weight-only int8 / int4 (groups of 32) linears (bf16/fp16 dtypes): faster "
                "small-batch decode on CPU, slower at large batches; gguf = a GGUF model's Q4_1 / Q8_0 linears "
                "computed as llama.cpp does at batch 1 (the row quantized to 8 bits a block, integer dot products; "
                "float32 on the cpu backend): faster batch-1 decode, not exact; w8a8_int8 = float32 linears (layers "
                "and LM head) computed as int8 products (7-bit weights, activations quantized per block of 64; cpu "
                "backend; a GGUF model's batch-1 rows as gguf): faster prefill and decode on CPUs without bf16 units, "
                "not exact"})
    packed_weights: bool = field(default=True, metadata={
        "help": "CPU linears (engine.execution.packing): bf16 weights reordered once at load into oneDNN's blocked "
                "layout, fp32 decode batches through the cpu backend's small-batch kernel; no effect elsewhere"})
    block_size: int = field(default=16, metadata={"min": 1, "help": "tokens per KV block"})
    kv_tokens: int | None = field(default=None, metadata={
        "min": 1, "help": "KV budget in tokens (ignored when --kv-bytes is set); default: room for --max-num-seqs "
                          "requests of --max-model-len tokens within a tenth of the memory free at start on CPU (half "
                          "of a GPU's), at least 16,384 tokens (engine.config.auto_kv_tokens)"})
    kv_bytes: int | None = field(default=None, metadata={
        "min": 1, "help": "KV budget in bytes (overrides --kv-tokens)"})
    max_num_batched_tokens: int = field(default=512, metadata={"min": 1, "help": "token budget per engine step"})
    max_num_seqs: int = field(default=64, metadata={"min": 1, "help": "most requests in the running batch"})
    itl_target_ms: float = field(default=0.0, metadata={"min": 0,
        "help": "while requests decode, cap a step's prefill chunk so the step is predicted to take at most this "
                "long, ms (stall-free batching from measured step costs; at least a block a step); 0 = no cap"})
    burst_prefill_tokens: int = field(default=8192, metadata={"min": 0,
        "help": "when the requests with prompt tokens left to prefill (waiting and partly computed ones) are at "
                "least as many as the decoding ones, a step takes up to this many prompt tokens beside the decodes: "
                "a burst of arrivals stalls the decoding requests once per this many tokens instead of once per "
                "--max-num-batched-tokens chunk, and its requests then decode together (lower TTFT p99 and ITL p99); "
                "0 = off"})
    max_model_len: int = field(default=0, metadata={"min": 0,
        "help": "most prompt + output tokens per request (0 = the model's context length)"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse cached prefix KV blocks"})
    kv_events: bool = field(default=False, metadata={
        "help": "publish KV cache events: each full block entering the prefix cache (its hash, parent and tokens) "
                "and each evicted, on the worker's SubscribeKvEvents stream"})
    kv_offload_cpu_bytes: int = field(default=0, metadata={"min": 0,
        "help": "KV offload: a host-memory tier of this many bytes under the KV pool; full prefix-cache blocks the "
                "pool evicts are kept there and loaded back instead of recomputed (meant for a GPU pool), 0 = none"})
    kv_offload_disk_dir: str = field(default="", metadata={
        "help": "KV offload: a disk tier in this directory (evicted prefix-cache blocks, checksummed, kept across "
                "restarts; workers may share one), empty = none"})
    kv_offload_disk_bytes: int = field(default=16 * 2**30, metadata={"min": 1,
        "help": "the disk tier's size in bytes; the least recently used blocks are deleted beyond it"})
    kv_offload_redis_url: str = field(default="", metadata={
        "help": "KV offload: a tier on this Redis server (redis://[:password@]host:port/db, rediss:// for TLS), "
                "shared by every worker of the same model that names it, on any host; run Redis with maxmemory and "
                "maxmemory-policy allkeys-lru; empty = none"})
    kv_offload_store: str = field(default="evicted", metadata={
        "choices": KV_OFFLOAD_STORE_CHOICES,
        "help": "which blocks the KV offload tiers receive: evicted = a prefix-cache block as the pool evicts it; "
                "computed = every full block as it is computed, so workers sharing a disk directory use each "
                "other's prefixes at once (more writes)"})
    kv_offload_load: str = field(default="cost", metadata={
        "choices": KV_OFFLOAD_LOAD_CHOICES,
        "help": "when a block an offload tier holds is loaded back: cost = when the tier's measured load time per "
                "block is under what prefilling the block measurably costs (a slow disk under a fast GPU is "
                "recomputed instead); always = whenever a tier holds it"})
    kv_offload_prefetch_bytes: int = field(default=512 * 2**20, metadata={"min": 0,
        "help": "KV offload: a queued request's blocks in the disk or Redis tier are read ahead on a thread of "
                "their own and staged in memory, up to this many bytes, so the engine does not read them between "
                "steps; 0 = read them when the request is scheduled"})
    device: str = field(default="cpu", metadata={"help": "torch device, e.g. cpu or cuda:0"})
    seed: int = field(default=0, metadata={"min": 0, "help": "seed for unseeded sampling and random weights"})
    attention_backend: str = field(default="auto", metadata={
        "choices": ATTENTION_BACKENDS,
        "help": "paged attention ops (auto = Triton kernels on CUDA; on CPU the C kernels compiled at install, "
                "kernels/_C; torch = the reference, on any device)"})
    speculative_ngram_tokens: int = field(default=0, metadata={"min": 0,
        "help": "speculative decoding: draft tokens per decode step from n-gram prompt lookup (vLLM's ngram "
                "method; greedy requests without penalties or logprobs), 0 = off"})
    speculative_ngram_max: int = field(default=4, metadata={"min": 1, "help": "longest n-gram looked up (tokens)"})
    speculative_ngram_min: int = field(default=2, metadata={"min": 1, "help": "shortest n-gram looked up (tokens)"})
    speculative_disable_batch_size: int = field(default=4, metadata={"min": 0,
        "help": "no speculation while more requests than this are running (a large batch is compute-bound)"})
    threads: int = field(default=0, metadata={"min": 0,
        "help": "torch intra-op threads per process (0 = one per CPU it may run on; `serve` splits the CPUs among "
                "its workers)"})
    tensor_parallel_size: int = field(default=1, metadata={"min": 1,
        "help": "ranks (processes) this worker splits the model across: attention heads, MLP and vocabulary, "
                "all-reduced with gloo on CPU (the worker's threads are split among them) or NCCL on GPUs (rank r "
                "on cuda:k+r for --device cuda:k)"})
    random_weights: bool = field(default=False, metadata={"help": "random weights from the model's config"})
    mock_engine: str = field(default="", metadata={
        "help": "compute nothing: each step lasts what this step-time profile says a real device takes (a shipped "
                "name such as llama-3.1-8b-h200 or smollm2-135m-h200, or a profile JSON file), tokens derived from "
                "the context; the scheduler, KV cache and transfers are the real ones (engine.mock)"})
    mock_speedup: float = field(default=1.0, metadata={
        "help": "the mock engine's steps run this many times faster than its profile's device (> 0)"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "run every step op by op from Python: on CUDA no CUDA graphs (all-decode steps are captured per "
                "padded batch size and replayed by default), on CPU no one-call C++ decode loop"})
