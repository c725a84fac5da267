"""The Gluon forward's varlen schedule on the CPU (TRITON_INTERPRET=1): kernels/triton/tiles.py writes the
query tiles before each sequence, the list the kernel's persistent programs walk and bisect
(kernels/gluon/schedule.py). The Gluon kernel itself runs on the GPU only (test_gluon_fwd_gpu.py,
test_gluon_features_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from utils import INTERPRET

from flashattn.backends.triton import gluon

pytestmark = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernel under TRITON_INTERPRET=1")


@pytest.mark.parametrize("block_m", [128, 192])
@pytest.mark.parametrize("lengths", [
    [0], [1], [0, 0, 0], [128, 129, 0, 1, 255, 256, 257], [5000],
    # past one block of sequences (1024): the running total carries across blocks
    [(i * 37) % 300 for i in range(2500)],
], ids=lambda ls: f"{len(ls)} sequences")
def test_tile_offsets(lengths, block_m):
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    offsets = gluon.varlen_tile_offsets(cu, len(lengths), block_m, int(cu[-1]))
    expected = [0]
    for n in lengths:
        expected.append(expected[-1] + -(-n // block_m))
    assert offsets.dtype == torch.int32 and offsets.tolist() == expected


def test_tile_offsets_clamp_the_sequences_into_the_tokens():
    # unchecked values (a device tensor without config.check_varlen): each sequence clamped as the kernels
    # clamp it, first into [0, total], end into [first, total]
    cu = torch.tensor([0, 300, 100, -50, 700, 900], dtype=torch.int32)
    offsets = gluon.varlen_tile_offsets(cu, 5, 128, 600)
    # lengths 300; 0 (end 100 below first 300); 0 (-50 below 100); 600 (first -50 -> 0, end 700 -> 600); 0
    assert offsets.tolist() == [0, 3, 3, 3, 8, 8]
