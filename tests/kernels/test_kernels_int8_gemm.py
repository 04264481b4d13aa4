"""The int8 GEMM of `--quantization w8a8_int8` (`kernels/cpu_int8_gemm.c`) against its arithmetic written in torch,
in every ISA build this CPU runs (the `kernels` fixture: the AVX2 intrinsics and the plain loops of the base build)."""
import pytest
import torch
import torch.nn.functional as F

from kernel_builds import kernels  # noqa: F401 (a fixture)
from pdserve_server.engine.execution.packing import W8A8_BLOCK, W8A8_GROUP, W8A8_WEIGHT_MAX, w8a8_packed, w8a8_weights


def w8a8_reference(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y [M, N] of kernels/cpu_int8_gemm.c's arithmetic from its definition, in float64: x [M, K] quantized per row
    per block of 64 (scale max / 127, q = round(x * (127 / max))), W = (wq - 64) * w_scale."""
    m, k = x.shape
    blocks = x.view(m, k // W8A8_BLOCK, W8A8_BLOCK)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    qx = torch.round(blocks * inv[..., None]).clamp(-127, 127).double()
    qw = (wq.double() - 64).view(wq.shape[0], k // W8A8_BLOCK, W8A8_BLOCK)
    sums = torch.einsum("mbk,nbk->mnb", qx, qw)  # integer block sums, exact in float64
    y = w_scale.double()[None] * (sums * (amax / 127.0).double()[:, None, :]).sum(-1)
    return (y if bias is None else y + bias.double()).float()


@pytest.mark.parametrize("rows,out_features,in_features", [
    (1, 1, 64), (2, 3, 64), (5, 7, 128), (6, 2, 192), (7, 5, 576), (13, 11, 192), (3, 16, 64), (9, 40, 128),
    (65, 1536, 576), (200, 96, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_linear_computes_its_arithmetic(kernels, rows, out_features, in_features, with_bias):
    """Every tile shape (rows past a multiple of a tile's 4 or 8, weight rows in part of a group of 16, an odd number
    of groups, more rows than a pass of 96): the kernel's sums equal the definition's up to fp32 rounding. A block's q
    may differ by one at a rounding tie (the kernel's -ffast-math may compute 127 / max as a reciprocal), moving an
    output by about one step of x's scale."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g)
    x[0, :W8A8_BLOCK] = 0.0  # an all-zero block: scale 0, no division by it
    wq, w_scale = w8a8_weights(torch.randn(out_features, in_features, generator=g) * 0.05)
    bias = torch.randn(out_features, generator=g) if with_bias else None
    ours = kernels.linear_w8a8(x, w8a8_packed(wq), w_scale, bias)
    ref = w8a8_reference(x, wq, w_scale, bias)
    assert ours.shape == (rows, out_features) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-3 * ref.abs().max().item())


def test_int8_linear_reads_strided_rows_and_is_near_the_fp32_linear(kernels):
    """Rows that are a view of wider rows (a fused projection's slice) read as their contiguous copy, and the lossy
    arithmetic stays near the exact linear: ~1% relative error on random data (7-bit weights, 8-bit x)."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(100, 3 * 576, generator=g)
    x = wide[:, 576:2 * 576]
    weight = torch.randn(1536, 576, generator=g) * 0.05
    wq, w_scale = w8a8_weights(weight)
    wp = w8a8_packed(wq)
    ours = kernels.linear_w8a8(x, wp, w_scale, None)
    assert torch.equal(ours, kernels.linear_w8a8(x.contiguous(), wp, w_scale, None))
    exact = F.linear(x, weight)
    assert (ours - exact).norm() / exact.norm() < 0.03


def test_w8a8_weights_are_seven_bit_rows_with_their_scales():
    weight = torch.tensor([[0.5, -1.0] * 32, [0.0] * 64, [2.0 ** -20] * 64])
    wq, w_scale = w8a8_weights(weight)
    assert wq.dtype == torch.uint8 and wq.shape == (3, 64) and w_scale.shape == (3,)
    q = wq.int() - 64
    assert q.abs().max() == W8A8_WEIGHT_MAX and q[0, 1] == -W8A8_WEIGHT_MAX and q[1].abs().max() == 0
    torch.testing.assert_close(q.float() * w_scale[:, None], weight, rtol=0, atol=w_scale.max().item() / 2)
    with pytest.raises(ValueError, match="divisible by 64"):
        w8a8_weights(torch.zeros(4, 96))


def test_w8a8_packed_puts_four_bytes_of_each_row_side_by_side_in_groups_of_16():
    """wq[n, k] lands at [n // 16, k // 4, 4 * (n % 16) + k % 4]; the last group's missing rows hold 64 (weight 0)."""
    n, k = 20, 128
    wq = torch.randint(1, 128, (n, k), dtype=torch.uint8)
    wp = w8a8_packed(wq)
    assert wp.shape == (2, k // 4, 4 * W8A8_GROUP) and wp.dtype == torch.uint8 and wp.is_contiguous()
    rows, cols = torch.meshgrid(torch.arange(n), torch.arange(k), indexing="ij")
    assert torch.equal(wp[rows // 16, cols // 4, 4 * (rows % 16) + cols % 4], wq)
    assert (wp[1, :, 4 * (n % 16):] == 64).all()


def test_int8_linear_refuses_what_it_does_not_compute(kernels):
    wq, w_scale = w8a8_weights(torch.randn(4, 64))
    wp = w8a8_packed(wq)
    for x, w, s, b, match in [
            (torch.zeros(2, 64).bfloat16(), wp, w_scale, None, "float32 x"),
            (torch.zeros(2, 96), torch.full((1, 24, 64), 64, dtype=torch.uint8), w_scale, None, "multiple of 64"),
            (torch.zeros(2, 64), wp.to(torch.int8), w_scale, None, "uint8"),
            (torch.zeros(2, 64), wq, w_scale, None, "packed"),  # rows as w8a8_weights gives them, not packed
            (torch.zeros(2, 64), wp, torch.zeros(17), None, "w_scale N = 17"),  # two groups' worth of scales
            (torch.zeros(2, 64), wp, w_scale.double(), None, "w_scale"),
            (torch.zeros(2, 64), wp, w_scale, torch.zeros(3), "bias")]:
        with pytest.raises(ValueError, match=match):
            kernels.linear_w8a8(x, w, s, b)
