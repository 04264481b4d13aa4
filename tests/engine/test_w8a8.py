"""--quantization w8a8_int8 in the model runner: every decoder linear computes its rows through the int8 GEMM
(`engine.execution.packing.use_w8a8`, `kernels/cpu_int8_gemm.c`), prefill chunks and decode steps alike, in the model's
forward and in the one-region decode step (`engine.execution.cpu_decode_stack`) with the same bits, the LM head too;
one-row decodes of weights held as GGUF blocks read the blocks, with the row quantized to 8 bits (llama.cpp's
arithmetic, `packing.use_q8_activations`)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve_server.engine.config import CacheConfig
from pdserve_server.engine.execution.cpu_decode_stack import Q4_1_BLOCKS, Q8_ACTIVATIONS, W8A8_WEIGHTS, CpuDecodeStack
from pdserve_server.engine.execution.model_runner import ModelRunner
from pdserve_server.engine.execution.packing import SMALL_BATCH_ROWS, SmallBatchLinear
from pdserve_server.engine.models.config import ModelConfig
from test_tp_heads import BLOCK, _llama, greedy_steps


def _runner(model, quantization: str, dtype: str = "float32", prompts: int = 3, stack: bool = True) -> ModelRunner:
    cfg = ModelConfig.from_hf(model.config, name="m", path="", dtype=dtype)
    return ModelRunner(cfg, CacheConfig(block_size=BLOCK, num_blocks=8 * prompts), model.state_dict(),
                       attention_backend="cpu", quantization=quantization, cpu_decode_stack=stack)


def _model(**kw):
    return _llama(num_attention_heads=8, num_key_value_heads=2, intermediate_size=128, **kw)  # every K a multiple of 64


def _count_int8_calls(runner: ModelRunner) -> list[int]:
    """Wrap every SmallBatchLinear's int8 op in `runner` to record the rows of each call (the forward's calls; the
    one-region step calls the kernel from C)."""
    calls: list[int] = []
    for m in runner.model.modules():
        if isinstance(m, SmallBatchLinear) and m.int8 is not None:
            op, *weights = m.int8
            m.int8 = (lambda x, *a, op=op: calls.append(x.shape[0]) or op(x, *a), *weights)
    return calls


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 250 for j in range(11 + 8 * (i % 2))] for i in range(n)]


def test_every_linear_takes_the_int8_gemm_the_lm_head_too():
    model = _model()
    int8 = _runner(model, "w8a8_int8", stack=False)
    linears = {name: m for name, m in int8.model.named_modules() if isinstance(m, SmallBatchLinear)}
    assert "lm_head" in linears and all(m.int8 is not None for m in linears.values())
    assert len(linears) == 1 + 4 * model.config.num_hidden_layers  # qkv, o, gate_up, down a layer
    calls = _count_int8_calls(int8)
    prompts = _prompts(2)
    ours, ref = greedy_steps(int8, prompts, 3), greedy_steps(_runner(model, "none"), prompts, 3)
    # the prefill step's 8 layer linears, its LM head over the 2 logit rows, then 3 decode steps of 2 rows
    assert calls == [sum(map(len, prompts))] * 8 + [2] + [2] * 9 * 3
    for a, b in zip(ours, ref):  # lossy, and the decodes read the prefill's KV: near, not equal
        assert not torch.equal(a, b) and (a - b).abs().max() <= 0.05 * b.abs().max()


@pytest.mark.parametrize("batch", [1, 3, SMALL_BATCH_ROWS + 1])
def test_the_one_region_step_gives_the_forwards_int8_logits_bit_for_bit(batch):
    """Without GGUF blocks the int8 GEMM takes every row count, one row and past the fp32 kernel's 64 included."""
    model = _model()
    prompts = _prompts(batch)
    stacked = _runner(model, "w8a8_int8", prompts=batch)
    assert stacked.decode_stack._w8a8_ptrs is not None and stacked.decode_stack._w8a8_one_row
    eager = _runner(model, "w8a8_int8", prompts=batch, stack=False)
    assert eager.decode_stack is None
    for a, b in zip(greedy_steps(stacked, prompts, 4), greedy_steps(eager, prompts, 4)):
        assert torch.equal(a, b)


def test_one_row_decodes_of_gguf_weights_read_the_blocks_and_more_rows_the_int8_gemm():
    from test_kernels_cpu import q4_1_weight

    model, g = _model(), torch.Generator().manual_seed(1)
    with torch.no_grad():  # layers of Q4_1 weights, as the packaged model's
        for p in model.model.layers.parameters():
            if p.dim() == 2:
                p.copy_(q4_1_weight(*p.shape, g))
    stacked, eager = _runner(model, "w8a8_int8"), _runner(model, "w8a8_int8", stack=False)
    stack = stacked.decode_stack
    assert stack.weight_blocks == Q4_1_BLOCKS | Q8_ACTIVATIONS  # one row: the blocks against 8-bit rows
    assert stack._w8a8_ptrs is not None and not stack._w8a8_one_row
    assert all(m.q8_activations == (m.blocks is not None) for m in stacked.model.modules()
               if isinstance(m, SmallBatchLinear))
    calls = _count_int8_calls(eager)
    one = _prompts(1)
    for a, b in zip(greedy_steps(stacked, one, 4), greedy_steps(eager, one, 4)):
        assert torch.equal(a, b)
    # the prefill's layers, then only the LM head's one row a step (fp32 here, not blocks): the layers' one-row
    # decodes read the blocks
    assert calls == [len(one[0])] * 8 + [1] * 5
    for a, b in zip(greedy_steps(stacked, _prompts(3), 4), greedy_steps(eager, _prompts(3), 4)):
        assert torch.equal(a, b)
    assert calls[13:] == [sum(map(len, _prompts(3)))] * 8 + [3] + [3] * 9 * 4
    assert W8A8_WEIGHTS == 8  # kernels/cpu_kernels.h: PDSERVE_W8A8
    no_region = replace(eager.attention_ops, decode_layers_fused=None)
    assert CpuDecodeStack.build(eager.model, no_region) is None  # its C++ loop would compute fp32, the forward int8
    next(m for m in stacked.model.layers[0].modules() if isinstance(m, SmallBatchLinear)).blocks = None
    assert CpuDecodeStack.build(stacked.model, stacked.attention_ops) is None  # blocks on some linears: the forward


def test_models_it_cannot_compute_are_refused_with_what_it_needs():
    with pytest.raises(ValueError, match="w8a8_int8 computes float32 linears"):
        _runner(_model(), "w8a8_int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="multiple of 64"):
        _runner(_llama(num_attention_heads=9, num_key_value_heads=3, hidden_size=72), "w8a8_int8")
