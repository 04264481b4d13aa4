"""The C kernels (`kernels/cpu_ops.py`, the compiled `kernels/_C`) against the torch reference, in every ISA build of
them that this CPU runs (the `kernels` fixture, tests/kernels/kernel_builds.py); the builds it cannot run are compiled
all the same (tests/kernels/test_kernels_extension.py)."""
import pytest
import torch

from pdserve_server.kernels import reference
from pdserve_server.kernels.cpu_ops import cpu_isa
from kernel_builds import kernels  # noqa: F401 (a fixture)


def _paged(lengths, block_size, hkv, d, dtype, layers=3, layer=1, seed=0):
    """Random K/V in a cache holding `layers` layers (a worker's layout), returning `layer`'s strided views, a
    block table over scattered block ids padded with 0, and the context lengths."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lengths) + 5
    cache = torch.randn(num_blocks, layers, 2, block_size, hkv, d, generator=g).to(dtype)
    k_cache, v_cache = cache[:, layer, 0], cache[:, layer, 1]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-n // block_size) for n in lengths) + 2  # wider than needed: padding must not be read
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    for i, n in enumerate(lengths):
        ids = [perm.pop() for _ in range(-(-n // block_size))]
        table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return k_cache, v_cache, table, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,hq,hkv,d", [(16, 9, 3, 64), (8, 8, 1, 128), (4, 4, 4, 16), (32, 16, 2, 64),
                                                 (4, 4, 4, 64), (12, 16, 2, 128), (8, 16, 1, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_matches_reference(kernels, dtype, block_size, hq, hkv, d, threads):
    """Against the torch reference. The intrinsics paths (head_dim 64, 128) see blocks shorter than their chunk of
    tokens (4) and not a multiple of it (12), GQA groups of 1, 8 and 16 (the most a work item holds)."""
    lengths = [1, 3, block_size, block_size + 1, 5 * block_size - 1, 70]
    k_cache, v_cache, table, lens = _paged(lengths, block_size, hkv, d, dtype)
    # q as the model passes it: a view of the fused q/k/v rows, sequences (hq + 2 hkv) * d elements apart
    q = torch.randn(len(lengths), hq + 2 * hkv, d).to(dtype)[:, :hq]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, d ** -0.5)
    finally:
        torch.set_num_threads(old)
    ref = reference.paged_decode_attention(q, k_cache, v_cache, table, lens, d ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    # fp32: equal up to summation order; bf16: both compute in fp32 and round once, so at most one bf16 step
    tol = dict(rtol=1e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, ref, **tol)


def _poison_before(k_cache, v_cache, table, starts, block_size):
    """NaN into sequence i's K and V at every position before starts[i] (keys outside all its rows' windows): a
    kernel that read them rather than starting at the window would return NaN (a probability 0 times NaN)."""
    for i, start in enumerate(starts):
        pos = torch.arange(start)
        blocks = table[i].long()[pos // block_size]
        k_cache[blocks, pos % block_size] = float("nan")
        v_cache[blocks, pos % block_size] = float("nan")


# Sliding windows: 1 (the query's token only), starting inside a block (5, 37: no multiple of the block sizes here),
# exactly one block (16), and wider than every context (1000: full attention).
WINDOWS = [1, 5, 16, 37, 1000]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,hq,hkv,d", [(16, 9, 3, 64), (8, 8, 1, 128), (4, 4, 4, 16), (12, 16, 2, 128)])
def test_decode_with_sliding_window_matches_reference(kernels, dtype, block_size, hq, hkv, d, window):
    """Against the reference with the same window, on 2 threads. Keys before each window are NaN: the kernel must
    not read their blocks. Where the window is shorter than the context, full attention is far off (so a kernel
    that ignored the window could not pass)."""
    lengths = [1, 3, block_size, block_size + 1, 5 * block_size - 1, 70]
    k_cache, v_cache, table, lens = _paged(lengths, block_size, hkv, d, dtype, seed=window)
    q = torch.randn(len(lengths), hq + 2 * hkv, d, generator=torch.Generator().manual_seed(d)).to(dtype)[:, :hq]
    ref = reference.paged_decode_attention(q, k_cache, v_cache, table, lens, d ** -0.5, sliding_window=window)
    full = reference.paged_decode_attention(q, k_cache, v_cache, table, lens, d ** -0.5)
    _poison_before(k_cache, v_cache, table, [max(0, n - window) for n in lengths], block_size)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, d ** -0.5, sliding_window=window)
    finally:
        torch.set_num_threads(old)
    assert out.dtype == dtype and out.shape == q.shape
    tol = dict(rtol=1e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, ref, **tol)
    for i, n in enumerate(lengths):
        if window < n:
            assert (full[i].float() - ref[i].float()).abs().max() > 0.1, (n, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths,window", [([1000], 0), ([1000], 300), ([1, 37, 300], 0), ([7], 0)])
def test_decode_of_few_sequences_splits_their_keys_with_the_same_bits_on_any_thread_count(kernels, dtype, lengths,
                                                                                          window):
    """Fewer than 16 (sequence, kv head) items (a batch of 1-5 of SmolLM2's 3 kv heads) split each item's keys in
    ranges merged after (cpu_decode.c, paged_decode_attention_for): the reference's result, from a window's middle
    too (keys before it NaN), and the same bits on 1 and 2 threads (the split follows the batch, not the threads)."""
    block_size, hq, hkv, d = 16, 9, 3, 64
    k_cache, v_cache, table, lens = _paged(lengths, block_size, hkv, d, dtype, seed=len(lengths))
    q = torch.randn(len(lengths), hq + 2 * hkv, d, generator=torch.Generator().manual_seed(1)).to(dtype)[:, :hq]
    ref = reference.paged_decode_attention(q, k_cache, v_cache, table, lens, d ** -0.5, sliding_window=window)
    if window:
        _poison_before(k_cache, v_cache, table, [max(0, n - window) for n in lengths], block_size)
    old = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, d ** -0.5,
                                                       sliding_window=window))
    finally:
        torch.set_num_threads(old)
    tol = dict(rtol=1e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(outs[1], ref, **tol)
    assert torch.equal(outs[0], outs[1])


def test_decode_with_a_window_reads_and_checks_only_the_windows_blocks(kernels):
    """Blocks before the window are neither read nor checked (an engine may leave their table entries stale);
    the window's own blocks still are."""
    k_cache, v_cache, table, lens = _paged([5, 20], 8, 1, 16, torch.float32)
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))
    expected = reference.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.25, sliding_window=6)
    stale = table.clone()
    stale[1, 0] = -1  # sequence 1's positions 0-7; a window of 6 over its 20 tokens starts at 14
    torch.testing.assert_close(kernels.paged_decode_attention(q, k_cache, v_cache, stale, lens, 0.25,
                                                              sliding_window=6), expected, rtol=1e-5, atol=2e-6)
    with pytest.raises(ValueError, match="sequence 1: .* outside the cache"):  # a window of 13 starts at 7
        kernels.paged_decode_attention(q, k_cache, v_cache, stale, lens, 0.25, sliding_window=13)
    with pytest.raises(ValueError, match="sliding_window must be"):
        kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.25, sliding_window=-2)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softmax", ["torch", "c"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_blocked_prefill_with_sliding_window_matches_reference(kernels, softmax, dtype, window):
    """kernels.cpu_prefill with a window, its torch softmax and the C one, against the reference: query blocks wider
    and narrower than the window, chunks whose windows reach back into the cached prefix, with the 16-bit path's
    bound of test_blocked_prefill_matches_reference. 16-bit: keys before the chunk's first window are NaN, so the
    blocks before it must not enter the products (fp32 is the reference itself, whose SDPA reads every key)."""
    from pdserve_server.kernels.cpu_prefill import prefill_attention

    block_size, hq, hkv, d = 16, 9, 3, 64
    seqs = [(1, 1), (17, 17), (200, 3), (333 + 70, 70), (130, 130), (64 + 200, 200)]  # (ctx, chunk)
    k_cache, v_cache, table, lens = _paged([c for c, _ in seqs], block_size, hkv, d, dtype, seed=window)
    q_lens = [q for _, q in seqs]
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(d)).to(dtype)
    ref = reference.prefill_attention(q, k_cache, v_cache, cu, lens, table, d ** -0.5, sliding_window=window)
    full = reference.prefill_attention(q, k_cache, v_cache, cu, lens, table, d ** -0.5)
    if dtype != torch.float32:
        _poison_before(k_cache, v_cache, table, [max(0, c - n - window + 1) for c, n in seqs], block_size)
    if softmax == "c":
        out = kernels.prefill_attention(q, k_cache, v_cache, cu, lens, table, d ** -0.5, sliding_window=window)
    else:
        out = prefill_attention(q, k_cache, v_cache, cu, lens, table, d ** -0.5, sliding_window=window)
    assert out.dtype == dtype and out.shape == q.shape
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):  # every sequence, not just the sum
        if dtype == torch.float32:
            assert torch.equal(out[s:e], ref[s:e])
        else:
            err = float((out[s:e].double() - ref[s:e].double()).norm() / ref[s:e].double().norm())
            assert err < (1e-2 if dtype == torch.bfloat16 else 2e-3), (i, seqs[i], err)
        if window < seqs[i][0]:  # the chunk's last row loses keys to the window
            assert (full[e - 1].float() - ref[e - 1].float()).abs().max() > 0.1, (seqs[i], window)


def test_large_scores_do_not_overflow(kernels):
    """The online softmax subtracts the running max: scores of +-1e4 stay finite and match the reference.

    q and K hold integers up to 100 and the scale is a power of four (SDPA may apply its square root to q and to
    K), so every score is exact in fp32 whatever the summation order (partial sums stay far below 2**24). With
    random reals the scores would carry rounding errors of ~1e-3 at this size, and where two scores lie that close
    the probabilities of two correct kernels could differ by as much (a CI run failed so, 1e-3 against 1e-4)."""
    g = torch.Generator().manual_seed(1)
    for d in (32, 64):  # the plain loops, and the AVX-512 or AVX2 path where the build has it
        k_cache, v_cache, table, lens = _paged([40, 9], 16, 2, d, torch.float32)
        k_cache.copy_(torch.randint(-100, 101, k_cache.shape, generator=g))
        q = torch.randint(-100, 101, (2, 4, d), generator=g).float()
        out = kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.25)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, reference.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.25),
                                   rtol=1e-4, atol=1e-4)


def test_unsupported_shapes_use_the_reference_and_bad_input_is_a_value_error(kernels):
    k_cache, v_cache, table, lens = _paged([5, 20], 8, 1, 16, torch.float16)
    q = torch.randn(2, 20, 16).to(torch.float16)  # fp16 and a group of 20: the reference's path
    torch.testing.assert_close(kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.25),
                               reference.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.25))
    k_big, v_big, t_big, l_big = _paged([70, 200], 128, 2, 16, torch.float32)  # blocks over the kernel's 64 tokens
    q_big = torch.randn(2, 4, 16)
    torch.testing.assert_close(kernels.paged_decode_attention(q_big, k_big, v_big, t_big, l_big, 0.25),
                               reference.paged_decode_attention(q_big, k_big, v_big, t_big, l_big, 0.25))
    with pytest.raises(ValueError, match="v_cache dtype torch.float32 != k_cache dtype torch.float16"):
        kernels.paged_decode_attention(q, k_cache, v_cache.float(), table, lens, 0.25)
    # an fp32 query reads a 16-bit cache widened (--kv-cache-dtype), in the reference here (a group of 20)
    torch.testing.assert_close(kernels.paged_decode_attention(q.float(), k_cache, v_cache, table, lens, 0.25),
                               reference.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), table,
                                                                lens, 0.25))
    with pytest.raises(ValueError, match="block_tables"):
        kernels.paged_decode_attention(q, k_cache, v_cache, table.long(), lens, 0.25)
    k32, v32, t32, l32 = _paged([5, 20], 8, 1, 16, torch.float32)
    q32 = torch.randn(2, 4, 16)
    with pytest.raises(ValueError, match="sequence 1: .* more blocks than the row has"):  # C would read past it
        kernels.paged_decode_attention(q32, k32, v32, t32[:, :2], l32, 0.25)
    outside = t32.clone()
    outside[0, 0] = k32.shape[0]  # one past the last block
    with pytest.raises(ValueError, match="sequence 0: .* outside the cache"):
        kernels.paged_decode_attention(q32, k32, v32, outside, l32, 0.25)
    outside[0, 0] = -1
    with pytest.raises(ValueError, match="sequence 0: .* outside the cache"):
        kernels.paged_decode_attention(q32, k32, v32, outside, l32, 0.25)
    unused = t32.clone()
    unused[0, 1:] = 10 ** 6  # past sequence 0's 5 tokens: padding, never read
    torch.testing.assert_close(kernels.paged_decode_attention(q32, k32, v32, unused, l32, 0.25),
                               reference.paged_decode_attention(q32, k32, v32, t32, l32, 0.25))


# The per-token ops of cpu_layer_ops.c. bf16: the C code rounds where the reference does, so results are equal but for
# the RMS's sum of squares (reassociated) and libm's expf (an ulp from torch's); fp32 differs in the last bits.
def _bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values apart a and b are, per element (both bf16, same sign region)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 576), (5, 64), (33, 576)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(kernels, dtype, rows, dim, with_residual):
    g = torch.Generator().manual_seed(rows * dim)
    wide = (torch.randn(rows, dim + 32, generator=g) * 3).to(dtype)
    x = wide[:, 16:16 + dim]  # rows strided, as a slice of a wider activation
    weight = torch.randn(dim, generator=g).to(dtype)
    residual = torch.randn(rows, dim, generator=g).to(dtype) if with_residual else None
    ours_res, ref_res = (None, None) if residual is None else (residual.clone(), residual.clone())
    ours = kernels.rms_norm(x, weight, 1e-5, ours_res)
    ref = reference.rms_norm(x, weight, 1e-5, ref_res)
    assert ours.shape == (rows, dim) and ours.dtype == dtype
    if with_residual:
        assert torch.equal(ours_res, ref_res)  # the residual add rounds once, as torch's add_
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    else:
        steps = _bf16_steps(ours, ref)
        assert int(steps.max()) <= 1 and float((steps == 0).float().mean()) >= 0.98


def _qkv_and_cache(tokens, dtype, seed):
    """A fused q/k/v projection's output per head ([tokens, 9 + 2 * 3, 64], SmolLM2's heads, rows strided as a slice
    of a wider activation), RoPE rows for it, and a per-layer view of a cache holding 3 layers."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, d = 9, 3, 64
    wide = torch.randn(tokens, (heads + 2 * kv_heads + 1) * d, generator=g).to(dtype)
    qkv = wide[:, :(heads + 2 * kv_heads) * d].view(tokens, heads + 2 * kv_heads, d)
    angles = torch.rand(tokens, 1, d, generator=g) * 6.28
    k_cache, v_cache, _, _ = _paged([max(tokens, 40)], 16, kv_heads, d, dtype)
    return qkv, angles.cos().to(dtype), angles.sin().to(dtype), k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 33])  # 33: RoPE split over threads (16 tokens or more)
def test_rotary_and_write_kv_rotates_in_place_and_writes_as_the_reference(kernels, dtype, tokens):
    qkv, cos, sin, k_cache, v_cache = _qkv_and_cache(tokens, dtype, tokens)
    slots = torch.randperm(k_cache.shape[0] * 16, generator=torch.Generator().manual_seed(tokens))[:tokens]
    ref_qkv, ref_k, ref_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    ref_q = reference.rotary_and_write_kv(ref_qkv, cos, sin, ref_k, ref_v, slots)
    v_before = qkv[:, 12:].clone()
    q = kernels.rotary_and_write_kv(qkv, cos, sin, k_cache, v_cache, slots)
    assert q.shape == (tokens, 9, 64) and q.data_ptr() == qkv.data_ptr()  # the q heads, rotated in place
    assert torch.equal(qkv[:, 12:], v_before)  # v is not rotated
    assert torch.equal(v_cache, ref_v)
    if dtype == torch.float32:
        torch.testing.assert_close(q, ref_q, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(k_cache, ref_k, rtol=1e-6, atol=1e-6)
    else:  # the same roundings in the same order
        assert torch.equal(q, ref_q) and torch.equal(k_cache, ref_k)
    assert torch.equal(k_cache.reshape(-1, 3, 64)[slots], qkv[:, 9:12])  # the rotated k heads are what was written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 20])
def test_silu_and_mul_matches_reference(kernels, dtype, rows):
    gate_up = (torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)
    ours, ref = kernels.silu_and_mul(gate_up), reference.silu_and_mul(gate_up)
    assert ours.shape == (rows, 1536) and ours.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    else:
        # silu one bf16 step apart (a value within an ulp of a rounding midpoint), then the product rounds again
        steps = _bf16_steps(ours, ref)
        assert int(steps.max()) <= 2 and float((steps == 0).float().mean()) >= 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_write_kv_refuses_slots_outside_the_cache(kernels, dtype):
    qkv, cos, sin, k_cache, v_cache = _qkv_and_cache(2, dtype, 0)
    before = qkv.clone(), k_cache.clone(), v_cache.clone()
    for slot in (k_cache.shape[0] * 16, -1):
        with pytest.raises(ValueError, match=f"slot {slot} of token 1 is outside the KV cache"):
            kernels.rotary_and_write_kv(qkv, cos, sin, k_cache, v_cache, torch.tensor([1, slot]))
        assert all(torch.equal(a, b) for a, b in zip((qkv, k_cache, v_cache), before))  # nothing changed


def test_layer_ops_take_the_reference_for_what_the_c_code_does_not_read(kernels):
    x = torch.randn(3, 64).half()
    torch.testing.assert_close(kernels.rms_norm(x, torch.ones(64).half(), 1e-5),
                               reference.rms_norm(x, torch.ones(64).half(), 1e-5))
    gate_up = torch.randn(2, 8).half()
    assert torch.equal(kernels.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))
    qkv, cos, sin, k_cache, v_cache = _qkv_and_cache(3, torch.float16, 1)
    slots = torch.tensor([5, 0, 17])
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    assert torch.equal(kernels.rotary_and_write_kv(qkv.clone(), cos, sin, k_cache, v_cache, slots),
                       reference.rotary_and_write_kv(qkv, cos, sin, ref_k, ref_v, slots))
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("softmax", ["torch", "c"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("block_size,hq,hkv,d", [(16, 9, 3, 64), (8, 8, 1, 128)])
def test_blocked_prefill_matches_reference(kernels, softmax, dtype, block_size, hq, hkv, d):
    """kernels.cpu_prefill against the reference's SDPA, with its torch softmax and with the C one (the cpu
    backend's prefill) in each build: chunks of 1 token, shorter and longer than one query block, whole prompts and
    chunks after cached prefixes that do and do not end on a block edge.
    16-bit: the scores are rounded to the cache dtype once (HF eager's numerics), so the bound is a few roundings
    (seen: bf16 4-5e-3, relative Frobenius); one visible key masked wrongly moves rows by far more. fp32: the torch
    path is the reference itself; the backend's is the C kernel (fp32 reassociation)."""
    from pdserve_server.kernels.cpu_prefill import prefill_attention

    seqs = [(1, 1), (17, 17), (200, 3), (333 + 70, 70), (130, 130), (65 + 65, 65), (64 + 200, 200)]  # (ctx, chunk)
    k_cache, v_cache, table, lens = _paged([c for c, _ in seqs], block_size, hkv, d, dtype, seed=hq)
    q_lens = [q for _, q in seqs]
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(d)).to(dtype)
    attend = kernels.prefill_attention if softmax == "c" else prefill_attention
    out = attend(q, k_cache, v_cache, cu, lens, table, d ** -0.5)
    ref = reference.prefill_attention(q, k_cache, v_cache, cu, lens, table, d ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    if dtype == torch.float32 and softmax == "torch":
        assert torch.equal(out, ref)
        return
    bound = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):  # every sequence, not just the sum
        err = float((out[s:e].double() - ref[s:e].double()).norm() / ref[s:e].double().norm())
        assert err < bound, (i, seqs[i], err)


@pytest.mark.parametrize("rows,end", [(1, 1), (5, 5), (64, 300), (128, 128), (7, 4000)])
def test_c_causal_softmax_matches_torch(kernels, rows, end):
    """The C softmax against `cpu_prefill.causal_softmax` on the same bf16 scores (3 stacked heads of `rows`
    rows): within one bf16 step of each probability (expf and the sum's order may differ by an ulp), exact zeros
    where a row must not see, rows summing to 1, and large scores without overflow."""
    from pdserve_server.kernels.cpu_prefill import causal_softmax

    g = torch.Generator().manual_seed(rows * end)
    scores = (torch.randn(3, rows, end, generator=g) * 30).to(torch.bfloat16)
    expected = causal_softmax(scores.clone(), rows, 0.125)
    out = kernels.causal_softmax(scores, rows, 0.125)
    assert out.data_ptr() == scores.data_ptr()  # in place
    torch.testing.assert_close(out.float(), expected.float(), rtol=8e-3, atol=1e-6)
    hidden = torch.ones(rows, end, dtype=torch.bool).triu_(end - rows + 1)
    assert (out[:, hidden] == 0).all() and (out[:, ~hidden] > 0).any()
    torch.testing.assert_close(out.float().sum(-1), torch.ones(3, rows), atol=2e-2, rtol=0)


@pytest.mark.parametrize("rows,end,window_start", [(1, 9, 0), (5, 5, 0), (5, 12, -2), (64, 300, 0), (128, 200, -70)])
def test_c_causal_softmax_with_a_window_matches_torch(kernels, rows, end, window_start):
    """With a sliding window's `window_start` (row r sees columns window_start + r to end - rows + r): the C
    softmax (keys left of the windows pre-filled with a finite floor) against the torch one, exact zeros outside
    each row's window, probabilities inside it, rows summing to 1."""
    from pdserve_server.kernels.cpu_prefill import causal_softmax

    g = torch.Generator().manual_seed(rows * end)
    scores = (torch.randn(3, rows, end, generator=g) * 30).to(torch.bfloat16)
    expected = causal_softmax(scores.clone(), rows, 0.125, window_start)
    out = kernels.causal_softmax(scores, rows, 0.125, window_start)
    assert out.data_ptr() == scores.data_ptr()  # in place
    torch.testing.assert_close(out.float(), expected.float(), rtol=8e-3, atol=1e-6)
    col, row = torch.arange(end)[None, :], torch.arange(rows)[:, None]
    hidden = (col > end - rows + row) | (col < window_start + row)
    assert (out[:, hidden] == 0).all() and (out[:, ~hidden] > 0).any()
    assert (expected[:, hidden] == 0).all()
    torch.testing.assert_close(out.float().sum(-1), torch.ones(3, rows), atol=2e-2, rtol=0)



@pytest.mark.parametrize("rows,out_features,in_features", [(1, 7, 3), (2, 1536, 576), (3, 576, 1536), (5, 13, 100),
                                                            (32, 64, 8), (0, 4, 8), (4, 6, 3), (6, 14, 100),
                                                            (7, 576, 1536), (17, 13, 37), (9, 11, 100)])
def test_small_batch_linear_matches_torch(kernels, rows, out_features, in_features):
    """fp32 x W^T (+ b) against F.linear: odd sizes take every tail of the tiles (2 rows x 4 features below 4 rows,
    4 x 3 from 4 rows on, 4 x 6 in the AVX-512 builds, then the last rows % 4 rows and the features past the last
    whole tile, up to 5 of them) and of the vector loop over K; x as a strided view (the rows of a wider tensor) is
    read in place."""
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    w, bias = torch.randn(out_features, in_features, generator=g), torch.randn(out_features, generator=g)
    wide = torch.randn(rows, in_features + 5, generator=g)
    for x in (wide[:, :in_features].contiguous(), wide[:, :in_features]):
        for b in (None, bias):
            ours = kernels.linear_small_m(x, w, b)
            assert ours.shape == (rows, out_features) and ours.dtype == torch.float32
            torch.testing.assert_close(ours, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_small_batch_linear_refuses_what_it_does_not_compute(kernels):
    with pytest.raises(ValueError, match="float32 x and weight, got BFloat16"):
        kernels.linear_small_m(torch.zeros(2, 8).bfloat16(), torch.zeros(4, 8).bfloat16(), None)
    with pytest.raises(ValueError, match=r"x \[M, K\] and weight \[N, K\]"):
        kernels.linear_small_m(torch.zeros(2, 8), torch.zeros(4, 9), None)
    with pytest.raises(ValueError, match="bias must be"):
        kernels.linear_small_m(torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(3))


def _pack_bf16(w: torch.Tensor, padded_k: int) -> torch.Tensor:
    """w [N, K] bf16 in the packed layout kernels/cpu_linear.c reads (oneDNN's for bf16 linear weights, as far as
    measured): blocks of 64 output features, N zero-padded to whole blocks; within a block the K pairs in order, each
    [64 features][2 consecutive k]; K zero-padded to padded_k."""
    n, k = w.shape
    blocks = -(-n // 64)
    full = torch.zeros(blocks * 64, padded_k, dtype=torch.bfloat16)
    full[:n, :k] = w
    # [blocks, 64, padded_k / 2, 2] -> [blocks, padded_k / 2, 64, 2]
    return full.view(blocks, 64, padded_k // 2, 2).permute(0, 2, 1, 3).contiguous()


@pytest.mark.parametrize("rows,out_features,in_features,padded_k", [
    (1, 576, 576, 576), (3, 960, 576, 576), (5, 100, 64, 64), (9, 200, 70, 96), (4, 16, 32, 32)])
def test_packed_bf16_linear_matches_torch(kernels, rows, out_features, in_features, padded_k):
    """The packed-layout kernel on a buffer packed here, not by oneDNN (the kernel's own contract): x W^T + b within
    bf16 rounding of torch's, with and without bias, rows through 1-4-row tiles (5, 9 rows), a last block of
    padded features (100, 200), K padded past the input (70 in 96), strided x rows; the same bits at 1 and 2 threads
    (each output is one thread's sum)."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16()
    packed = _pack_bf16(w, padded_k)
    wide = torch.randn(rows, in_features + 6, generator=g).bfloat16()
    threads = torch.get_num_threads()
    for x in (wide[:, :in_features].contiguous(), wide[:, :in_features]):
        for b in (None, bias):
            ours = kernels.linear_packed_bf16(x, packed.data_ptr(), out_features, padded_k, b)
            assert ours.shape == (rows, out_features) and ours.dtype == torch.bfloat16
            want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
            torch.testing.assert_close(ours.float(), want, rtol=1e-2, atol=2e-2)
            torch.set_num_threads(1)
            try:
                assert torch.equal(kernels.linear_packed_bf16(x, packed.data_ptr(), out_features, padded_k, b), ours)
            finally:
                torch.set_num_threads(threads)


def test_packed_bf16_linear_refuses_what_it_does_not_compute(kernels):
    x = torch.zeros(2, 8).bfloat16()
    with pytest.raises(ValueError, match=r"takes x \[M, K\] bfloat16"):
        kernels.linear_packed_bf16(x.float(), 1, 4, 8, None)
    with pytest.raises(ValueError, match="does not take x of 8 features"):
        kernels.linear_packed_bf16(x, 1, 4, 6, None)  # padded width narrower than the input
    with pytest.raises(ValueError, match="does not take x of 7 features"):
        kernels.linear_packed_bf16(torch.zeros(2, 7).bfloat16(), 1, 4, 8, None)  # odd K
    with pytest.raises(ValueError, match="bias must be"):
        kernels.linear_packed_bf16(x, 1, 4, 8, torch.zeros(3).bfloat16())


def test_prefill_attention_in_c_where_the_build_has_avx512_bf16(kernels):
    """`pdserve::prefill_attention` (kernels/cpu_prefill_attention.c) computes bf16 in the avx512_bf16 build, within
    bf16 rounding of the reference (chunks of 1 to 40 tokens after prefixes, GQA groups of 4, head_dim 64 and 128;
    test_blocked_prefill_matches_reference runs it on longer chunks through the backend's prefill), refuses tables
    it would read outside of, and returns None from the other builds (the backend then runs the blocked GEMMs)."""
    op = torch.ops.pdserve.prefill_attention.default
    for d in (64, 128):
        seqs = [(1, 1), (40, 40), (23 + 5, 5), (100 + 16, 16)]  # (ctx, chunk)
        k_cache, v_cache, table, lens = _paged([c for c, _ in seqs], 16, 2, d, torch.bfloat16, seed=d)
        q_lens = [q for _, q in seqs]
        cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        q = torch.randn(sum(q_lens), 8, d, generator=torch.Generator().manual_seed(1)).bfloat16()
        out = op(q, k_cache, v_cache, cu, lens, table, d ** -0.5)
        if cpu_isa() != "avx512_bf16":
            assert out is None
            return
        ref = reference.prefill_attention(q, k_cache, v_cache, cu, lens, table, d ** -0.5)
        for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            err = float((out[s:e].double() - ref[s:e].double()).norm() / ref[s:e].double().norm())
            assert err < 1e-2, (d, seqs[i], err)
    _check_prefill_refusals(op, q, k_cache, v_cache, cu, lens, table, multiple=64)


def _check_prefill_refusals(op, q, k_cache, v_cache, cu, lens, table, multiple):
    """`pdserve::prefill_attention` on tables it would read outside of and on a head_dim it does not take: a
    ValueError naming the fault."""
    short = lens.clone()
    short[2] = int(cu[3] - cu[2]) - 1  # a context shorter than its chunk
    with pytest.raises(ValueError, match="longer than its context"):
        op(q, k_cache, v_cache, cu, short, table, 0.1)
    bad = table.clone()
    bad[1, 0] = k_cache.shape[0]
    with pytest.raises(ValueError, match="names a block outside"):
        op(q, k_cache, v_cache, cu, lens, bad, 0.1)
    d = multiple // 2
    with pytest.raises(ValueError, match=f"head_dim a multiple of {multiple}"):
        op(q[..., :d].contiguous(), k_cache[..., :d].contiguous(), v_cache[..., :d].contiguous(), cu, lens, table,
           0.1)


@pytest.mark.parametrize("d", [32, 64, 128])
def test_fp32_prefill_attention_in_c_matches_reference(kernels, d):
    """fp32 caches through `pdserve::prefill_attention` in every build (FMAs on vectors of the build's width): within
    fp32 reassociation of the reference's SDPA (1e-5 relative, each sequence) for chunks of 1 to 300 tokens, whole
    prompts and chunks after cached prefixes on and off block edges, more positions than one tile (16) and tails of
    rows and key groups, GQA groups of 4 and 1; the query a strided view of a fused qkv row (as the model passes it);
    the same bits at 1 and 2 threads (each row is one thread's sum); and the refusals of the bf16 path."""
    op = torch.ops.pdserve.prefill_attention.default
    seqs = [(1, 1), (40, 40), (23 + 5, 5), (100 + 16, 16), (300, 300), (64 + 33, 33)]  # (ctx, chunk)
    q_lens = [q for _, q in seqs]
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    threads = torch.get_num_threads()
    for hq, hkv in ((8, 2), (4, 4)):
        k_cache, v_cache, table, lens = _paged([c for c, _ in seqs], 16, hkv, d, torch.float32, seed=d + hq)
        fused = torch.randn(sum(q_lens), hq + 2 * hkv, d, generator=torch.Generator().manual_seed(hq))
        q = fused[:, :hq]  # tokens (hq + 2 hkv) * d apart, heads dense
        out = op(q, k_cache, v_cache, cu, lens, table, d ** -0.5)
        assert out.dtype == torch.float32 and out.shape == q.shape
        ref = reference.prefill_attention(q.contiguous(), k_cache, v_cache, cu, lens, table, d ** -0.5)
        for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            err = float((out[s:e].double() - ref[s:e].double()).norm() / ref[s:e].double().norm())
            assert err < 1e-5, (hq, hkv, seqs[i], err)
        torch.set_num_threads(1)
        try:
            assert torch.equal(op(q, k_cache, v_cache, cu, lens, table, d ** -0.5), out)
        finally:
            torch.set_num_threads(threads)
    _check_prefill_refusals(op, q, k_cache, v_cache, cu, lens, table, multiple=32)


def q4_1_weight(out_features: int, in_features: int, g: torch.Generator) -> torch.Tensor:
    """An fp32 [N, K] weight that is a Q4_1 tensor's dequantization, as llama.cpp's quantizer makes one: each block of
    32 along K is d * q + m with m = fp16(min), d = fp16((max - min) / 15), q = round((w - m) / d) in 0..15."""
    w = torch.randn(out_features, in_features // 32, 32, generator=g) * 0.05
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    m, d = low.half().float(), ((high - low) / 15).half().float()
    q = torch.round((w - m) / d).clamp(0, 15)
    return (d * q + m).reshape(out_features, in_features)


def q8_0_weight(out_features: int, in_features: int, g: torch.Generator) -> torch.Tensor:
    """An fp32 [N, K] weight that is a Q8_0 tensor's dequantization, as llama.cpp's quantizer makes one: each block of
    32 along K is d * q with d = fp16(amax / 127), q = round(w / d) in -127..127."""
    w = torch.randn(out_features, in_features // 32, 32, generator=g) * 0.05
    d = (w.abs().amax(-1, keepdim=True) / 127).half().float()
    return (d * torch.round(w / d).clamp(-127, 127)).reshape(out_features, in_features)


def _dequantized(qs: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] that GGUF blocks in the kernel's layout hold (engine.execution.packing.q4_1_blocks,
    q8_0_blocks)."""
    n = qs.shape[0]
    if qs.dtype == torch.int8:
        return (scales.float().unsqueeze(-1) * qs.view(n, -1, 32).float()).reshape(n, -1)
    halves = qs.view(n, -1, 2, 8)  # byte 8h + j: weights 16h + j (low nibble), 16h + 8 + j (high)
    q = torch.stack([halves & 15, halves >> 4], dim=-2).reshape(n, -1, 32).float()
    return (scales[..., :1].float() * q + scales[..., 1:].float()).reshape(n, -1)


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 16, 33, 64, 280])
@pytest.mark.parametrize("out_features,in_features", [(7, 64), (11, 64), (576, 576), (1536, 576), (96, 1536)])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_blocks_linear_sums_as_the_small_batch_kernel_on_the_dequantized_weight(kernels, rows, out_features,
                                                                               in_features, fmt):
    """A weight that is a dequantized Q4_1 or Q8_0 tensor, read as its blocks (`gguf_blocks`, `linear_blocks`): from 2
    rows the same bits as the fp32 small-batch kernel on the fp32 tensor, for every tile shape (rows below 4 and from
    4, tails of rows and features), except the avx2 build from 24 rows (panels of 16 features, each output summed in
    order of k: torch's result within fp32 reassociation, and a row's bits the same at any row count from 24, past 256
    rows too, where a call runs them in chunks); at 1 row
    (scales applied once a block, weights kept in registers) the same within fp32 reassociation; with and without
    bias, x contiguous or a strided view; the blocks reproduce the weight."""
    from pdserve_server.engine.execution.packing import gguf_blocks

    g = torch.Generator().manual_seed(rows * 7 + out_features)
    w = (q4_1_weight if fmt == "q4_1" else q8_0_weight)(out_features, in_features, g)
    blocks = gguf_blocks(w)
    assert blocks is not None
    qs, scales = blocks
    if fmt == "q4_1":
        assert qs.shape == (out_features, in_features // 2) and qs.dtype == torch.uint8
        assert scales.shape == (out_features, in_features // 32, 2) and scales.dtype == torch.float16
    else:
        assert qs.shape == (out_features, in_features) and qs.dtype == torch.int8
        assert scales.shape == (out_features, in_features // 32) and scales.dtype == torch.float16
    assert torch.equal(_dequantized(qs, scales), w)
    bias = torch.randn(out_features, generator=g)
    wide = torch.randn(rows, in_features + 5, generator=g)
    for x in (wide[:, :in_features].contiguous(), wide[:, :in_features]):
        for b in (None, bias):
            ours = kernels.linear_blocks(x, qs, scales, b)
            assert ours.shape == (rows, out_features) and ours.dtype == torch.float32
            if rows == 1:
                torch.testing.assert_close(ours, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
            elif rows >= 24 and cpu_isa() == "avx2":
                torch.testing.assert_close(ours, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
                assert torch.equal(kernels.linear_blocks(x[:24], qs, scales, b), ours[:24])
                # the last row in another place of its tile of 6
                assert torch.equal(kernels.linear_blocks(x[1:], qs, scales, b)[-1], ours[-1])
            else:
                assert torch.equal(ours, kernels.linear_small_m(x, w, b))


def _q8_reference(x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y [1, N] of linear_blocks's q8_activations arithmetic, from its definition (kernels/cpu_linear.c): x [1, K]
    quantized per block of 32 (d = max |x| / 127 in fp32, q = x / d rounded half to even), the blocks' integer dot
    products with q, each times d_w * d; Q4_1's minimum times the exact sum of x over the block. Summed in float64."""
    xb = x.view(-1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.round(xb * torch.where(d != 0, 1 / d, torch.zeros_like(d)))
    w_q = _dequantized(qs, torch.stack([torch.ones_like(scales[..., 0]), torch.zeros_like(scales[..., 0])], -1)
                       if qs.dtype == torch.uint8 else torch.ones_like(scales)).view(qs.shape[0], -1, 32)
    dots = (w_q.double() * q.double()).sum(-1)  # [N, K / 32], exact integers
    d_w = (scales[..., 0] if qs.dtype == torch.uint8 else scales).double()
    y = (dots * d_w * d.view(-1).double()).sum(-1)
    if qs.dtype == torch.uint8:
        y += (scales[..., 1].double() * xb.double().sum(-1)).sum(-1)
    return y.unsqueeze(0)


@pytest.mark.parametrize("out_features,in_features", [(7, 64), (576, 576), (96, 1536)])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_blocks_linear_with_8_bit_activations_computes_as_llama_cpp(kernels, out_features, in_features, fmt):
    """q8_activations (--quantization gguf): one row is quantized to 8 bits a block of 32 and multiplied in integers
    against the blocks: the result is that arithmetic's (`_q8_reference`, within fp32 summation), at least 10x
    nearer to it than to the exact product; a block of zeros in x is no division by zero; from 2 rows the flag
    changes nothing (the exact kernel's bits)."""
    from pdserve_server.engine.execution.packing import gguf_blocks

    g = torch.Generator().manual_seed(out_features)
    w = (q4_1_weight if fmt == "q4_1" else q8_0_weight)(out_features, in_features, g)
    qs, scales = gguf_blocks(w)
    bias = torch.randn(out_features, generator=g)
    x = torch.randn(1, in_features, generator=g)
    x[0, 32:64] = 0  # a block of zeros: its scale is 0
    ours = kernels.linear_blocks(x, qs, scales, bias, True)
    reference = (_q8_reference(x, qs, scales) + bias.double()).float()
    exact = torch.nn.functional.linear(x, w, bias)
    assert torch.isfinite(ours).all()
    off, off_exact = (ours - reference).norm(), (ours - exact).norm()
    assert off <= 1e-5 * reference.norm() and off * 10 <= off_exact
    rows = torch.randn(3, in_features, generator=g)
    assert torch.equal(kernels.linear_blocks(rows, qs, scales, bias, True), kernels.linear_blocks(rows, qs, scales,
                                                                                                   bias))


def test_gguf_blocks_are_found_only_where_every_weight_is_one():
    """`gguf_blocks` answers None for what it cannot hold exactly: a weight of another form (one weight off by an ulp
    is enough), K not a multiple of 32, another dtype, a scale past fp16's range; Q4_1 where a weight is both (fewer
    bytes); a block of equal weights is d = 0."""
    from pdserve_server.engine.execution.packing import gguf_blocks, q4_1_blocks, q8_0_blocks

    g = torch.Generator().manual_seed(0)
    for make, form in ((q4_1_weight, q4_1_blocks), (q8_0_weight, q8_0_blocks)):
        w = make(8, 64, g)
        assert form(w) is not None and gguf_blocks(w)[0].dtype == form(w)[0].dtype
        nudged = w.clone()
        nudged[3, 40] = torch.nextafter(nudged[3, 40], torch.tensor(1.0))
        assert form(nudged) is None and gguf_blocks(nudged) is None
        assert form(w[:, :48].contiguous()) is None
        assert form(w.bfloat16()) is None
        assert form(w * 1e6) is None
    assert gguf_blocks(torch.randn(8, 64, generator=g)) is None
    flat = torch.full((2, 32), 0.25)
    qs, dm = gguf_blocks(flat)
    assert qs.dtype == torch.uint8 and torch.equal(dm[..., 0], torch.zeros(2, 1, dtype=torch.float16))


def test_blocks_linear_refuses_what_it_does_not_compute(kernels):
    qs, dm = torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 2, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match="float32 x"):
        kernels.linear_blocks(torch.zeros(2, 64).bfloat16(), qs, dm, None)
    with pytest.raises(ValueError, match="K a multiple of 32"):
        kernels.linear_blocks(torch.zeros(2, 48), qs[:, :24].contiguous(), dm, None)
    with pytest.raises(ValueError, match=r"uint8 \(Q4_1\) or \[N, K\] int8 \(Q8_0\)"):
        kernels.linear_blocks(torch.zeros(2, 64), qs.short(), dm, None)
    with pytest.raises(ValueError, match=r"scales \[N, K / 32, 2\] float16"):
        kernels.linear_blocks(torch.zeros(2, 64), qs, dm.float(), None)
    with pytest.raises(ValueError, match=r"scales \[N, K / 32\] float16"):
        kernels.linear_blocks(torch.zeros(2, 64), torch.zeros(4, 64, dtype=torch.int8), dm, None)
    with pytest.raises(ValueError, match="bias must be"):
        kernels.linear_blocks(torch.zeros(2, 64), qs, dm, torch.zeros(3))


def test_gguf_blocks_are_checked_a_slice_of_rows_at_a_time_with_the_same_result():
    """A large LM head is checked in slices of rows (bounded temporaries): the blocks equal the whole tensor's at once,
    a ragged last slice included, and a bad weight in the last slice still refuses the whole tensor."""
    from pdserve_server.engine.execution.packing import _by_rows, _q4_1_rows, _q8_0_rows

    g = torch.Generator().manual_seed(3)
    for make, rows_form in ((q4_1_weight, _q4_1_rows), (q8_0_weight, _q8_0_rows)):
        w = make(100, 64, g)
        whole = _by_rows(w, rows_form, chunk_elements=1 << 30)
        sliced = _by_rows(w, rows_form, chunk_elements=64 * 7)  # 7 rows a slice: 14 slices and 2 rows
        assert whole is not None and all(torch.equal(a, b) for a, b in zip(whole, sliced))
        bad = w.clone()
        bad[99, 3] += 1.0
        assert _by_rows(bad, rows_form, chunk_elements=64 * 7) is None
