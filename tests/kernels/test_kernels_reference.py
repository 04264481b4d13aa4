"""The paged reference ops against dense attention computed without any paging."""
import pytest
import torch

from pdserve_server.kernels.reference import paged_decode_attention, prefill_attention, write_kv_cache


def _dense(q, k, v, q_pos, scale, window=0):
    """q: [Lq, Hq, D], k/v: [Lk, Hkv, D]; causal by absolute positions, and with a window W >= 1 the key at k hidden
    from the query at q where q - k >= W (HF transformers' sliding_window_overlay keeps kv_idx > q_idx - W)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    distance = q_pos[:, None] - torch.arange(k.shape[0])[None, :]
    mask = distance < 0
    if window:
        mask |= distance >= window
    s = s.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


def _paged(lengths, block_size, hkv, d, num_blocks=64):
    g = torch.Generator().manual_seed(0)
    k_cache = torch.zeros(num_blocks, block_size, hkv, d)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, non-contiguous block ids
    tables, dense = [], []
    for n in lengths:
        nb = -(-n // block_size)
        blocks = [perm.pop() for _ in range(nb)]
        k = torch.randn(n, hkv, d, generator=g)
        v = torch.randn(n, hkv, d, generator=g)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(n)])
        write_kv_cache(k, v, k_cache, v_cache, slots)
        tables.append(blocks)
        dense.append((k, v))
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(lengths), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return k_cache, v_cache, bt, dense


@pytest.mark.parametrize("block_size,hq,hkv", [(4, 4, 4), (16, 9, 3), (8, 8, 1)])
def test_decode_matches_dense(block_size, hq, hkv):
    lengths = [1, 5, 17, 33]
    d = 16
    k_cache, v_cache, bt, dense = _paged(lengths, block_size, hkv, d)
    q = torch.randn(len(lengths), hq, d)
    out = paged_decode_attention(q, k_cache, v_cache, bt, torch.tensor(lengths, dtype=torch.int32), d ** -0.5)
    for i, n in enumerate(lengths):
        k, v = dense[i]
        ref = _dense(q[i:i + 1], k, v, torch.tensor([n - 1]), d ** -0.5)
        torch.testing.assert_close(out[i:i + 1], ref, rtol=1e-5, atol=1e-5)


def test_prefill_chunk_over_cached_prefix_matches_dense():
    block_size, hq, hkv, d = 4, 6, 2, 8
    lengths = [7, 13]
    q_lens = [3, 13]  # seq 0: a 3-token chunk after 4 cached tokens; seq 1: whole prompt
    k_cache, v_cache, bt, dense = _paged(lengths, block_size, hkv, d)
    q = torch.randn(sum(q_lens), hq, d)
    cu = torch.tensor([0, 3, 16], dtype=torch.int32)
    out = prefill_attention(q, k_cache, v_cache, cu, torch.tensor(lengths, dtype=torch.int32), bt, d ** -0.5)
    for i, (n, ql) in enumerate(zip(lengths, q_lens)):
        k, v = dense[i]
        s = int(cu[i])
        ref = _dense(q[s:s + ql], k, v, torch.arange(n - ql, n), d ** -0.5)
        torch.testing.assert_close(out[s:s + ql], ref, rtol=1e-5, atol=1e-5)


# Windows: 1 (the query's own token only), not a multiple of any block size here (3, 6, 13) so the window starts
# inside a block, exactly a block (8), and wider than every context (100: the same as no window).
WINDOWS = [1, 3, 6, 8, 13, 100]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size,hq,hkv", [(4, 4, 4), (16, 9, 3), (8, 8, 1)])
def test_decode_with_sliding_window_matches_dense(block_size, hq, hkv, window):
    lengths = [1, 5, 17, 33]
    d = 16
    k_cache, v_cache, bt, dense = _paged(lengths, block_size, hkv, d)
    q = torch.randn(len(lengths), hq, d, generator=torch.Generator().manual_seed(window))
    lens = torch.tensor(lengths, dtype=torch.int32)
    out = paged_decode_attention(q, k_cache, v_cache, bt, lens, d ** -0.5, sliding_window=window)
    full = paged_decode_attention(q, k_cache, v_cache, bt, lens, d ** -0.5)
    for i, n in enumerate(lengths):
        k, v = dense[i]
        ref = _dense(q[i:i + 1], k, v, torch.tensor([n - 1]), d ** -0.5, window)
        torch.testing.assert_close(out[i:i + 1], ref, rtol=1e-5, atol=1e-5)
        if window < n:  # the window hides keys: the output must move, or this test could not see it ignored
            assert (out[i] - full[i]).abs().max() > 1e-2, (n, window)
        else:
            torch.testing.assert_close(out[i], full[i], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_with_sliding_window_matches_dense(window, dtype):
    """Chunks after cached prefixes (the window reaching back into the prefix), whole prompts and a one-token
    prompt; bf16 (SDPA on bf16 inputs) against the dense fp32 computation on the same bf16 values."""
    block_size, hq, hkv, d = 4, 6, 2, 8
    lengths = [7, 13, 30, 1]
    q_lens = [3, 13, 11, 1]
    k_cache, v_cache, bt, dense = _paged(lengths, block_size, hkv, d)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(window)).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    out = prefill_attention(q, k_cache, v_cache, cu, lens, bt, d ** -0.5, sliding_window=window)
    full = prefill_attention(q, k_cache, v_cache, cu, lens, bt, d ** -0.5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for i, (n, ql) in enumerate(zip(lengths, q_lens)):
        k, v = (t.to(dtype).float() for t in dense[i])
        s = int(cu[i])
        ref = _dense(q[s:s + ql].float(), k, v, torch.arange(n - ql, n), d ** -0.5, window)
        torch.testing.assert_close(out[s:s + ql].float(), ref, **tol)
        if window < n:  # its last row's window hides keys
            assert (out[s + ql - 1] - full[s + ql - 1]).abs().max().item() > 5e-2, (n, window)
        else:
            assert torch.equal(out[s:s + ql], full[s:s + ql])


def test_sliding_window_none_or_zero_is_full_attention_and_negative_is_refused():
    k_cache, v_cache, bt, _ = _paged([9, 20], 4, 2, 8)
    q = torch.randn(2, 4, 8)
    lens = torch.tensor([9, 20], dtype=torch.int32)
    full = paged_decode_attention(q, k_cache, v_cache, bt, lens, 0.25)
    for none in (0, None):
        assert torch.equal(paged_decode_attention(q, k_cache, v_cache, bt, lens, 0.25, sliding_window=none), full)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    full = prefill_attention(q, k_cache, v_cache, cu, lens, bt, 0.25)
    assert torch.equal(prefill_attention(q, k_cache, v_cache, cu, lens, bt, 0.25, sliding_window=None), full)
    with pytest.raises(ValueError, match="sliding_window must be >= 0"):
        paged_decode_attention(q, k_cache, v_cache, bt, lens, 0.25, sliding_window=-1)
    with pytest.raises(ValueError, match="sliding_window must be >= 0"):
        prefill_attention(q, k_cache, v_cache, cu, lens, bt, 0.25, sliding_window=-4)
