"""Runs one scheduled step on the model: packs tokens, builds attention metadata, samples."""
from __future__ import annotations

import logging

import numpy as np
import torch

from engine.attention import AttentionMetadata, fill_block_tables
from engine.config import CacheConfig, ModelConfig
from engine.cuda_graphs import DecodeGraphs
from engine.kv_cache import KVCache
from engine.models.registry import architecture
from engine.outputs import RunnerOutput, SampledToken, ScheduledRequest, SchedulerOutput
from engine.packing import pack_linears
from engine.quantization import quantize_weight_only
from engine.sampler import Sampler
from engine.speculative import accept_greedy
from kernels import select_ops

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, the KV cache memory and the sampler of one worker.

    Args:
        model_config: architecture.
        cache_config: KV geometry.
        state_dict: HF-named weights; None leaves random init (tests).
        device: torch device.
        seed: seed for unseeded sampling and random init.
        attention_backend: "auto" (Triton on CUDA, the C decode kernel on CPU), "triton", "cpu" or "torch".
        quantization: "none", "int8" or "int4" (weight-only linears, `engine.quantization`; int4 in groups of 32).
        packed_weights: prepack bf16 linears on CPU (`engine.packing`; quantized layers are packed by their own op).
        cuda_graph_sizes: batch sizes of all-decode steps to capture as CUDA graphs (`engine.cuda_graphs`);
            None = every step eager; ignored, with a warning, for an attention backend that cannot be captured.
        max_model_len: longest context in tokens; sizes the captured block tables (needed with graphs).

    Raises:
        ValueError: an unknown or unusable attention backend (`kernels.select_ops`), quantization of a float32
            model, of shapes int4 cannot pack or of a mixture-of-experts model, or graph sizes without max_model_len.
    """

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 state_dict: dict[str, torch.Tensor] | None, device: str = "cpu", seed: int = 0,
                 attention_backend: str = "auto", quantization: str = "none", packed_weights: bool = True,
                 cuda_graph_sizes: list[int] | None = None, max_model_len: int = 0):
        torch.manual_seed(seed)
        self.model_config = model_config
        self.device = torch.device(device)
        self.attention_ops = select_ops(attention_backend, self.device)
        if quantization != "none" and model_config.moe is not None:
            raise ValueError(f"--quantization {quantization} is not implemented for mixture-of-experts models (the "
                             f"experts would stay unquantized and the router would be)")
        model_class = architecture(model_config.architecture).Model
        self.model = model_class(model_config, self.attention_ops).to(device=self.device,
                                                                      dtype=model_config.torch_dtype)
        if state_dict is not None:
            self.model.load_weights(state_dict)
        self.model.eval()
        if quantization != "none":
            quantize_weight_only(self.model, quantization)
        elif packed_weights:
            pack_linears(self.model)
        self.kv_cache = KVCache(model_config, cache_config, self.device)
        self.block_size = cache_config.block_size
        self.sampler = Sampler(model_config.vocab_size, seed)
        self.decode_graphs = None
        if cuda_graph_sizes and model_config.moe is not None:
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

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Compute the step's tokens and sample for every request whose chunk reaches its last token; verify the
        n-gram drafts of a request that carries them (`engine.speculative`).

        Raises:
            Exception: whatever the forward pass raised (a fault of the whole step; sampling failures are per
                request, in `RunnerOutput.failed`).
        """
        self.kv_cache.copy_blocks(out.block_copies)  # forked samples' partial blocks, before anything writes them
        scheduled = out.decodes + out.prefills
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        verify: list[tuple[ScheduledRequest, int]] = []  # a request with drafts, and the row of its last known token
        for s in scheduled:
            start = s.request.num_computed_tokens
            known = s.num_new_tokens - len(s.spec_token_ids)
            input_ids.extend(s.request.all_token_ids[start:start + known])
            input_ids.extend(s.spec_token_ids)
            for p in range(start, start + s.num_new_tokens):
                positions.append(p)
                slots.append(s.block_ids[p // self.block_size] * self.block_size + p % self.block_size)
            if s.spec_token_ids:
                verify.append((s, len(input_ids) - 1 - len(s.spec_token_ids)))
            elif s.sample:
                sample_rows.append(len(input_ids) - 1)
        # Layer-wise KV streaming: a prefill-only request's last chunk tells its sender as each layer is written.
        # The scheduler files a one-token chunk under decodes (a prefix-cache hit up to the last token).
        streaming = [s for s in scheduled if s.sample and s.request.kv_layers is not None]
        decode_context_lens = [s.request.num_computed_tokens + 1 for s in out.decodes]
        graphs = self.decode_graphs
        if graphs is not None and out.decodes and not out.prefills and not streaming:
            size = graphs.size_for(len(out.decodes), max(len(s.block_ids) for s in out.decodes))
            if size is not None:
                logits = graphs.run(size, input_ids, positions, slots, [s.block_ids for s in out.decodes],
                                    decode_context_lens)
                return self.sampler(logits[sample_rows], [s.request for s in scheduled if s.sample])
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=len(out.decodes),
            decode_block_tables=self._block_tables(out.decodes),
            decode_context_lens=torch.tensor(decode_context_lens, dtype=torch.int32, device=dev),
            prefill_cu_seqlens=torch.tensor(_cumsum([s.num_new_tokens for s in out.prefills]), dtype=torch.int32,
                                            device=dev),
            prefill_context_lens=torch.tensor(
                [s.request.num_computed_tokens + s.num_new_tokens for s in out.prefills], dtype=torch.int32,
                device=dev),
            prefill_block_tables=self._block_tables(out.prefills),
            prefill_max_query_len=max((s.num_new_tokens for s in out.prefills), default=0),
        )
        for s in streaming:
            s.request.kv_layers.begin(s.block_ids, s.request.num_computed_tokens + s.num_new_tokens)

        def on_layer(layer: int) -> None:
            for s in streaming:
                s.request.kv_layers.layer_written(layer, dev)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long, device=dev),
                            torch.tensor(positions, dtype=torch.long, device=dev), meta, self.kv_cache.layers,
                            on_layer_written=on_layer if streaming else None)
        verify_rows = [row for s, last in verify for row in range(last, last + len(s.spec_token_ids) + 1)]
        if not sample_rows and not verify_rows:
            return RunnerOutput()
        # Every row sampled (an all-decode step without drafts; sample_rows ascend): the hidden states as they are.
        every_row = not verify_rows and len(sample_rows) == hidden.shape[0]
        logits = self.model.compute_logits(hidden if every_row else hidden[sample_rows + verify_rows])  # on device
        result = self.sampler(logits[:len(sample_rows)], [s.request for s in scheduled
                                                           if s.sample and not s.spec_token_ids])
        if verify:
            _verify_drafts(verify, logits[len(sample_rows):], result)
        return result

    def _block_tables(self, group: list[ScheduledRequest]) -> torch.Tensor:
        """[len(group), max_blocks] int32, zero-padded (`fill_block_tables`), on the runner's device."""
        host = np.empty((len(group), max(1, max((len(s.block_ids) for s in group), default=0))), dtype=np.int32)
        fill_block_tables(host, [s.block_ids for s in group])
        return torch.from_numpy(host).to(self.device)


def _verify_drafts(verify: list[tuple[ScheduledRequest, int]], logits: torch.Tensor, result: RunnerOutput) -> None:
    """Greedy verification of n-gram drafts (`engine.speculative.accept_greedy`): each request's k + 1 rows of
    logits ([sum(k + 1), vocab], in `verify` order) give the model's own token after the last known token and
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
