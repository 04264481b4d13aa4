"""--quantization w8a8_int8 in the model runner: prefill chunks (more than SMALL_BATCH_ROWS rows) of every decoder
linear go through the int8 GEMM (`engine.execution.packing.use_w8a8`, `kernels/cpu_int8_gemm.c`), smaller batches and
the LM head stay exactly the fp32 runner's."""
from __future__ import annotations

import pytest
import torch

from pdserve_server.engine.config import CacheConfig
from pdserve_server.engine.execution.model_runner import ModelRunner
from pdserve_server.engine.execution.packing import SMALL_BATCH_ROWS, SmallBatchLinear
from pdserve_server.engine.models.config import ModelConfig
from test_tp_heads import BLOCK, _llama, greedy_steps


def _runner(model, quantization: str, dtype: str = "float32") -> ModelRunner:
    cfg = ModelConfig.from_hf(model.config, name="m", path="", dtype=dtype)
    return ModelRunner(cfg, CacheConfig(block_size=BLOCK, num_blocks=24), model.state_dict(), attention_backend="cpu",
                       quantization=quantization)


def _model(**kw):
    return _llama(num_attention_heads=8, num_key_value_heads=2, intermediate_size=128, **kw)  # every K a multiple of 64


def test_prefill_chunks_take_the_int8_gemm_and_small_batches_stay_exact():
    model = _model()
    int8, exact = _runner(model, "w8a8_int8"), _runner(model, "none")
    linears = {name: m for name, m in int8.model.named_modules() if isinstance(m, SmallBatchLinear)}
    assert linears["lm_head"].int8 is None
    assert sorted(n for n, m in linears.items() if m.int8 is not None) == sorted(n for n in linears if n != "lm_head")
    assert len(linears) == 1 + 4 * model.config.num_hidden_layers  # qkv, o, gate_up, down a layer
    calls = []
    for m in linears.values():
        if m.int8 is not None:
            op, *weights = m.int8
            m.int8 = (lambda x, *a, op=op: calls.append(x.shape[0]) or op(x, *a), *weights)

    small = [[(3 * j) % 250 for j in range(30)] for _ in range(2)]  # a 60-row prefill, then decodes: all exact
    assert sum(map(len, small)) <= SMALL_BATCH_ROWS
    for a, b in zip(greedy_steps(int8, small, 3), greedy_steps(exact, small, 3)):
        assert torch.equal(a, b)
    assert calls == []

    large = [[(5 * j + i) % 250 for j in range(40)] for i in range(2)]  # one 80-row prefill step
    ours, ref = greedy_steps(int8, large, 2), greedy_steps(exact, large, 2)
    assert calls == [80] * 8  # every decoder linear once, for the prefill step only
    for a, b in zip(ours, ref):  # lossy, and the decodes read the prefill's KV: near, not equal
        assert not torch.equal(a, b) and (a - b).abs().max() <= 0.05 * b.abs().max()


def test_models_it_cannot_compute_are_refused_with_what_it_needs():
    with pytest.raises(ValueError, match="w8a8_int8 computes float32 linears"):
        _runner(_model(), "w8a8_int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="multiple of 64"):
        _runner(_llama(num_attention_heads=9, num_key_value_heads=3, hidden_size=72), "w8a8_int8")
