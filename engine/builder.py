"""Assemble an engine (model config, KV geometry, scheduler, runner) from a resolved model directory."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.args import EngineArgs
from engine.config import CacheConfig, ModelConfig, SchedulerConfig, num_blocks_for_budget
from engine.cuda_graphs import capture_sizes
from engine.hardware import resolve_dtype
from engine.kv_cache_manager import KVCacheManager
from engine.loader import load_state_dict
from engine.model_runner import ModelRunner
from engine.scheduler import Scheduler
from engine.speculative import SpeculativeConfig
from engine.structured import GrammarCompiler


@dataclass
class EngineParts:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    scheduler: Scheduler
    runner: ModelRunner


def build_engine(args: EngineArgs) -> EngineParts:
    """Load config + weights (or random weights when `args.random_weights`) and build the scheduler and runner.

    Raises:
        FileNotFoundError / ValueError: from model loading and config validation (ValueError too for int8 / int4
            quantization of a float32 model or of shapes int4 cannot pack, and for inconsistent speculative-decoding
            flags).
    """
    from transformers import AutoConfig

    path = Path(args.model_dir)
    hf_config = AutoConfig.from_pretrained(str(path))
    model_config = ModelConfig.from_hf(hf_config, name=path.name, path=str(path),
                                       dtype=resolve_dtype(args.dtype, args.device))
    num_blocks = num_blocks_for_budget(model_config, args.block_size, args.kv_bytes,
                                       None if args.kv_bytes is not None else args.kv_tokens)
    cache_config = CacheConfig(block_size=args.block_size, num_blocks=num_blocks)
    max_len = args.max_model_len or model_config.max_position_embeddings
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=min(max_len, model_config.max_position_embeddings),
        enable_prefix_caching=args.enable_prefix_caching, vocab_size=model_config.vocab_size,
        speculative=SpeculativeConfig(args.speculative_ngram_tokens, args.speculative_ngram_max,
                                      args.speculative_ngram_min, args.speculative_disable_batch_size))
    state = None if args.random_weights else load_state_dict(path)
    graphs = torch.device(args.device).type == "cuda" and not args.enforce_eager
    runner = ModelRunner(model_config, cache_config, state, device=args.device, seed=args.seed,
                         attention_backend=args.attention_backend, quantization=args.quantization,
                         packed_weights=args.packed_weights,
                         cuda_graph_sizes=capture_sizes(args.max_num_seqs) if graphs else None,
                         max_model_len=scheduler_config.max_model_len)
    kv = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
    grammars = GrammarCompiler(path / "tokenizer.json", model_config.vocab_size, model_config.eos_token_ids)
    return EngineParts(model_config, cache_config, scheduler_config, Scheduler(scheduler_config, kv, grammars), runner)
