"""Runs one scheduled step on the model: packs tokens, builds attention metadata, samples."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from pdserve_server.engine.attention import AttentionMetadata, fill_block_tables
from pdserve_server.engine.config import CacheConfig
from pdserve_server.engine.models.config import ModelConfig
from pdserve_server.engine.execution.cpu_decode_stack import CpuDecodeStack
from pdserve_server.engine.execution.cuda_graphs import DecodeGraphs
from pdserve_server.engine.execution.kv_cache import KVCache
from pdserve_server.engine.models.registry import architecture
from pdserve_server.engine.outputs import RunnerOutput, SampledToken, ScheduledRequest, SchedulerOutput
from pdserve_server.engine.execution.packing import (SmallBatchLinear, blocks_format, pack_linears, use_q8_activations,
                                                     use_w8a8)
from pdserve_server.engine.parallel.tensor_parallel import SINGLE, TensorParallel
from pdserve_server.engine.execution.quantization import quantize_weight_only
from pdserve_server.engine.execution.sampler import Sampler
from pdserve_server.engine.speculative import accept_greedy
from pdserve_server.kernels.backends import select_ops

log = logging.getLogger(__name__)


def _log_gguf_blocks(model: torch.nn.Module) -> None:
    """Say at load how many fp32 linears decode from GGUF blocks of their exact weights (engine.execution.packing), so
    a user sees why a GGUF-sourced model's batch-1 steps read fewer bytes than its dtype says."""
    linears = [m for m in model.modules() if isinstance(m, SmallBatchLinear)]
    held = [blocks_format(m.blocks) for m in linears if m.blocks is not None]
    if held:
        log.info("%d of %d fp32 linears are exact GGUF tensors (%d Q4_1, %d Q8_0): decode steps read those blocks",
                 len(held), len(linears), held.count("q4_1"), held.count("q8_0"))


@dataclass
class StepInputs:
    """One step's model inputs on the host: what every tensor-parallel rank needs to run the same forward (rank 0
    builds it from the `SchedulerOutput` and broadcasts it). Decode rows come first, then prefill chunks.

    Attributes:
        block_copies: (src, dst) block ids to copy before the forward (forked samples' copy-on-write).
        input_ids, positions, slots: per token of the step (slots = block_id * block_size + offset).
        decode_block_tables, decode_context_lens: per decode (context including the new token).
        prefill_query_lens, prefill_context_lens, prefill_block_tables: per prefill chunk.
        logit_rows: token rows whose logits are needed, in order; None = every row; [] = none.
    """

    block_copies: list[tuple[int, int]] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    decode_block_tables: list[list[int]] = field(default_factory=list)
    decode_context_lens: list[int] = field(default_factory=list)
    prefill_query_lens: list[int] = field(default_factory=list)
    prefill_context_lens: list[int] = field(default_factory=list)
    prefill_block_tables: list[list[int]] = field(default_factory=list)
    logit_rows: list[int] | None = None


# A step's inputs cross to the other TP ranks as msgpack (a StepInputs is never empty: `close` sends b"").
_STEP_ENCODER = msgspec.msgpack.Encoder()
_STEP_DECODER = msgspec.msgpack.Decoder(StepInputs)


class ModelRunner:
    """Owns the model, the KV cache memory and the sampler of one worker.

    Args:
        model_config: architecture.
        cache_config: KV geometry.
        state_dict: HF-named weights; None leaves random init (tests).
        device: torch device.
        seed: seed for unseeded sampling and random init.
        attention_backend: "auto" (Triton on CUDA, the C decode kernel on CPU), "triton", "cpu" or "torch".
        quantization: "none", "int8" or "int4" (weight-only linears, `engine.execution.quantization`; int4 in groups of
            32), or "gguf" (GGUF blocks against 8-bit decode rows: `engine.execution.packing.use_q8_activations`;
            needs packed_weights and linears that are exact GGUF tensors), or "w8a8_int8" (fp32 linears, LM head too, as
            8-bit integer products: `engine.execution.packing.use_w8a8`; needs packed_weights and the cpu backend).
        packed_weights: CPU forms of the linears (`engine.execution.packing`): bf16 prepacked for oneDNN, fp32 small
            batches through the cpu backend's kernel (int8 / int4 layers are packed by their own op).
        cuda_graph_sizes: batch sizes of all-decode steps to capture as CUDA graphs (`engine.execution.cuda_graphs`);
            None = every step eager; ignored, with a warning, for an attention backend that cannot be captured.
        max_model_len: longest context in tokens; sizes the captured block tables (needed with graphs).
        tp: this rank's place in its tensor-parallel group (`engine.parallel.tensor_parallel`); the model holds the
        rank's share,
            and the runner allocates the rank's shard of the KV cache on `device` (`engine.execution.kv_cache.KVCache`).
        cpu_decode_stack: run all-decode steps' layers in one C++ call where the model and backend allow it
            (`engine.execution.cpu_decode_stack`); False runs every step through the model's forward (benchmarks
            compare).

    Raises:
        ValueError: an unknown or unusable attention backend (`kernels.backends.select_ops`), quantization of a float32
            model or of shapes int4 cannot pack, "gguf" for a model without exact GGUF linears, "w8a8_int8" where
            no linear can take it, or graph sizes without max_model_len.
    """

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 state_dict: dict[str, torch.Tensor] | None, device: str = "cpu", seed: int = 0,
                 attention_backend: str = "auto", quantization: str = "none", packed_weights: bool = True,
                 cuda_graph_sizes: list[int] | None = None, max_model_len: int = 0, tp: TensorParallel = SINGLE,
                 cpu_decode_stack: bool = True):
        torch.manual_seed(seed)
        self.model_config, self.tp = model_config, tp
        self.device = torch.device(device)
        self.attention_ops = select_ops(attention_backend, self.device)
        model_class = architecture(model_config.architecture).Model
        # Random weights are drawn on the device itself: an 8B model's init on a GPU takes a second, on the host
        # minutes. Loaded weights build on the host as before (tables such as RoPE's stay bit-equal to HF's).
        with self.device if state_dict is None else contextlib.nullcontext():
            self.model = model_class(model_config, self.attention_ops, tp)
        self.model = self.model.to(device=self.device, dtype=model_config.torch_dtype)
        if state_dict is not None:
            self.model.load_weights(state_dict)
        self.model.eval()
        if quantization in ("int8", "int4"):
            quantize_weight_only(self.model, quantization)
        elif packed_weights:
            pack_linears(self.model, self.attention_ops.small_batch_linear, self.attention_ops.packed_bf16_linear,
                         self.attention_ops.blocks_linear, self.attention_ops.blocks_prefill)
            _log_gguf_blocks(self.model)
        switched = use_q8_activations(self.model) if quantization == "gguf" and packed_weights else 0
        if switched:
            log.info("--quantization gguf: %d linears take batch-1 rows quantized to 8 bits (llama.cpp's arithmetic)",
                     switched)
        elif quantization == "gguf":
            raise ValueError("--quantization gguf computes the linears whose fp32 weights are exactly a GGUF's Q4_1 or "
                             "Q8_0 blocks, and this model has none where they could be read (it needs a model that "
                             "comes as such a GGUF, --dtype float32, the cpu attention backend and --packed-weights)")
        if quantization == "w8a8_int8":
            self._use_w8a8(packed_weights)
        self.kv_cache = KVCache(model_config, cache_config, self.device)
        # All-decode steps' layers in one C++ call on CPU (the cpu backend; None elsewhere or for a model it cannot run)
        self.decode_stack = CpuDecodeStack.build(self.model, self.attention_ops) if cpu_decode_stack else None
        self.block_size = cache_config.block_size
        self.sampler = Sampler(model_config.vocab_size, seed)
        self.decode_graphs = None
        if cuda_graph_sizes and tp.size > 1:
            log.warning("tensor-parallel steps broadcast their inputs from the host; every step runs eagerly")
        elif cuda_graph_sizes and model_config.moe is not None:
            log.warning("mixture-of-experts layers group tokens on the host; every step runs eagerly")
        elif cuda_graph_sizes and not self.attention_ops.capturable:
            log.warning("attention backend %r cannot be captured in a CUDA graph; every step runs eagerly",
                        self.attention_ops.name)
        elif cuda_graph_sizes:
            if max_model_len <= 0:
                raise ValueError("CUDA graphs need max_model_len > 0 to size their block tables")
            self.decode_graphs = DecodeGraphs(self.model, self.kv_cache.layers, cuda_graph_sizes,
                                              -(-max_model_len // self.block_size), self.kv_cache.scratch_slot,
                                              self.device, capture=self.device.type == "cuda")

    def _use_w8a8(self, packed_weights: bool) -> None:
        """--quantization w8a8_int8: the fp32 linears (LM head too) through int8 products. Raises ValueError where
        no linear takes them."""
        switched = (use_w8a8(self.model, self.attention_ops.int8_linear)
                    if packed_weights and self.attention_ops.int8_linear is not None else 0)
        if not switched:
            raise ValueError("--quantization w8a8_int8 computes float32 linears on CPU (--dtype float32, the cpu "
                             "attention backend and --packed-weights) whose in_features are a multiple of 64, and this "
                             "model has none")
        log.info("--quantization w8a8_int8: %d linears compute as 8-bit integer products", switched)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Compute the step's tokens and sample for every request whose chunk reaches its last token; verify the
        n-gram drafts of a request that carries them (`engine.speculative`). Under tensor parallelism this is
        rank 0's call: the step's inputs go to the other ranks first (`follow`).

        Raises:
            Exception: whatever the forward pass raised (a fault of the whole step; sampling failures are per
                request, in `RunnerOutput.failed`).
        """
        scheduled = out.decodes + out.prefills
        step = StepInputs(block_copies=out.block_copies,
                          decode_block_tables=[s.block_ids for s in out.decodes],
                          decode_context_lens=[s.request.num_computed_tokens + 1 for s in out.decodes],
                          prefill_query_lens=[s.num_new_tokens for s in out.prefills],
                          prefill_context_lens=[s.request.num_computed_tokens + s.num_new_tokens
                                                for s in out.prefills],
                          prefill_block_tables=[s.block_ids for s in out.prefills])
        sample_rows: list[int] = []
        verify: list[tuple[ScheduledRequest, int]] = []  # a request with drafts, and the row of its last known token
        for s in scheduled:
            start = s.request.num_computed_tokens
            known = s.num_new_tokens - len(s.spec_token_ids)
            step.input_ids.extend(s.request.all_token_ids[start:start + known])
            step.input_ids.extend(s.spec_token_ids)
            for p in range(start, start + s.num_new_tokens):
                step.positions.append(p)
                step.slots.append(s.block_ids[p // self.block_size] * self.block_size + p % self.block_size)
            if s.spec_token_ids:
                verify.append((s, len(step.input_ids) - 1 - len(s.spec_token_ids)))
            elif s.sample:
                sample_rows.append(len(step.input_ids) - 1)
        verify_rows = [row for s, last in verify for row in range(last, last + len(s.spec_token_ids) + 1)]
        # Every row sampled (an all-decode step without drafts; sample_rows ascend): the hidden states as they are.
        every_row = not verify_rows and len(sample_rows) == len(step.input_ids)
        step.logit_rows = None if every_row else sample_rows + verify_rows
        # Layer-wise KV streaming: a prefill-only request's last chunk tells its sender as each layer is written.
        # Under TP only rank 0 tells, once its layer's attention has returned: that ends in an all-reduce which no
        # rank joins before writing its own shard of the layer's K/V, so every shard is in the cache by then.
        # The scheduler files a one-token chunk under decodes (a prefix-cache hit up to the last token).
        streaming = [s for s in scheduled if s.sample and s.request.kv_layers is not None]
        graphs = self.decode_graphs
        if graphs is not None and out.decodes and not out.prefills and not streaming:
            self.kv_cache.copy_blocks(step.block_copies)
            size = graphs.size_for(len(out.decodes), max(len(t) for t in step.decode_block_tables))
            if size is not None:
                logits = graphs.run(size, step.input_ids, step.positions, step.slots, step.decode_block_tables,
                                    step.decode_context_lens)
                return self.sampler(logits[sample_rows], [s.request for s in scheduled if s.sample])
            step.block_copies = []  # done
        dev = self.device
        for s in streaming:
            s.request.kv_layers.begin(s.block_ids, s.request.num_computed_tokens + s.num_new_tokens)

        def on_layer(layer: int) -> None:
            for s in streaming:
                s.request.kv_layers.layer_written(layer, dev)
        if self.tp.size > 1:
            self.tp.broadcast_bytes(_STEP_ENCODER.encode(step))
        logits = self._forward(step, on_layer if streaming else None)
        if logits is None:
            return RunnerOutput()
        result = self.sampler(logits[:len(sample_rows)], [s.request for s in scheduled
                                                           if s.sample and not s.spec_token_ids])
        if verify:
            _verify_drafts(verify, logits[len(sample_rows):], result)
        return result

    def follow(self) -> None:
        """Ranks > 0 of a tensor-parallel group: run every step rank 0's `execute` broadcasts, until `close`.

        Raises:
            RuntimeError: from torch.distributed when rank 0 is gone (the rank process then exits; it also dies
                with rank 0, its parent).
        """
        while True:
            data = self.tp.broadcast_bytes()
            if not data:  # `close`
                return
            self._forward(_STEP_DECODER.decode(data), None)

    def close(self) -> None:
        """Rank 0 of a tensor-parallel group: tell the other ranks to leave `follow` (empty bytes). A no-op without
        TP."""
        if self.tp.size > 1:
            self.tp.broadcast_bytes(b"")

    def _forward(self, step: StepInputs, on_layer: Callable[[int], None] | None) -> torch.Tensor | None:
        """The model on `step` (every TP rank runs it alike): logits [len(logit_rows) or T, vocab] on the device,
        or None when no row needs them."""
        self.kv_cache.copy_blocks(step.block_copies)  # forked samples' partial blocks, before anything writes them
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(step.slots, dtype=torch.long, device=dev),
            num_decodes=len(step.decode_context_lens),
            decode_block_tables=self._block_tables(step.decode_block_tables),
            decode_context_lens=torch.tensor(step.decode_context_lens, dtype=torch.int32, device=dev),
            prefill_cu_seqlens=torch.tensor(_cumsum(step.prefill_query_lens), dtype=torch.int32, device=dev),
            prefill_context_lens=torch.tensor(step.prefill_context_lens, dtype=torch.int32, device=dev),
            prefill_block_tables=self._block_tables(step.prefill_block_tables),
            prefill_max_query_len=max(step.prefill_query_lens, default=0),
        )
        input_ids = torch.tensor(step.input_ids, dtype=torch.long, device=dev)
        positions = torch.tensor(step.positions, dtype=torch.long, device=dev)
        if self.decode_stack is not None and not step.prefill_query_lens and on_layer is None:
            hidden = self.decode_stack(input_ids, positions, meta, self.kv_cache.layers)
        else:
            hidden = self.model(input_ids, positions, meta, self.kv_cache.layers, on_layer_written=on_layer)
        if step.logit_rows is not None and not step.logit_rows:
            return None
        return self.model.compute_logits(hidden if step.logit_rows is None else hidden[step.logit_rows])

    def _block_tables(self, tables: list[list[int]]) -> torch.Tensor:
        """[len(tables), max_blocks] int32, zero-padded (`fill_block_tables`), on the runner's device."""
        host = np.empty((len(tables), max(1, max((len(t) for t in tables), default=0))), dtype=np.int32)
        fill_block_tables(host, tables)
        return torch.from_numpy(host).to(self.device)


def _verify_drafts(verify: list[tuple[ScheduledRequest, int]], logits: torch.Tensor, result: RunnerOutput) -> None:
    """Greedy verification of n-gram drafts (`engine.speculative.accept_greedy`): each request's k + 1 rows
    of logits ([sum(k + 1), vocab], in `verify` order) give the model's own token after the last known token and
    after each draft; the emitted tokens go into `result` (the first as sampled, the rest as spec_tokens)."""
    targets = logits.argmax(dim=-1).tolist()  # the sampler's greedy path takes the same argmax
    at = 0
    for s, _ in verify:
        k = len(s.spec_token_ids)
        emitted = accept_greedy(s.spec_token_ids, targets[at:at + k + 1])
        at += k + 1
        result.sampled[s.request.request_id] = SampledToken(emitted[0])
        result.spec_tokens[s.request.request_id] = emitted[1:]


def _cumsum(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out
