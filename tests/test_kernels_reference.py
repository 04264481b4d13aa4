"""The paged reference ops against dense attention computed without any paging."""
import pytest
import torch

from kernels.reference import paged_decode_attention, prefill_attention, write_kv_cache


def _dense(q, k, v, q_pos, scale):
    """q: [Lq, Hq, D], k/v: [Lk, Hkv, D]; causal by absolute positions."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.arange(k.shape[0])[None, :] > q_pos[:, None]
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
