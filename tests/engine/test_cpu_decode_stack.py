"""The cpu backend's one-call decode loop (`engine.execution.cpu_decode_stack`, `pdserve::decode_layers`): the same ops
in the same order as the model's forward, so the same logits bit for bit, in every linear form it runs; and the models
it must leave to their own forward."""
from __future__ import annotations

import pytest
import torch

from pdserve_server.engine.config import CacheConfig

from pdserve_server.engine.models.config import ModelConfig
from pdserve_server.engine.execution.cpu_decode_stack import (INT4_LINEAR, INT8_LINEAR, PACKED_LINEAR, SMALL_M_LINEAR,
                                                    TORCH_LINEAR, CpuDecodeStack)
from pdserve_server.engine.execution.model_runner import ModelRunner
from pdserve_server.engine.execution.packing import PACKED_GEMV_ROWS, PackedLinear, packing_supported
from test_tp_heads import BLOCK, _gemma, _llama, greedy_steps


def _mistral_windowed():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                            max_position_embeddings=128, sliding_window=7))


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                        max_position_embeddings=128))


def _runner(model, dtype: torch.dtype, stack: bool, packed: bool = True, prompts: int = 2,
            quantization: str = "none") -> ModelRunner:
    cfg = ModelConfig.from_hf(model.config, name="m", path="", dtype=str(dtype).removeprefix("torch."))
    return ModelRunner(cfg, CacheConfig(block_size=BLOCK, num_blocks=8 * prompts), model.state_dict(),
                       attention_backend="cpu", packed_weights=packed, quantization=quantization,
                       cpu_decode_stack=stack)


BF16_FORM = PACKED_LINEAR if packing_supported(torch.device("cpu"), torch.bfloat16) else TORCH_LINEAR


@pytest.mark.parametrize("build,dtype,packed,form,batch,quantization", [
    (lambda: _llama(num_attention_heads=9, num_key_value_heads=3, hidden_size=72), torch.float32, True,
     SMALL_M_LINEAR, 2, "none"),  # SmolLM2's head shape, q/k/v biases
    (lambda: _llama(num_attention_heads=8, num_key_value_heads=2), torch.float32, True, SMALL_M_LINEAR, 65, "none"),
    (lambda: _llama(num_attention_heads=8, num_key_value_heads=2), torch.float32, False, TORCH_LINEAR, 2, "none"),
    (lambda: _llama(num_attention_heads=8, num_key_value_heads=2), torch.bfloat16, True, BF16_FORM, 3, "none"),
    (lambda: _llama(num_attention_heads=9, num_key_value_heads=3, hidden_size=72), torch.bfloat16, True, BF16_FORM,
     2, "none"),  # SmolLM2's head shape, q/k/v biases, in bf16
    (lambda: _llama(num_attention_heads=8, num_key_value_heads=2), torch.bfloat16, True, BF16_FORM,
     PACKED_GEMV_ROWS + 1, "none"),  # past the packed-layout kernel's rows: oneDNN in both
    (_mistral_windowed, torch.float32, True, SMALL_M_LINEAR, 2, "none"),  # a sliding window shorter than the prompts
    (_mistral_windowed, torch.bfloat16, True, BF16_FORM, 2, "none"),
    (lambda: _llama(num_attention_heads=8, num_key_value_heads=2), torch.bfloat16, True, INT8_LINEAR, 2, "int8"),
    (lambda: _llama(num_attention_heads=8, num_key_value_heads=2, vocab_size=256), torch.bfloat16, True, INT4_LINEAR,
     2, "int4"),  # int4 packs 16 output rows at a time: a vocabulary of 256
], ids=["fp32-small-m-bias", "fp32-65-rows-torch-gemm", "fp32-unpacked", "bf16", "bf16-bias", "bf16-33-rows",
        "sliding-window", "bf16-sliding-window", "int8", "int4"])
def test_decode_stack_gives_the_forward_passes_logits_bit_for_bit(build, dtype, packed, form, batch, quantization):
    """Prefill `batch` prompts (lengths 11, 19, ...: across block boundaries), then 6 greedy decode steps through the
    C++ loop and through the model's forward: equal logits at every step. 65 rows go past the fp32 kernel's 64 (the
    loop then takes torch's GEMM, as SmallBatchLinear does). bf16 packed linears whose layout the backend's kernel
    reads run the one-region step (`decode_layers_fused`) up to PACKED_GEMV_ROWS rows, fp32 up to SMALL_BATCH_ROWS,
    whose linears are the forward's own at those rows."""
    model = build()
    prompts = [[(7 * i + j) % 250 for j in range(11 + 8 * (i % 2))] for i in range(batch)]
    with_stack = _runner(model, dtype, True, packed, batch, quantization)
    assert with_stack.decode_stack is not None and with_stack.decode_stack.form == form
    packed_linears = [m for m in with_stack.model.modules() if isinstance(m, PackedLinear)]
    # The one-region step: fp32 through the small-batch kernel; bf16 on a CPU whose oneDNN packs as the kernel reads
    # (every one measured so far: every linear takes it), else both run oneDNN.
    assert len({bool(m.weight_ptr) for m in packed_linears}) <= 1
    fused = form == SMALL_M_LINEAR or (form == PACKED_LINEAR and any(m.weight_ptr for m in packed_linears))
    assert (with_stack.decode_stack._fused_step is not None) == fused
    stacked = greedy_steps(with_stack, prompts, 6)
    eager = greedy_steps(_runner(model, dtype, False, packed, batch, quantization), prompts, 6)
    for a, b in zip(stacked, eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("build,why", [
    (_gemma, "its own forward (scaled embedding, four norms a layer)"),
    (_qwen3, "q/k norms"),
])
def test_models_the_loop_does_not_cover_keep_their_forward(build, why):
    model = build()
    assert _runner(model, torch.float32, True).decode_stack is None, why


def test_other_backends_and_mixed_linears_keep_the_forward():
    model = _llama(num_attention_heads=8, num_key_value_heads=2)
    cfg = ModelConfig.from_hf(model.config, name="m", path="")
    torch_backend = ModelRunner(cfg, CacheConfig(block_size=BLOCK, num_blocks=16), model.state_dict(),
                                attention_backend="torch")
    assert torch_backend.decode_stack is None
    cpu = ModelRunner(cfg, CacheConfig(block_size=BLOCK, num_blocks=16), model.state_dict(), attention_backend="cpu",
                      cpu_decode_stack=False)
    assert cpu.decode_stack is None
    assert CpuDecodeStack.build(torch.nn.Linear(2, 2), cpu.attention_ops) is None
    cpu.model.layers[1].mlp.down_proj = torch.nn.Identity()  # a form the loop does not know
    assert CpuDecodeStack.build(cpu.model, cpu.attention_ops) is None
    assert CpuDecodeStack.build(_runner(model, torch.float32, True).model, cpu.attention_ops) is not None


def test_one_region_step_refuses_slots_and_blocks_outside_the_cache_and_writes_nothing():
    """`pdserve::decode_layers_fused` checks what its C kernel trusts before it starts: a slot past the cache, a
    block id past it, or a context longer than its table row is a ValueError, with the caches and the residual stream
    unchanged."""
    runner = _runner(_llama(num_attention_heads=8, num_key_value_heads=2), torch.bfloat16, True)
    stack = runner.decode_stack
    if stack is None or stack._fused_step is None:
        pytest.skip("this CPU's oneDNN does not pack bf16 weights in the layout the kernel reads")
    from pdserve_server.engine.attention import AttentionMetadata

    kv = runner.kv_cache.kv
    num_blocks = kv.shape[0]
    before = kv.clone()
    ids, positions = torch.tensor([5, 6]), torch.tensor([3, 4])
    good_slots, tables = torch.tensor([3, BLOCK + 4]), torch.tensor([[0, 2], [1, 3]], dtype=torch.int32)
    cases = [
        ("outside the KV cache", torch.tensor([3, num_blocks * BLOCK]), tables, [4, 5]),
        ("names a block outside the cache", good_slots, torch.tensor([[0, num_blocks], [1, 3]], dtype=torch.int32),
         [BLOCK + 1, 5]),
        ("needs more blocks than the row has", good_slots, tables, [2 * BLOCK + 1, 5]),
    ]
    for message, slots, table, lens in cases:
        empty = torch.zeros(0, dtype=torch.int32)
        meta = AttentionMetadata(slot_mapping=slots, num_decodes=2, decode_block_tables=table,
                                 decode_context_lens=torch.tensor(lens, dtype=torch.int32), prefill_cu_seqlens=empty,
                                 prefill_context_lens=empty, prefill_block_tables=empty.view(0, 2),
                                 prefill_max_query_len=0)
        with pytest.raises(ValueError, match=message):
            stack(ids, positions, meta, runner.kv_cache.layers)
        assert torch.equal(kv, before)


def _gguf_llama(fmt: str):
    """A tiny Llama whose layer weights are the dequantization of GGUF `fmt` ("q4_1" / "q8_0") tensors and whose LM
    head a Q8_0 one's, as the packaged model's are."""
    from test_kernels_cpu import q4_1_weight, q8_0_weight

    model = _llama(num_attention_heads=8, num_key_value_heads=2)
    make = q4_1_weight if fmt == "q4_1" else q8_0_weight
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.model.layers.parameters():
            if p.dim() == 2:
                p.copy_(make(*p.shape, g))
        model.lm_head.weight.copy_(q8_0_weight(*model.lm_head.weight.shape, g))
    return model


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_a_model_of_gguf_weights_decodes_from_its_blocks_with_the_same_logits(fmt):
    """fp32 weights that are a GGUF tensor's dequantization (as the packaged model's are: Q4_1 layers, a Q8_0 LM head)
    are held as blocks too, and the one-region step and the LM head read those: the same logits bit for bit as the
    model's forward and as the same step over the fp32 tensors (the blocks dropped), through prefill and 6 decode
    steps; a model whose weights are not of such a form keeps reading fp32. Every step has fewer than 24 rows: from 24
    the avx2 build reads the blocks through panels, which sum in another order (kernels/cpu_linear.c; their own test
    is in tests/kernels/test_kernels_cpu.py)."""
    from pdserve_server.engine.execution.cpu_decode_stack import Q4_1_BLOCKS, Q8_0_BLOCKS
    from pdserve_server.engine.execution.packing import SmallBatchLinear, blocks_format

    model = _gguf_llama(fmt)
    prompts = [[(7 * i + j) % 250 for j in range(5 + 4 * (i % 2))] for i in range(3)]
    runner = _runner(model, torch.float32, True, prompts=3)
    stack = runner.decode_stack
    layer_linears = [m for m in runner.model.layers.modules() if isinstance(m, SmallBatchLinear)]
    assert len(layer_linears) == 8 and all(m.blocks is not None for m in layer_linears)
    assert blocks_format(runner.model.lm_head.blocks) == "q8_0"
    assert stack._fused_step is not None and len(stack.scale_ptrs) == 8
    assert stack.weight_blocks == (Q4_1_BLOCKS if fmt == "q4_1" else Q8_0_BLOCKS)
    from_blocks = greedy_steps(runner, prompts, 6)
    eager = greedy_steps(_runner(model, torch.float32, False, prompts=3), prompts, 6)
    fp32 = _runner(model, torch.float32, True, prompts=3)
    for m in fp32.model.modules():
        if isinstance(m, SmallBatchLinear):
            m.blocks = None
    fp32.decode_stack = CpuDecodeStack.build(fp32.model, fp32.attention_ops)
    assert fp32.decode_stack._fused_step is not None and fp32.decode_stack.scale_ptrs == []
    for a, b, c in zip(from_blocks, eager, greedy_steps(fp32, prompts, 6)):
        assert torch.equal(a, b) and torch.equal(a, c)
    plain = _runner(_llama(num_attention_heads=8, num_key_value_heads=2), torch.float32, True)
    assert plain.decode_stack.scale_ptrs == [] and plain.model.lm_head.blocks is None


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_quantization_gguf_takes_one_row_in_8_bits_and_more_rows_exactly(fmt):
    """--quantization gguf: every linear held as GGUF blocks takes a one-row x quantized to 8 bits a block (llama.cpp's
    arithmetic, `packing.use_q8_activations`), in the one-region step (weight_blocks | Q8_ACTIVATIONS) and in the
    model's forward alike: their logits are equal bit for bit over 6 steps of one sequence, and near the exact
    runner's without being equal (prefill's one logit row goes through the LM head's blocks too). Three sequences
    (3-row steps) stay exact: the exact runner's logits bit for bit. A model without GGUF weights is refused."""
    from pdserve_server.engine.execution.cpu_decode_stack import Q4_1_BLOCKS, Q8_0_BLOCKS, Q8_ACTIVATIONS

    model = _gguf_llama(fmt)
    one, three = [[(5 * j) % 250 for j in range(13)]], [[(7 * i + j) % 250 for j in range(11 + 8 * (i % 2))]
                                                         for i in range(3)]
    q8 = _runner(model, torch.float32, True, prompts=3, quantization="gguf")
    assert q8.decode_stack.weight_blocks == (Q4_1_BLOCKS if fmt == "q4_1" else Q8_0_BLOCKS) | Q8_ACTIVATIONS
    assert q8.model.lm_head.q8_activations
    stacked = greedy_steps(q8, one, 6)
    eager = greedy_steps(_runner(model, torch.float32, False, prompts=3, quantization="gguf"), one, 6)
    assert all(torch.equal(a, b) for a, b in zip(stacked, eager))
    exact = _runner(model, torch.float32, True, prompts=3)
    first = greedy_steps(exact, one, 1)  # prefill and one decode step: the same inputs as the 8-bit runner's
    for a, b in zip(stacked, first):
        assert not torch.equal(a, b) and (a - b).abs().max() <= 0.05 * b.abs().max()
    for a, b in zip(greedy_steps(q8, three, 3), greedy_steps(exact, three, 3)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="exactly a GGUF's Q4_1 or Q8_0 blocks"):
        _runner(_llama(num_attention_heads=8, num_key_value_heads=2), torch.float32, True, quantization="gguf")
