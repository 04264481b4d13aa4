"""--kv-cache-dtype bfloat16 under a float32 model (`engine.config.resolve_cache_dtype`): a bf16 KV cache that the
kernels write by rounding to nearest even and read widened exactly, all arithmetic in fp32. The C kernels (every
build this CPU runs) against the torch reference over the same bf16 values; the model runner's cache, its one-region
decode step against its forward, the cpu backend against the torch one; the budget, the compat hash and the rules."""
from __future__ import annotations

import pytest
import torch

from pdserve_server.engine.config import (CacheConfig, compat_hash, kv_bytes_per_block, num_blocks_for_budget,
                                          resolve_cache_dtype)
from pdserve_server.engine.execution.model_runner import ModelRunner
from pdserve_server.engine.models.config import ModelConfig
from pdserve_server.kernels import reference as ref
from kernel_builds import kernels  # noqa: F401 (a fixture: the ops, once per build this CPU runs)
from test_tp_heads import BLOCK, _llama, greedy_steps


def _cache(head_dim: int, g: torch.Generator, num_blocks: int = 48, block_size: int = 16, kv_heads: int = 3):
    """A bf16 cache pair as a slice of an all-layers cache (dim 0 strided, as the engine's per-layer views)."""
    kv = torch.randn(num_blocks, 2, 2, block_size, kv_heads, head_dim, generator=g).bfloat16()
    return kv[:, 1, 0], kv[:, 1, 1]


@pytest.mark.parametrize("head_dim", [64, 128, 32])  # 64 / 128: the AVX paths; 32: the plain loops
def test_decode_and_prefill_attention_over_a_bf16_cache_match_the_reference(kernels, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    k_cache, v_cache = _cache(head_dim, g)
    tables = torch.randperm(48, generator=g)[:40].view(5, 8).int()
    lens = torch.tensor([1, 17, 100, 128, 63], dtype=torch.int32)
    q = torch.randn(5, 9, head_dim, generator=g)
    scale = head_dim ** -0.5
    for window in (0, 20):
        got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window)
        want = ref.paged_decode_attention(q, k_cache.float(), v_cache.float(), tables, lens, scale, window)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    # the reference reads the bf16 cache itself the same way
    torch.testing.assert_close(ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale),
                               ref.paged_decode_attention(q, k_cache.float(), v_cache.float(), tables, lens, scale))
    cu = torch.tensor([0, 10, 40], dtype=torch.int32)
    ctx = torch.tensor([30, 100], dtype=torch.int32)
    qp = torch.randn(40, 9, head_dim, generator=g)
    got = kernels.prefill_attention(qp, k_cache, v_cache, cu, ctx, tables[:2], scale)
    want = ref.prefill_attention(qp, k_cache.float(), v_cache.float(), cu, ctx, tables[:2], scale)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_the_kv_write_rounds_fp32_rows_into_a_bf16_cache_as_torch_does(kernels):
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = _cache(64, g)
    qkv = torch.randn(4, 9 + 2 * 3, 64, generator=g) * 100  # large values: rounding, not only truncation
    cos, sin = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)
    slots = torch.tensor([0, 5, 17, 47 * 16 + 15])
    k1, v1, k2, v2 = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    q_ours = kernels.rotary_and_write_kv(qkv.clone(), cos, sin, k1, v1, slots)
    q_ref = ref.rotary_and_write_kv(qkv.clone(), cos.view(4, 1, 64), sin.view(4, 1, 64), k2, v2, slots)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    torch.testing.assert_close(q_ours, q_ref)
    with pytest.raises(ValueError, match="outside the KV cache"):
        kernels.rotary_and_write_kv(qkv.clone(), cos, sin, k1, v1, torch.tensor([0, 1, 2, 48 * 16]))


def _runner(model, cache_dtype: str | None, backend: str = "cpu", stack: bool = True) -> ModelRunner:
    cfg = ModelConfig.from_hf(model.config, name="m", path="", dtype="float32")
    return ModelRunner(cfg, CacheConfig(block_size=BLOCK, num_blocks=24, cache_dtype=cache_dtype), model.state_dict(),
                       attention_backend=backend, cpu_decode_stack=stack)


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 250 for j in range(11 + 8 * (i % 2))] for i in range(n)]


def test_a_float32_model_over_a_bf16_cache():
    model = _llama(num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    prompts = _prompts(3)
    stacked = _runner(model, "bfloat16")
    assert stacked.kv_cache.kv.dtype == torch.bfloat16 and stacked.decode_stack is not None
    ours = greedy_steps(stacked, prompts, 4)
    eager = greedy_steps(_runner(model, "bfloat16", stack=False), prompts, 4)
    for a, b in zip(ours, eager):  # the one-region step computes what the forward does, bit for bit
        assert torch.equal(a, b)
    for a, b in zip(ours, greedy_steps(_runner(model, "bfloat16", backend="torch"), prompts, 4)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # the C kernels keep the reference's semantics
    fp32 = greedy_steps(_runner(model, None), prompts, 4)
    assert not torch.equal(ours[0], fp32[0])  # the prefill's attention reads the chunk's K/V rounded to bf16
    for a, b in zip(ours, fp32):
        assert (a - b).abs().max() <= 0.02 * b.abs().max()


def test_the_cache_dtype_rules_budget_and_compat_hash():
    assert resolve_cache_dtype("auto", "float32", "cpu") is None
    assert resolve_cache_dtype("float32", "float32", "cpu") is None
    assert resolve_cache_dtype("bfloat16", "bfloat16", "cuda") is None
    assert resolve_cache_dtype("bfloat16", "float32", "cpu") == "bfloat16"
    assert resolve_cache_dtype("bfloat16", "float32", "cpu", "torch") == "bfloat16"
    refused = [("bfloat16", "float32", "cuda", "auto"), ("float16", "float32", "cpu", "cpu"),
               ("float32", "bfloat16", "cpu", "cpu"), ("bfloat16", "float32", "cpu", "triton")]
    for name, dtype, device, backend in refused:
        with pytest.raises(ValueError, match="--kv-cache-dtype"):
            resolve_cache_dtype(name, dtype, device, backend)
    with pytest.raises(ValueError, match="cache_dtype"):
        CacheConfig(block_size=16, num_blocks=4, cache_dtype="int8")
    model = ModelConfig.from_hf(_llama().config, name="m", path="", dtype="float32")
    assert kv_bytes_per_block(model, 16, 1, "bfloat16") * 2 == kv_bytes_per_block(model, 16)
    budget = 64 * kv_bytes_per_block(model, 16)
    assert num_blocks_for_budget(model, 16, budget, None, 1, "bfloat16") == 2 * num_blocks_for_budget(
        model, 16, budget, None)
    # a prefill worker with one cache dtype never hands its blocks to a decode worker with the other
    assert compat_hash(model, CacheConfig(16, 4)) != compat_hash(model, CacheConfig(16, 4, cache_dtype="bfloat16"))
    assert compat_hash(model, CacheConfig(16, 4)) == compat_hash(model, CacheConfig(16, 4, cache_dtype=None))
