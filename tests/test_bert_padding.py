"""flashattn.bert_padding: padding masks <-> varlen packing, both directions differentiable."""

import pytest
import torch

from flashattn.bert_padding import (
    index_first_axis,
    index_put_first_axis,
    pad_input,
    unpad_indices_static,
    unpad_input,
)


def _mask(lengths, seqlen, side):
    pos = torch.arange(seqlen).view(1, -1)
    lens = torch.tensor(lengths).view(-1, 1)
    return pos < lens if side == "right" else pos >= seqlen - lens


@pytest.mark.parametrize("side", ["right", "left"])
def test_round_trip(side):
    lengths, seqlen = [5, 0, 7, 1], 7
    x = torch.randn(4, seqlen, 3, 2)
    mask = _mask(lengths, seqlen, side)
    packed, indices, cu, max_len, seqused = unpad_input(x, mask)
    assert packed.shape == (sum(lengths), 3, 2)
    assert indices.dtype == torch.int64 and cu.dtype == torch.int32 and seqused.dtype == torch.int32
    assert cu.tolist() == [0, 5, 5, 12, 13]
    assert max_len == 7 and isinstance(max_len, int)
    assert seqused.tolist() == lengths
    # each sequence's tokens, in order
    for b in range(len(lengths)):
        assert torch.equal(packed[cu[b] : cu[b + 1]], x[b][mask[b]])
    back = pad_input(packed, indices, 4, seqlen)
    assert torch.equal(back, x * mask.view(4, seqlen, 1, 1))


def test_integer_mask_and_holes():
    x = torch.randn(2, 5, 4)
    mask = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 0, 0, 0]])
    packed, indices, cu, max_len, seqused = unpad_input(x, mask)
    assert indices.tolist() == [0, 2, 3]
    assert cu.tolist() == [0, 3, 3] and max_len == 3 and seqused.tolist() == [3, 0]
    assert torch.equal(packed, x[0, [0, 2, 3]])


@pytest.mark.parametrize("mask", [[[1, 0, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]],
                                  [[0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]], ids=["holes", "none"])
def test_static_indices_agree_with_unpad_input(mask):
    mask = torch.tensor(mask)
    x = torch.randn(3, 5, 2)
    _, want, want_cu, _, _ = unpad_input(x, mask)
    indices, cu, real = unpad_indices_static(mask)
    total = want.numel()
    # the real tokens first, as unpad_input packs them, then every padding position once
    assert torch.equal(indices[:total], want) and torch.equal(cu, want_cu)
    assert sorted(indices.tolist()) == list(range(15)) and real.tolist() == [r < total for r in range(15)]
    packed = index_first_axis(x.flatten(0, 1), indices)
    back = index_put_first_axis(torch.where(real.view(-1, 1), packed, 0), indices, 15).unflatten(0, (3, 5))
    assert torch.equal(back, x * mask.view(3, 5, 1))


def test_all_padding():
    x = torch.randn(3, 4, 2)
    packed, indices, cu, max_len, seqused = unpad_input(x, torch.zeros(3, 4, dtype=torch.bool))
    assert packed.shape == (0, 2) and indices.numel() == 0
    assert cu.tolist() == [0, 0, 0, 0] and max_len == 0 and seqused.tolist() == [0, 0, 0]
    assert torch.equal(pad_input(packed, indices, 3, 4), torch.zeros(3, 4, 2))


def test_unused_mask():
    x = torch.randn(2, 6, 3)
    used = _mask([2, 4], 6, "right")
    unused = _mask([3, 5], 6, "right") & ~used  # one allocated, unattended slot after each sequence
    packed, indices, cu, max_len, seqused = unpad_input(x, used, unused)
    assert cu.tolist() == [0, 3, 8] and max_len == 5
    assert seqused.tolist() == [2, 4]
    assert torch.equal(packed, x.flatten(0, 1)[indices])


def test_gradients_flow_both_ways():
    x = torch.randn(3, 6, 4, dtype=torch.float64, requires_grad=True)
    mask = _mask([6, 2, 4], 6, "left")
    packed, indices, *_ = unpad_input(x, mask)
    w = torch.randn_like(packed)
    (gx,) = torch.autograd.grad((packed * w).sum(), x)
    assert torch.equal(gx, pad_input(w, indices, 3, 6))  # zero at padding, w at real tokens

    y = torch.randn(12, 4, dtype=torch.float64, requires_grad=True)
    padded = pad_input(y, indices, 3, 6)
    g = torch.randn_like(padded)
    (gy,) = torch.autograd.grad((padded * g).sum(), y)
    assert torch.equal(gy, g.flatten(0, 1)[indices])
    flat = x.flatten(0, 1).detach().requires_grad_()
    torch.autograd.gradcheck(lambda t: index_first_axis(t, indices), (flat,))
    torch.autograd.gradcheck(lambda t: index_put_first_axis(t, indices, 18), (y,))


def test_bad_mask_shape():
    with pytest.raises(ValueError, match="attention_mask"):
        unpad_input(torch.randn(2, 5, 3), torch.ones(2, 4, dtype=torch.bool))
