"""flashattn.fp8: quantisation to e4m3 with descale factors, and the rotation of incoherent processing."""

import pytest
import torch
from utils import INTERPRET

from flashattn import fp8
from flashattn.errors import FlashAttnError


def _x(*shape, outliers=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if outliers:  # 0.1% of the entries 10x larger, as the FP8 papers test
        mask = torch.rand(*shape, generator=g) < 0.001
        x = torch.where(mask, x * 10, x)
    return x


@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_round_trips_within_e4m3_precision(granularity, dtype):
    x = _x(2, 37, 3, 64, outliers=True).to(dtype)
    x8, descale = fp8.quantize(x, granularity)
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == x.shape
    assert descale.dtype == torch.float32 and descale.shape == ((1,) if granularity == "tensor" else (2, 3))
    back = fp8.dequantize(x8, descale)
    # 3 mantissa bits: a relative error of at most 2^-4, plus half the subnormal spacing (2^-10 of the scale)
    d = descale.reshape(1, 1, 1, 1) if granularity == "tensor" else descale[:, None, :, None]
    bound = 2.0 ** -4 * x.float().abs() + 2.0 ** -10 * d
    assert ((back - x.float()).abs() <= bound).all()
    # power-of-two scales: the largest magnitude lands in e4m3's top binade but one, (224, 448], and the
    # descales are exact powers of two
    assert fp8.FP8_MAX / 2 < x8.float().abs().amax() <= fp8.FP8_MAX
    assert torch.equal(torch.frexp(descale)[0].abs(), torch.full_like(descale, 0.5))


def test_zero_input_quantizes_to_zero_with_unit_descale():
    x8, descale = fp8.quantize(torch.zeros(1, 4, 2, 16), "head")
    assert (x8.float() == 0).all() and (descale == 1).all()


def test_rotation_leaves_scores_unchanged_and_spreads_outliers():
    q, k = _x(1, 50, 2, 128, seed=1), _x(1, 60, 2, 128, seed=2)
    q[0, 3, 1, 7] = 300.0  # one large outlier coordinate
    qr, kr = fp8.rotate_qk(q, k, seed=5)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double())
    sr = torch.einsum("bqhd,bkhd->bhqk", qr.double(), kr.double())
    torch.testing.assert_close(sr, s, rtol=1e-5, atol=1e-3)
    r = fp8.rotation(128, seed=5)
    torch.testing.assert_close(r @ r.T, torch.eye(128), rtol=0, atol=1e-5)
    # the outlier's row: its magnitude spread over the head dim (max / rms from ~sqrt(d) down to ~1)
    row, rot = q[0, 3, 1], qr[0, 3, 1]
    assert row.abs().max() / row.pow(2).mean().sqrt() > 10
    assert rot.abs().max() / rot.pow(2).mean().sqrt() < 2


@pytest.mark.parametrize("call, message", [
    (lambda: fp8.quantize(torch.zeros(2, 3, 4)), "4-D tensor"),
    (lambda: fp8.quantize(torch.zeros(1, 2, 2, 8, dtype=torch.int32)), "dtype torch.int32"),
    (lambda: fp8.quantize(torch.zeros(1, 2, 2, 8), "row"), "granularity is 'row'"),
    (lambda: fp8.hadamard(48), "power of two"),
    (lambda: fp8.quantize(torch.zeros(1, 2, 2, 8), rotate_seed=0), "power of two >= 16"),
    (lambda: fp8.dequantize(torch.zeros(1, 2, 2, 8).to(torch.float8_e4m3fn), torch.ones(3)), r"shape \(3,\)"),
])
def test_bad_arguments(call, message):
    with pytest.raises(FlashAttnError, match=message):
        call()


def test_seq_contiguous_layout_holds_the_same_values():
    x = _x(2, 37, 3, 64, seed=3)
    x8, d = fp8.quantize(x, "head")
    y8, e = fp8.quantize(x, "head", seq_contiguous=True)
    assert y8.shape == x8.shape and y8.stride(1) == 1 and x8.stride(-1) == 1
    assert torch.equal(y8.view(torch.uint8), x8.view(torch.uint8)) and torch.equal(d, e)


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_an_empty_sequence_quantizes_with_unit_descale(granularity):
    x8, descale = fp8.quantize(torch.zeros(2, 0, 3, 16), granularity)
    assert x8.shape == (2, 0, 3, 16) and (descale == 1).all()
    assert descale.shape == ((1,) if granularity == "tensor" else (2, 3))


@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backends_quantize_bit_for_bit(granularity, dtype):
    from flashattn import config
    x = _x(2, 70, 3, 40, outliers=True, seed=4).to(dtype)
    results = []
    for backend in ("torch", "triton") if INTERPRET else ("torch",):
        with config.use_backend(backend):
            results.append(fp8.quantize(x, granularity, seq_contiguous=True))
    for x8, d in results[1:]:
        assert torch.equal(x8.view(torch.uint8), results[0][0].view(torch.uint8))
        assert torch.equal(d, results[0][1])


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_quantize_with_rotation_round_trips_the_rotated_values(backend, granularity):
    q = _x(1, 45, 2, 64, outliers=True, seed=5)
    q8, d = fp8.quantize(q, granularity, rotate_seed=3)
    rotated = q.double() @ fp8.rotation(64, 3).double()
    bound = 2.0 ** -4 * rotated.abs() + 2.0 ** -10 * (d.reshape(1, 1, 1, 1) if granularity == "tensor"
                                                       else d[:, None, :, None])
    assert ((fp8.dequantize(q8, d).double() - rotated).abs() <= bound + 1e-6).all()


def test_tiny_inputs_keep_a_finite_scale(backend):
    x = _x(1, 16, 2, 16, seed=6) * 1e-35
    x8, d = fp8.quantize(x, "head")
    assert torch.isfinite(x8.float()).all() and torch.isfinite(d).all()
    assert ((fp8.dequantize(x8, d) - x).abs() <= 2.0 ** -4 * x.abs() + 2.0 ** -10 * d[:, None, :, None]).all()
