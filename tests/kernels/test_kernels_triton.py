"""Triton kernels against their torch references, on CPU under TRITON_INTERPRET=1 (and on CUDA when present).

Every case draws its own random inputs (seeded from its parameters, so failures reproduce) with contexts that are
ragged: length 1, a non-multiple of the block size, exact multiples, and one long enough to span several
kernel tiles and splits. KV caches are per-layer views of a block-major tensor (strided in dim 0) with blocks
scattered in a random order, as the engine has them.

Tolerances, as relative Frobenius error ||out - ref|| / ||ref|| (plus no NaN):
- fp32: both sides accumulate in fp32 (the kernel's dots are IEEE fp32, not TF32); only summation order differs,
  O(1e-7) per op (seen: 2.4e-7), so 1e-5 leaves headroom over hundreds of tokens.
- fp16/bf16: the reference computes in fp32 from the same half-precision inputs and rounds once at the end; the
  kernel also rounds the softmax probabilities to the input dtype before the PV product (as FlashAttention does).
  Each rounding is at most 2^-11 (fp16) / 2^-8 (bf16) relative; seen: 2e-4 / 5e-3, so 2e-3 / 2e-2.
"""
from __future__ import annotations

import os
import zlib

import pytest
import torch

from pdserve_server.kernels import reference as ref
from pdserve_server.kernels.backends import select_ops
from pdserve_server.kernels.triton_cache import write_kv_cache
from pdserve_server.kernels.triton_prefill import PrefillConfig

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA device")

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _ops():
    return select_ops("triton", DEVICE)


def _rng(*params) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(params).encode()))


def _rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in kernel output"
    return float((out.double() - expected.double()).norm() / expected.double().norm())


def _paged_kv(lengths, block_size, num_kv_heads, head_dim, dtype, g, num_layers=2, layer=1):
    """Random block-major cache; returns (k_cache, v_cache) views of `layer`, block tables, context lens."""
    need = sum(-(-n // block_size) for n in lengths)
    num_blocks = need + 7
    kv = torch.randn(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    width = max(-(-n // block_size) for n in lengths)
    tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lengths):
        nb = -(-n // block_size)
        tables[i, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    kv = kv.to(DEVICE)
    return (kv[:, layer, 0], kv[:, layer, 1], tables.to(DEVICE),
            torch.tensor(lengths, dtype=torch.int32, device=DEVICE))


DECODE_CASES = [  # (block_size, head_dim, num_q_heads, num_kv_heads): GQA ratios 1, 3, 8
    (16, 64, 4, 4),
    (8, 128, 6, 2),
    (16, 128, 8, 1),
    (32, 64, 9, 3),
    (12, 64, 8, 8),  # block size that is not a power of two
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size,head_dim,num_q_heads,num_kv_heads", DECODE_CASES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_paged_decode_matches_reference(block_size, head_dim, num_q_heads, num_kv_heads, dtype, num_splits):
    g = _rng("decode", block_size, head_dim, num_q_heads, num_kv_heads, dtype, num_splits)
    lengths = [1, block_size + 3, 2 * block_size, 300]
    k_cache, v_cache, tables, ctx = _paged_kv(lengths, block_size, num_kv_heads, head_dim, dtype, g)
    query = torch.randn(len(lengths), num_q_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    scale = head_dim ** -0.5
    out = _ops().paged_decode_attention(query, k_cache, v_cache, tables, ctx, scale, num_splits=num_splits)
    expected = ref.paged_decode_attention(query, k_cache, v_cache, tables, ctx, scale)
    assert out.shape == expected.shape and out.dtype == dtype
    assert _rel_err(out, expected) < TOL[dtype]


def _poison_before(k_cache, v_cache, tables, starts, block_size):
    """NaN into sequence i's cached K and V at every position before starts[i]: keys outside all its rows' windows.
    A kernel that loaded them at all (rather than starting at the window) would return NaN: masked scores drop NaN
    keys, but their probability 0 times a NaN value is NaN."""
    for i, start in enumerate(starts):
        pos = torch.arange(start)
        blocks = tables[i].cpu().long()[pos // block_size]
        k_cache[blocks.to(DEVICE), (pos % block_size).to(DEVICE)] = float("nan")
        v_cache[blocks.to(DEVICE), (pos % block_size).to(DEVICE)] = float("nan")


# Sliding windows: W = 1 (the query's token only), inside a block (5, 37: not multiples of the block size), a whole
# block (16), and wider than every context (1000: full attention). Tiny heads: the interpreter is slow.
WINDOWS = [1, 5, 16, 37, 1000]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_paged_decode_with_sliding_window_matches_reference(window, dtype, num_splits):
    """Against the reference with the same window; keys before each window are NaN, so reading them fails; and
    where the window is shorter than the context the output is far from full attention's (a kernel that ignored
    the window could not pass)."""
    g = _rng("decode-window", window, dtype, num_splits)
    block_size = 8
    lengths = [1, 13, 40, 150]
    k_cache, v_cache, tables, ctx = _paged_kv(lengths, block_size, 2, 16, dtype, g)
    query = torch.randn(len(lengths), 6, 16, generator=g).to(dtype).to(DEVICE)
    expected = ref.paged_decode_attention(query, k_cache, v_cache, tables, ctx, 0.25, sliding_window=window)
    full = ref.paged_decode_attention(query, k_cache, v_cache, tables, ctx, 0.25)
    _poison_before(k_cache, v_cache, tables, [max(0, n - window) for n in lengths], block_size)
    out = _ops().paged_decode_attention(query, k_cache, v_cache, tables, ctx, 0.25, sliding_window=window,
                                        num_splits=num_splits)
    assert out.shape == expected.shape and out.dtype == dtype
    assert _rel_err(out, expected) < TOL[dtype]
    for i, n in enumerate(lengths):
        if window < n:
            assert _rel_err(full[i], expected[i]) > 10 * TOL[dtype], (n, window)


@pytest.mark.parametrize("config", [None, PrefillConfig(16, 16, split_mask=True),
                                    PrefillConfig(32, 16, split_mask=False)],
                         ids=lambda c: "default" if c is None else f"m{c.block_m}n{c.block_n}split{int(c.split_mask)}")
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefill_with_sliding_window_matches_reference(window, dtype, config):
    """As the decode test, for chunks (whole prompts, a token after a prefix, chunks whose windows reach back into
    the prefix) and launch shapes whose query blocks are wider and narrower than the window: rows of one block
    that share no key, blocks with and without whole unmasked tiles inside every row's window."""
    g = _rng("prefill-window", window, dtype, config)
    block_size = 8
    seqs = [(1, 1), (13, 13), (40, 1), (70, 45), (150, 100)]  # (context, chunk)
    k_cache, v_cache, tables, ctx = _paged_kv([c for c, _ in seqs], block_size, 1, 16, dtype, g)
    q_lens = [q for _, q in seqs]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    query = torch.randn(sum(q_lens), 2, 16, generator=g).to(dtype).to(DEVICE)
    expected = ref.prefill_attention(query, k_cache, v_cache, cu, ctx, tables, 0.25, sliding_window=window)
    full = ref.prefill_attention(query, k_cache, v_cache, cu, ctx, tables, 0.25)
    _poison_before(k_cache, v_cache, tables, [max(0, c - q - window + 1) for c, q in seqs], block_size)
    from pdserve_server.kernels.triton_prefill import prefill_attention
    out = prefill_attention(query, k_cache, v_cache, cu, ctx, tables, 0.25, max(q_lens), sliding_window=window,
                            config=config)
    assert out.shape == expected.shape and out.dtype == dtype
    assert _rel_err(out, expected) < TOL[dtype]
    for i, (c, _) in enumerate(seqs):
        last = int(cu[i + 1]) - 1  # the chunk's last row sees the most keys
        if window < c:
            assert _rel_err(full[last], expected[last]) > 10 * TOL[dtype], (c, window)


def test_split_count_fills_the_gpu_but_keeps_splits_long():
    from pdserve_server.kernels.triton_decode import choose_num_splits

    # Llama-3-8B shapes on a 132-SM H100: batch 1 x 2k context -> 8 splits of 256 tokens, batch 64 -> no split.
    assert choose_num_splits(1, 8, 2048, 132) == 8
    assert choose_num_splits(64, 8, 2048, 132) == 1
    assert choose_num_splits(4, 8, 100_000, 132) == 9  # ceil(264 / 32) programs per (seq, head)
    assert choose_num_splits(1, 1, 10**7, 132) == 64  # capped
    assert choose_num_splits(3, 2, 100, 132) == 1  # short contexts never split


PREFILL_CASES = [  # (block_size, head_dim, num_q_heads, num_kv_heads)
    (16, 64, 4, 4),
    (8, 128, 6, 2),
    (16, 64, 8, 1),
    (12, 128, 3, 1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size,head_dim,num_q_heads,num_kv_heads", PREFILL_CASES)
def test_prefill_matches_reference(block_size, head_dim, num_q_heads, num_kv_heads, dtype):
    g = _rng("prefill", block_size, head_dim, num_q_heads, num_kv_heads, dtype)
    # (context, chunk): whole prompts of 1 and a non-multiple of the block size, a one-token chunk after a cached
    # prefix, a chunk starting mid-block, and a 130-token chunk spanning three query tiles after a prefix.
    seqs = [(1, 1), (block_size + 5, block_size + 5), (40, 1), (2 * block_size + 9, block_size + 2), (150, 130)]
    k_cache, v_cache, tables, ctx = _paged_kv([c for c, _ in seqs], block_size, num_kv_heads, head_dim, dtype, g)
    q_lens = [q for _, q in seqs]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    scale = head_dim ** -0.5
    out = _ops().prefill_attention(query, k_cache, v_cache, cu, ctx, tables, scale, max_query_len=max(q_lens))
    expected = ref.prefill_attention(query, k_cache, v_cache, cu, ctx, tables, scale)
    assert out.shape == expected.shape and out.dtype == dtype
    assert _rel_err(out, expected) < TOL[dtype]


@pytest.mark.parametrize("config", [PrefillConfig(64, 64, 4, 3, True), PrefillConfig(128, 32, 8, 2, True),
                                    PrefillConfig(128, 128, 8, 3, False), PrefillConfig(32, 32, 4, 3, True)],
                         ids=lambda c: f"m{c.block_m}n{c.block_n}w{c.num_warps}s{c.num_stages}split{int(c.split_mask)}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefill_launch_shapes_match_reference(config, dtype):
    """Every launch shape computes the same function, the unmasked whole tiles of SPLIT_MASK included: chunks
    after prefixes that do and do not end on a tile edge (126 = a tile edge - 2 for tiles of 32, 64 and 128 keys:
    one unmasked key too many shows), and chunks shorter and longer than one query tile."""
    if DEVICE == "cuda" and dtype == torch.float32 and config.block_m * config.block_n > 64 * 64:
        pytest.skip("fp32 tiles this large exceed the GPU's shared memory")
    from pdserve_server.kernels.triton_prefill import prefill_attention
    g = _rng("prefill-config", config, dtype)
    seqs = [(1, 1), (64, 64), (200, 3), (128 + 77, 77), (126 + 70, 70), (300, 140), (96 + 129, 129)]  # (ctx, chunk)
    k_cache, v_cache, tables, ctx = _paged_kv([c for c, _ in seqs], 16, 2, 64, dtype, g)
    q_lens = [q for _, q in seqs]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    query = torch.randn(sum(q_lens), 4, 64, generator=g).to(dtype).to(DEVICE)
    out = prefill_attention(query, k_cache, v_cache, cu, ctx, tables, 0.125, max(q_lens), config=config)
    expected = ref.prefill_attention(query, k_cache, v_cache, cu, ctx, tables, 0.125)
    assert _rel_err(out, expected) < TOL[dtype]


def test_prefill_without_max_query_len_reads_it_from_cu_seqlens():
    g = _rng("prefill-nohint")
    k_cache, v_cache, tables, ctx = _paged_kv([70, 3], 16, 2, 64, torch.float32, g)
    cu = torch.tensor([0, 70, 72], dtype=torch.int32, device=DEVICE)
    query = torch.randn(72, 4, 64, generator=g).to(DEVICE)
    out = _ops().prefill_attention(query, k_cache, v_cache, cu, ctx, tables, 0.125)
    expected = ref.prefill_attention(query, k_cache, v_cache, cu, ctx, tables, 0.125)
    assert _rel_err(out, expected) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 2, 64), (8, 8, 128), (5, 3, 64)])
def test_write_kv_cache_matches_reference(block_size, num_kv_heads, head_dim, dtype):
    g = _rng("write", block_size, num_kv_heads, head_dim, dtype)
    num_blocks, num_tokens = 12, 23
    kv = torch.randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    expected = kv.clone()
    # key/value as slices of a fused qkv output: dim 0 strided, heads dense
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=g).to(dtype).to(DEVICE)
    key = qkv[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 2 * num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(DEVICE)
    write_kv_cache(key, value, kv[:, 0, 0], kv[:, 0, 1], slots)
    ref.write_kv_cache(key, value, expected[:, 0, 0], expected[:, 0, 1], slots)
    assert torch.equal(kv, expected)  # the written slots match and nothing else (e.g. layer 1) changed


def test_rotary_and_write_kv_is_the_reference_with_the_triton_write():
    g = _rng("rope-write")
    num_tokens, heads, kv_heads, head_dim, block_size = 5, 4, 2, 16, 4
    kv = torch.randn(6, 2, block_size, kv_heads, head_dim, generator=g).to(DEVICE)
    expected = kv.clone()
    qkv = torch.randn(num_tokens, heads + 2 * kv_heads, head_dim, generator=g).to(DEVICE)
    angles = torch.rand(num_tokens, 1, head_dim, generator=g).to(DEVICE)
    slots = torch.randperm(6 * block_size, generator=g)[:num_tokens].to(DEVICE)
    q = _ops().rotary_and_write_kv(qkv, angles.cos(), angles.sin(), kv[:, 0], kv[:, 1], slots)
    expected_q = ref.rotary_and_write_kv(qkv, angles.cos(), angles.sin(), expected[:, 0], expected[:, 1], slots)
    assert torch.equal(q, expected_q) and torch.equal(kv, expected)


def _decode_args(**over):
    g = _rng("bad")
    k_cache, v_cache, tables, ctx = _paged_kv([5, 9], 4, 2, 16, torch.float32, g)
    args = dict(query=torch.randn(2, 4, 16, generator=g).to(DEVICE), k_cache=k_cache, v_cache=v_cache,
                block_tables=tables, context_lens=ctx, scale=0.25)
    args.update(over)
    return args


@pytest.mark.parametrize("bad,message", [
    (lambda a: {"query": a["query"][:, :3]}, "not a multiple of num_kv_heads"),
    (lambda a: {"query": a["query"].to(torch.bfloat16)}, "k_cache must have dtype"),
    (lambda a: {"query": a["query"][..., :8]}, "query head_dim 8 != cache head_dim 16"),
    (lambda a: {"query": a["query"].transpose(1, 2).contiguous().transpose(1, 2)}, "contiguous in its last dim"),
    (lambda a: {"block_tables": a["block_tables"].long()}, "block_tables must have dtype"),
    (lambda a: {"context_lens": a["context_lens"][:1]}, "context_lens shape (1,) != num_seqs 2"),
    (lambda a: {"k_cache": a["k_cache"][..., 0, :]}, "k_cache must have 4 dims, got shape"),
    (lambda a: {"v_cache": a["v_cache"][:3]}, "!= v_cache shape"),
])
def test_decode_wrapper_rejects_bad_arguments_with_shapes(bad, message):
    args = _decode_args()
    args.update(bad(args))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _ops().paged_decode_attention(**args)


def test_prefill_and_write_wrappers_reject_bad_arguments():
    a = _decode_args()
    ops = _ops()
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="cu_seqlens_q must have dtype"):
        ops.prefill_attention(a["query"], a["k_cache"], a["v_cache"], cu.long(), a["context_lens"],
                              a["block_tables"], 0.25)
    with pytest.raises(ValueError, match=r"block_tables shape \(2, 3\) != num_seqs 1"):
        ops.prefill_attention(a["query"], a["k_cache"], a["v_cache"], cu[:2], a["context_lens"],
                              a["block_tables"], 0.25)
    key = torch.randn(3, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"slot_mapping shape \(2,\) != num_tokens 3"):
        write_kv_cache(key, key, a["k_cache"], a["v_cache"], torch.zeros(2, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match=r"key shape \(3, 1, 16\) does not match"):
        write_kv_cache(key[:, :1], key[:, :1], a["k_cache"], a["v_cache"],
                           torch.zeros(3, dtype=torch.long, device=DEVICE))


def test_select_ops():
    assert select_ops("torch", "cpu").name == "torch"
    assert select_ops("auto", "cpu").name == "cpu"  # the C decode kernel (tests/kernels/test_kernels_cpu.py)
    assert select_ops("triton", DEVICE).name == "triton"
    with pytest.raises(ValueError, match="attention backend must be one of"):
        select_ops("flash", "cpu")
