"""Assemble an engine (model config, KV geometry, scheduler, runner) from a resolved model directory."""
from __future__ import annotations

import logging

from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.config import (AUTO_KV_MEMORY_FRACTION, CacheConfig, SchedulerConfig, auto_kv_tokens,
                                          compat_hash, kv_bytes_per_block, num_blocks_for_budget, resolve_cache_dtype)
from pdserve_server.engine.models.config import ModelConfig
from pdserve_server.engine.models.config_cache import read_model_config
from pdserve_server.engine.execution.cuda_graphs import capture_sizes
from pdserve_server.engine.hardware import free_memory_bytes, keep_freed_memory, resolve_dtype
from pdserve_server.engine.scheduling.kv_cache_manager import KVCacheManager, sliding_kv_window
from pdserve_server.engine.execution.loader import load_state_dict
from pdserve_server.engine.mock.runner import MockRunner
from pdserve_server.engine.mock.step_model import load_profile
from pdserve_server.engine.offload.offloader import build_offloader
from pdserve_server.engine.execution.model_runner import ModelRunner
from pdserve_server.engine.parallel.tensor_parallel import (SINGLE, TensorParallel, check_devices, head_split,
                                                            rank_device)
from pdserve_server.engine.scheduling.scheduler import Scheduler
from pdserve_server.engine.speculative import SpeculativeConfig
from pdserve_server.engine.structured import GrammarCompiler

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    scheduler: Scheduler
    runner: ModelRunner | MockRunner


def resolve_configs(args: EngineArgs) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
    """The engine's configuration from its arguments and the model directory's config.json.

    Raises:
        FileNotFoundError / ValueError: from reading and validating the model config (unsupported architecture or
            feature, named), a mock engine's profile that does not load or with TP, a KV budget under one block, a
            --kv-cache-dtype the backend cannot hold (`engine.config.resolve_cache_dtype`),
            inconsistent speculative-decoding flags, or more tensor-parallel ranks than GPUs
            (`engine.parallel.tensor_parallel.check_devices`).
    """
    if args.mock_engine:  # refused now, before anything is built
        load_profile(args.mock_engine)
        if args.tensor_parallel_size > 1:
            raise ValueError("the mock engine runs one rank: drop --tensor-parallel-size")
        if not args.mock_speedup > 0:
            raise ValueError(f"--mock-speedup must be > 0, got {args.mock_speedup}")
    path = Path(args.model_dir)
    model_config = read_model_config(path, path.name, resolve_dtype(args.dtype, args.device),
                                     Path(args.model_cache_dir) if args.model_cache_dir else None)
    tp = args.tensor_parallel_size
    check_devices(args.device, tp)
    head_split(model_config.num_heads, model_config.num_kv_heads, tp, 0)  # heads that do not split: refused now
    cache_dtype = resolve_cache_dtype(args.kv_cache_dtype, model_config.dtype, args.device, args.attention_backend)
    max_len = min(args.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings)
    kv_tokens = args.kv_tokens
    if args.kv_bytes is None and kv_tokens is None:  # sized from the memory free now (`auto_kv_tokens`)
        on_gpu = torch.device(args.device).type == "cuda"
        free = free_memory_bytes(args.device)
        if free is not None and on_gpu:
            free *= tp  # a shard on each rank's GPU; the pool's bytes per token count every rank's
        per_token = kv_bytes_per_block(model_config, args.block_size, tp, cache_dtype) // args.block_size
        kv_tokens = auto_kv_tokens(per_token, free, AUTO_KV_MEMORY_FRACTION["cuda" if on_gpu else "cpu"],
                                   args.max_num_seqs, max_len)
    num_blocks = num_blocks_for_budget(model_config, args.block_size, args.kv_bytes,
                                       None if args.kv_bytes is not None else kv_tokens, tp, cache_dtype)
    cache_config = CacheConfig(block_size=args.block_size, num_blocks=num_blocks, tensor_parallel_size=tp,
                               cache_dtype=cache_dtype)
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=max_len,
        enable_prefix_caching=args.enable_prefix_caching, vocab_size=model_config.vocab_size,
        speculative=SpeculativeConfig(args.speculative_ngram_tokens, args.speculative_ngram_max,
                                      args.speculative_ngram_min, args.speculative_disable_batch_size),
        itl_target_ms=args.itl_target_ms, burst_prefill_tokens=args.burst_prefill_tokens)
    return model_config, cache_config, scheduler_config


def build_runner(args: EngineArgs, model_config: ModelConfig, cache_config: CacheConfig, max_model_len: int,
                 tp: TensorParallel = SINGLE) -> ModelRunner | MockRunner:
    """Load the weights (this rank's share under tensor parallelism) and build the model runner, with this rank's
    shard of the KV cache on this rank's device (`engine.parallel.tensor_parallel.rank_device`); or, with
    `args.mock_engine`, the mock engine's runner (no weights).

    Raises:
        FileNotFoundError / ValueError: from weight loading and `ModelRunner`.
    """
    if args.mock_engine:
        return MockRunner(model_config, cache_config, load_profile(args.mock_engine), args.mock_speedup,
                          device=rank_device(args.device, tp.rank), seed=args.seed)
    kind = torch.device(args.device).type
    if kind == "cpu":
        keep_freed_memory()  # before the weights load: large tensors from the heap, reused step after step
    state = None if args.random_weights else load_state_dict(Path(args.model_dir))
    graphs = kind == "cuda" and not args.enforce_eager
    return ModelRunner(model_config, cache_config, state, device=rank_device(args.device, tp.rank), seed=args.seed,
                       attention_backend=args.attention_backend, quantization=args.quantization,
                       packed_weights=args.packed_weights,
                       cuda_graph_sizes=capture_sizes(args.max_num_seqs) if graphs else None,
                       max_model_len=max_model_len, tp=tp, cpu_decode_stack=not args.enforce_eager)


def build_engine(args: EngineArgs, tp: TensorParallel = SINGLE,
                 configs: tuple[ModelConfig, CacheConfig, SchedulerConfig] | None = None) -> EngineParts:
    """Load config + weights (or random weights when `args.random_weights`) and build the scheduler and runner.
    Under tensor parallelism this is rank 0 (`engine.core.ranks` builds the others), given its group and the configs
    it resolved first.

    Raises:
        FileNotFoundError / ValueError: from model loading and config validation (ValueError too for int8 / int4
            quantization of a float32 model or of shapes int4 cannot pack, and for inconsistent speculative-decoding
            flags).
    """
    model_config, cache_config, scheduler_config = configs or resolve_configs(args)
    runner = build_runner(args, model_config, cache_config, scheduler_config.max_model_len, tp)
    offload = build_offloader(args, compat_hash(model_config, cache_config), runner.kv_cache.kv)
    kv_manager = KVCacheManager(cache_config.num_blocks, args.block_size, args.enable_prefix_caching,
                                sliding_kv_window(model_config.layer_windows), offload)
    if args.kv_events:
        kv_manager.pool.kv_events = []
    grammars = GrammarCompiler(Path(args.model_dir) / "tokenizer.json", model_config.vocab_size,
                               model_config.eos_token_ids)
    if grammars.tokenizer_json.is_file():
        try:  # structured outputs' one-time setup (0.2-0.5 s) paid at start, not by a first request
            grammars.tokenizer()
        except (ValueError, RuntimeError) as e:  # llguidance cannot read it: only constrained requests fail, saying so
            log.warning("structured outputs will be refused: the grammar engine cannot load %s (%s)",
                        grammars.tokenizer_json, e)
    return EngineParts(model_config, cache_config, scheduler_config,
                       Scheduler(scheduler_config, kv_manager, grammars), runner)
