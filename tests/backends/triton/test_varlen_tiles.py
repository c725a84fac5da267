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


@pytest.mark.parametrize("lens_q, lens_k, block_n", [
    ([0, 5, 1, 8, 3], [7, 0, 300, 129, 128], 128),
    ([(i * 37) % 300 for i in range(1100)], [(i * 53) % 700 for i in range(1100)], 64),  # past one block
])
def test_backward_offsets_are_both_lists_in_one_launch(lens_q, lens_k, block_n):
    """The varlen backward's pair: its stats rows in 4-row steps before each query sequence, and its key tiles
    before each key sequence, the same lists varlen_tile_offsets writes one at a time."""
    from types import SimpleNamespace

    cu_q, cu_k = (torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32)
                  for ls in (lens_q, lens_k))
    q, k = torch.empty(int(cu_q[-1]), 1, 1), torch.empty(int(cu_k[-1]), 1, 1)
    route = SimpleNamespace(tiles=SimpleNamespace(block_n=block_n))
    rows, tiles = gluon.varlen_backward_offsets(SimpleNamespace(batch=len(lens_q)), route, cu_q, cu_k, q, k)
    assert rows.tolist() == gluon.varlen_tile_offsets(cu_q, len(lens_q), 4, q.shape[0]).tolist()
    assert tiles.tolist() == gluon.varlen_tile_offsets(cu_k, len(lens_k), block_n, k.shape[0]).tolist()
    expected = [0]
    for n in lens_k:
        expected.append(expected[-1] + -(-n // block_n))
    assert tiles.tolist() == expected
