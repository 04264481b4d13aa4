"""Mixture-of-experts models (Qwen3-MoE, Mixtral): greedy parity with HF transformers on tiny random-weight models
(with and without a sliding window), experts run grouped (one GEMM per active expert, not per token), both
checkpoint layouts of the experts, and the config reading of which layers are sparse."""
import dataclasses
import random
from pathlib import Path

import pytest
import torch

from conftest import hf_greedy
from pdserve_server.engine.models.config import ModelConfig
from pdserve_server.engine.models.decoder import DecoderModel
from pdserve_server.engine.models.interface import MoEConfig
from pdserve_server.engine.models.moe import SparseMoE
from pdserve_server.kernels.backends import select_ops
from test_models import TINY, VOCAB, _save_random, run_greedy

MOE = dict(TINY, num_experts_per_tok=2)


def _sharpen_router(model) -> None:
    """Router weights large enough that each token's top-2 experts are clear winners (no near-ties for summation
    order to flip) and different tokens pick different experts; experts three times HF's initial scale, so that
    their output moves the greedy tokens (at HF's scale a wrong routing weight went unnoticed in Qwen3-MoE)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
            elif ".experts." in name:
                p.mul_(3.0)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory) -> str:
    """Three layers: 0 and 1 sparse, 2 dense (`mlp_only_layers`), 8 experts of width 32, top-2, unnormalised."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**{**MOE, "num_hidden_layers": 3}, head_dim=16, rms_norm_eps=1e-6, num_experts=8,
                         moe_intermediate_size=32, mlp_only_layers=[2], norm_topk_prob=False)
    model = Qwen3MoeForCausalLM(cfg)
    _sharpen_router(model)
    return _save_random(model, tmp_path_factory.mktemp("tiny-qwen3-moe"))


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> str:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(**{**MOE, "intermediate_size": 32}, rms_norm_eps=1e-5, num_local_experts=8,
                        sliding_window=None)
    model = MixtralForCausalLM(cfg)
    _sharpen_router(model)
    return _save_random(model, tmp_path_factory.mktemp("tiny-mixtral"))


@pytest.fixture(scope="module")
def qwen3_moe_window_dir(tmp_path_factory) -> str:
    """Two sparse layers, both sliding over 8 tokens: HF Qwen3-MoE slides every layer with use_sliding_window (it
    has no max_window_layers / layer_types, unlike Qwen2 and Qwen3)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**MOE, head_dim=16, rms_norm_eps=1e-6, num_experts=8, moe_intermediate_size=32,
                         norm_topk_prob=False, use_sliding_window=True, sliding_window=8)
    model = Qwen3MoeForCausalLM(cfg)
    _sharpen_router(model)
    return _save_random(model, tmp_path_factory.mktemp("tiny-qwen3-moe-window"))


@pytest.fixture(scope="module")
def mixtral_window_dir(tmp_path_factory) -> str:
    """Mixtral with sliding_window 12 on both layers."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(**{**MOE, "intermediate_size": 32}, rms_norm_eps=1e-5, num_local_experts=8,
                        sliding_window=12)
    model = MixtralForCausalLM(cfg)
    _sharpen_router(model)
    return _save_random(model, tmp_path_factory.mktemp("tiny-mixtral-window"))


@pytest.mark.parametrize("model_fixture,sparse_layers,normalised", [
    ("qwen3_moe_dir", (0, 1), False),
    ("mixtral_dir", (0, 1), True),
])
def test_greedy_matches_hf(request, model_fixture, sparse_layers, normalised):
    """24+ greedy tokens from prompts of 1..40 tokens under a 16-token budget (chunked prefill, mixed decode and
    prefill steps): every step routes a different set of tokens through the experts."""
    model_dir = request.getfixturevalue(model_fixture)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 6, 19, 40)]
    max_tokens = [24, 30, 26, 25]
    parts, reqs, chunked = run_greedy(model_dir, prompts, max_tokens)
    moe = parts.model_config.moe
    assert moe is not None and (moe.num_experts, moe.top_k) == (8, 2)
    assert (moe.sparse_layers, moe.norm_topk_prob) == (sparse_layers, normalised)
    assert chunked, "the test meant to exercise chunked prefill"
    for req, p, n in zip(reqs, prompts, max_tokens):
        assert len(req.output_token_ids) == n
        assert req.output_token_ids == hf_greedy(model_dir, p, n), req.request_id


@pytest.mark.parametrize("model_fixture,windows", [
    ("qwen3_moe_window_dir", (8, 8)),
    ("mixtral_window_dir", (12, 12)),
])
def test_greedy_matches_hf_sliding_window(request, model_fixture, windows):
    """As above with windows far shorter than the 40-token prompts plus 24+ generated tokens."""
    model_dir = request.getfixturevalue(model_fixture)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 6, 19, 40)]
    max_tokens = [24, 30, 26, 25]
    parts, reqs, chunked = run_greedy(model_dir, prompts, max_tokens)
    assert parts.model_config.layer_windows == windows
    assert chunked, "the test meant to exercise chunked prefill"
    for req, p, n in zip(reqs, prompts, max_tokens):
        assert req.output_token_ids == hf_greedy(model_dir, p, n), req.request_id


def _moe_block(norm: bool) -> SparseMoE:
    torch.manual_seed(0)
    block = SparseMoE(32, MoEConfig(num_experts=8, top_k=2, intermediate_size=16, norm_topk_prob=norm,
                                    sparse_layers=(0,)), select_ops("torch", "cpu"))
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 1.0)
    return block


@pytest.mark.parametrize("norm", [False, True])
def test_experts_run_grouped_and_match_a_per_token_loop(norm):
    """40 tokens x top-2 = 80 assignments, but one gate/up GEMM (one silu_and_mul) per expert that received any,
    and the sum equals the obvious per-token, per-expert loop."""
    block = _moe_block(norm)
    calls = []
    silu_and_mul = block.ops.silu_and_mul
    block.ops = dataclasses.replace(block.ops, silu_and_mul=lambda x: calls.append(x.shape[0]) or silu_and_mul(x))
    x = torch.randn(40, 32)
    with torch.no_grad():
        out = block(x)
        weights, experts = block.route(x)
        expected = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for w, e in zip(weights[t], experts[t]):
                gate, up = torch.nn.functional.linear(x[t], block.experts.gate_up_proj[e]).chunk(2)
                expected[t] += w * torch.nn.functional.linear(torch.nn.functional.silu(gate) * up,
                                                              block.experts.down_proj[e])
    active = experts.unique().numel()
    assert len(calls) == active and sum(calls) == 80 and active > 2  # grouped, and routing is not degenerate
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    if norm:
        torch.testing.assert_close(weights.sum(dim=-1), torch.ones(40))
    else:
        assert (weights.sum(dim=-1) < 1).all()


def test_experts_load_from_either_layout(qwen3_moe_dir):
    """The checkpoint's per-expert tensors and HF >= 5's in-memory stacked ones (`experts.gate_up_proj`) load to
    the same parameters; a missing expert is named."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve_server.engine.execution.loader import load_state_dict

    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(qwen3_moe_dir), name="m", path="")
    ops = select_ops("torch", "cpu")
    per_expert = load_state_dict(Path(qwen3_moe_dir))
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in per_expert
    stacked = AutoModelForCausalLM.from_pretrained(qwen3_moe_dir, dtype=torch.float32).state_dict()
    assert stacked["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    a, b = DecoderModel(cfg, ops), DecoderModel(cfg, ops)
    a.load_weights(per_expert)
    b.load_weights(stacked)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    missing = {k: v for k, v in per_expert.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"}
    with pytest.raises(KeyError, match="layers.1.mlp.experts.3.up_proj.weight"):
        DecoderModel(cfg, ops).load_weights(missing)


def test_dense_checkpoint_refused_by_moe_config(qwen3_moe_dir):
    """A dense layer's tensors where the config says experts: the router is missing, named."""
    from transformers import AutoConfig

    from pdserve_server.engine.execution.loader import load_state_dict

    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(qwen3_moe_dir), name="m", path="")
    state = load_state_dict(Path(qwen3_moe_dir))
    dense = {k: v for k, v in state.items() if ".mlp." not in k or not k.startswith("model.layers.0.")}
    dense["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(128, 64)
    with pytest.raises(KeyError, match="layers.0.mlp.gate.weight"):
        DecoderModel(cfg, select_ops("torch", "cpu")).load_weights(dense)


def test_sparse_layers_follow_hf():
    """HF Qwen3MoeDecoderLayer: layer i is sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step
    == 0; no experts at all gives a dense model; Mixtral is sparse everywhere."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    def sparse(c):
        moe = ModelConfig.from_hf(c, name="m", path="").moe
        return None if moe is None else moe.sparse_layers

    assert sparse(Qwen3MoeConfig(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])) == (1, 5)
    assert sparse(Qwen3MoeConfig(num_hidden_layers=3, num_experts=0)) is None
    assert sparse(MixtralConfig(num_hidden_layers=4)) == (0, 1, 2, 3)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_experts_compute_their_dequantized_weights_and_the_router_stays(method):
    """Weight-only int8 / int4 of an MoE block: one quantized linear per expert and projection (the stacked
    tensors gone), the router left in bf16, and the block's output the one its dequantized weights give, within
    bf16's rounding of the op's output and of the activations between the projections."""
    from torch import nn

    from pdserve_server.engine.execution.quantization import (Int4WeightOnlyLinear, Int8WeightOnlyLinear,
                                                              dequantize_int4,
                                                    quantize_int4, quantize_weight_only)

    torch.manual_seed(0)
    block = SparseMoE(64, MoEConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True,
                                    sparse_layers=(0,)), select_ops("torch", "cpu")).to(torch.bfloat16)
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 1.0)
        for p in (block.experts.gate_up_proj, block.experts.down_proj):
            p.normal_(0.0, 0.2)
    reference = SparseMoE(64, MoEConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True,
                                        sparse_layers=(0,)), select_ops("torch", "cpu"))
    with torch.no_grad():  # fp32, with the weights the quantized codes stand for
        reference.gate.weight.copy_(block.gate.weight.float())
        for name in ("gate_up_proj", "down_proj"):
            for e, w in enumerate(getattr(block.experts, name)):
                if method == "int4":
                    dq = dequantize_int4(*quantize_int4(w, 32), 32)
                else:
                    dq = Int8WeightOnlyLinear(_linear(w))._dense_weight(torch.float32)
                getattr(reference.experts, name)[e].copy_(dq)
    assert quantize_weight_only(block, method) == 16
    kind = Int8WeightOnlyLinear if method == "int8" else Int4WeightOnlyLinear
    assert all(isinstance(m, kind) for pair in block.experts.quantized for m in pair)
    assert not hasattr(block.experts, "gate_up_proj") and type(block.gate) is nn.Linear
    x = torch.randn(40, 64).to(torch.bfloat16)
    with torch.no_grad():
        out = block(x)
        expected = reference(x.float())
    assert block.route(x)[1].unique().numel() > 2  # routing is not degenerate
    assert float((out.float() - expected).norm() / expected.norm()) < 2e-2


def _linear(weight: torch.Tensor):
    from torch import nn

    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
    return layer


def test_int4_moe_engine_computes_its_dequantized_model(qwen3_moe_dir):
    """The Qwen3-MoE checkpoint served with --quantization int4 (experts, attention and LM head quantized; the
    router not) generates what the bf16 engine generates with those weights replaced by their dequantized codes,
    as the dense model's test (tests/engine/test_dtype.py) holds it: most tokens agree (bf16 rounding of the reference's
    weights parts some on random weights), a wrong layout would leave next to none."""
    from torch import nn

    from pdserve_server.engine.args import EngineArgs
    from pdserve_server.engine.builder import build_engine
    from pdserve_server.engine.offline import generate
    from pdserve_server.engine.execution.quantization import dequantize_int4, quantize_int4
    from pdserve_server.engine.request import SamplingParams
    from test_dtype import agreement

    prompts = [[5 + i, 17, 100 + 7 * i] * (i + 1) for i in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0.0)

    def engine(**kw):
        return build_engine(EngineArgs(model_dir=qwen3_moe_dir, dtype="bfloat16", kv_tokens=2048, max_model_len=256,
                                       attention_backend="torch", packed_weights=False, **kw))

    reference = engine()
    with torch.no_grad():
        for name, module in reference.runner.model.named_modules():
            if isinstance(module, nn.Linear) and not name.endswith("mlp.gate"):
                module.weight.copy_(dequantize_int4(*quantize_int4(module.weight, 32), 32))
            elif name.endswith("mlp.experts"):
                for p in (module.gate_up_proj, module.down_proj):
                    for w in p:
                        w.copy_(dequantize_int4(*quantize_int4(w, 32), 32))
    expected = generate(reference, [prompts], params)
    got = generate(engine(quantization="int4"), [prompts], params)
    assert agreement(got, expected) >= 0.6, (got, expected)
