"""Argument checks shared by the Triton wrappers: a bad shape, stride, dtype or device is a `ValueError` naming the
offending tensor and its shape, raised on the host before any launch (a wrong launch would read out of bounds).
`window_size` reads the attention ops' `sliding_window` for every backend."""
from __future__ import annotations

from collections.abc import Callable

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check(cond: bool, message: str | Callable[[], str]) -> None:
    """Raise `ValueError(message)` unless cond holds. A callable message is formatted only on failure: these checks
    run once per layer per step, and formatting shapes into f-strings eagerly was most of their cost (about 28 of
    48 us per CPU decode-attention call at batch 1)."""
    if not cond:
        raise ValueError(message() if callable(message) else message)


def check_tensor(name: str, t: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...], device: torch.device,
                 inner_contiguous: bool = False) -> None:
    """Check rank, dtype and device; with inner_contiguous, also stride 1 on the last dim (kernels load rows).

    Raises:
        ValueError: naming `name` with its shape, dtype, device or strides.
    """
    if (isinstance(t, torch.Tensor) and t.dim() == ndim and t.dtype in dtypes and t.device == device
            and (not inner_contiguous or t.stride(-1) == 1)):
        return  # one test on the path every call takes (per layer per step); the ones below name what failed
    check(isinstance(t, torch.Tensor), lambda: f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check(t.dim() == ndim, lambda: f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    check(t.dtype in dtypes, lambda: f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    check(t.device == device, lambda: f"{name} is on {t.device}, expected {device} (all operands on one device)")
    if inner_contiguous:
        check(t.stride(-1) == 1, lambda: f"{name} must be contiguous in its last dim, got strides {t.stride()}"
                                 f" for shape {tuple(t.shape)}")


def window_size(sliding_window: int | None) -> int:
    """An attention op's `sliding_window` argument (None or 0: no window; W >= 1: the query's token and the W - 1
    before it, `kernels.reference`) as an int >= 0, 0 meaning no window.

    Raises:
        ValueError: a negative window.
    """
    if not sliding_window:
        return 0
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 (0 or None: no window), got {sliding_window}")
    return int(sliding_window)


def dense_block_strides(num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    """Strides (in elements) of dims 1-3 of a [num_blocks, block_size, num_kv_heads, head_dim] cache whose
    (block_size, heads, head_dim) slab is dense, so a token's heads are one row: the layout the kernels read."""
    return num_kv_heads * head_dim, head_dim, 1


def dense_within_block(cache: torch.Tensor) -> bool:
    """A [num_blocks, block_size, num_kv_heads, head_dim] cache view whose (block_size, heads, head_dim) slab is
    dense (`dense_block_strides`); dim 0 may be strided (the per-layer view of a cache of all layers)."""
    _, _, heads, head_dim = cache.shape
    return cache.stride()[1:] == dense_block_strides(heads, head_dim)


def check_kv_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, device: torch.device,
                    dtypes: tuple[torch.dtype, ...]) -> None:
    """k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim], one dtype of `dtypes` for both, each
    (block_size, heads, head_dim) slab dense so a token's heads are one row (dim 0 may be strided: the per-layer view
    of the cache).

    Raises:
        ValueError: on any mismatch.
    """
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, c, 4, dtypes, device, inner_contiguous=True)
        check(dense_within_block(c),
              lambda: f"{name} must be dense within a block, got strides {c.stride()} for shape {tuple(c.shape)}")
    check(v_cache.dtype == k_cache.dtype, lambda: f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    check(k_cache.shape == v_cache.shape,
          lambda: f"k_cache shape {tuple(k_cache.shape)} != v_cache shape {tuple(v_cache.shape)}")


def check_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, num_seqs: int, mixed_kv: bool = False) -> None:
    """Checks shared by the attention wrappers: query [*, num_q_heads, head_dim] float with a dense last dim;
    caches of the query's dtype (with mixed_kv, of any float dtype, both alike: what the CPU kernels and the reference
    read, `--kv-cache-dtype`) and head_dim with num_q_heads a multiple of num_kv_heads; block_tables
    [num_seqs, max_blocks] int32; context_lens [num_seqs] int32; all on the query's device.

    Raises:
        ValueError: naming the offending tensor and its shape.
    """
    if _attention_ok(query, k_cache, v_cache, block_tables, context_lens, num_seqs, mixed_kv):
        return  # one test on the path every call takes (5.3 -> 2.1 us per call on a 2-core EPYC); the checks below name what failed
    device = query.device
    check_tensor("query", query, 3, FLOAT_DTYPES, device, inner_contiguous=True)
    check_kv_caches(k_cache, v_cache, device, FLOAT_DTYPES if mixed_kv else (query.dtype,))
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads, cache_head_dim = k_cache.shape[2:]
    check(cache_head_dim == head_dim, lambda: f"query head_dim {head_dim} != cache head_dim {cache_head_dim} "
                                      f"(query {tuple(query.shape)}, cache {tuple(k_cache.shape)})")
    check(num_q_heads % num_kv_heads == 0,
          lambda: f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_tensor("block_tables", block_tables, 2, (torch.int32,), device, inner_contiguous=True)
    check(block_tables.shape[0] == num_seqs,
          lambda: f"block_tables shape {tuple(block_tables.shape)} != num_seqs {num_seqs}")
    check_tensor("context_lens", context_lens, 1, (torch.int32,), device)
    check(context_lens.shape[0] == num_seqs,
          lambda: f"context_lens shape {tuple(context_lens.shape)} != num_seqs {num_seqs}")


def _attention_ok(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, num_seqs: int, mixed_kv: bool) -> bool:
    """`check_attention`'s conditions as one expression (each tensor's shape and strides read once)."""
    tensor = torch.Tensor
    if not (isinstance(query, tensor) and isinstance(k_cache, tensor) and isinstance(v_cache, tensor)
            and isinstance(block_tables, tensor) and isinstance(context_lens, tensor)):
        return False
    device, dtype = query.device, query.dtype
    q_shape, k_shape, k_strides, v_strides = query.shape, k_cache.shape, k_cache.stride(), v_cache.stride()
    bt_shape = block_tables.shape
    return (len(q_shape) == 3 and dtype in FLOAT_DTYPES and query.stride(2) == 1 and len(k_shape) == 4
            and (k_cache.dtype == dtype or (mixed_kv and k_cache.dtype in FLOAT_DTYPES))
            and v_cache.dtype == k_cache.dtype and v_cache.shape == k_shape
            and k_strides[1:] == dense_block_strides(k_shape[2], k_shape[3]) and v_strides[1:] == k_strides[1:]
            and k_shape[3] == q_shape[2] and q_shape[1] % k_shape[2] == 0
            and block_tables.dtype == torch.int32 and len(bt_shape) == 2 and bt_shape[0] == num_seqs
            and block_tables.stride(1) == 1 and context_lens.dtype == torch.int32
            and context_lens.shape == (num_seqs,) and k_cache.device == device and v_cache.device == device
            and block_tables.device == device and context_lens.device == device)
