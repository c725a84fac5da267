"""flashattn.dropout: Philox bit-exactness against Triton's tl.rand, and the keep-mask's statistics.

The comparison with ``tl.rand`` runs the kernel below under the Triton interpreter, so it needs the whole
session started with ``TRITON_INTERPRET=1`` (Triton reads it when a kernel is decorated); without it, or
without Triton, those tests skip.  On a GPU the same kernel compiled for real is checked in the gpu tests of
the Triton backend.
"""

import math
import os

import pytest
import torch

from flashattn import dropout
from flashattn.dropout import (
    dropout_keep_chunk,
    dropout_keep_mask,
    dropout_offsets,
    philox,
    rand_uniform,
    randint,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but the torch side must not need it
    triton = None

needs_interpreter = pytest.mark.skipif(
    triton is None or not INTERPRET, reason="compares with tl.rand under TRITON_INTERPRET=1"
)

if triton is not None:

    @triton.jit
    def _rand_kernel(out_ptr, offs_ptr, seed, n, BLOCK: tl.constexpr):
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = idx < n
        offs = tl.load(offs_ptr + idx, mask=inside, other=0)
        tl.store(out_ptr + idx, tl.rand(seed, offs), mask=inside)

    @triton.jit
    def _randint_kernel(out_ptr, offs_ptr, seed, n, BLOCK: tl.constexpr):
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = idx < n
        offs = tl.load(offs_ptr + idx, mask=inside, other=0)
        tl.store(out_ptr + idx, tl.randint(seed, offs).to(tl.int64), mask=inside)


def _triton_rand(seed, offs):
    out = torch.empty(offs.shape, dtype=torch.float32)
    block = 256
    _rand_kernel[(triton.cdiv(offs.numel(), block),)](out, offs, seed, offs.numel(), BLOCK=block)
    return out


def _triton_randint(seed, offs):
    out = torch.empty(offs.shape, dtype=torch.int64)
    block = 256
    _randint_kernel[(triton.cdiv(offs.numel(), block),)](out, offs, seed, offs.numel(), BLOCK=block)
    return out


def _offsets_under_test():
    g = torch.Generator().manual_seed(1)
    edges = torch.tensor(
        [0, 1, 2, 3, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**33 + 12345, 2**40 + 7, 2**62 + 99,
         2**63 - 1],
        dtype=torch.int64,
    )
    small = torch.randint(0, 2**31, (300,), generator=g, dtype=torch.int64)
    big = torch.randint(0, 2**62, (300,), generator=g, dtype=torch.int64) * 2
    return torch.cat([edges, small, big, torch.arange(1000, 1200)])


# Int seeds the Triton launcher types as int32, int64 and uint64 (every one becomes a uint64 key).
SEEDS = [0, 1, 12345, 2**31 - 1, 2**31 + 5, 2**40 + 3, 2**63 - 2, 2**63 + 11, 2**64 - 1]


@needs_interpreter
@pytest.mark.parametrize("seed", SEEDS)
def test_rand_uniform_equals_tl_rand(seed):
    offs = _offsets_under_test()
    words = randint(seed, offs)
    assert torch.equal(words, _triton_randint(seed, offs)), "Philox words differ"
    ours = rand_uniform(seed, offs)
    theirs = _triton_rand(seed, offs)
    assert ours.dtype == torch.float32
    bad = (ours.view(torch.int32) != theirs.view(torch.int32)).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} of {offs.numel()} draws differ in bits; first offsets "
        f"{offs[bad[:5]].tolist()}: ours {ours[bad[:5]].tolist()} tl.rand {theirs[bad[:5]].tolist()}"
    )


@needs_interpreter
def test_int32_offsets_agree_with_int64():
    # a kernel that computes offsets in int32 draws the same numbers as long as they stay below 2**31
    offs32 = torch.tensor(list(range(500)) + [2**31 - 1], dtype=torch.int32)
    assert torch.equal(_triton_rand(77, offs32), rand_uniform(77, offs32.long()))


def test_philox_known_answers():
    # Random123's published Philox4x32-10 test vectors (kat_vectors): counter, key -> output
    cases = [
        ((0, 0, 0, 0), 0, (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, 2**64 - 1, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            0x299F31D0A4093822,
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for ctr, key, expected in cases:
        out = philox(key, *(torch.tensor([c]) for c in ctr))
        assert tuple(int(w) for w in out) == expected


def test_rand_uniform_range_and_dtype():
    n = 40_000
    words = randint(3, torch.arange(n))
    assert words.min() >= 0 and words.max() < 2**32
    u = rand_uniform(3, torch.arange(n))
    assert u.dtype == torch.float32
    assert (u >= 0).all() and (u < 1).all()
    # roughly uniform: each decile holds 10% within 6 sigma
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    sigma = math.sqrt(n * 0.1 * 0.9)
    assert ((counts - n / 10).abs() < 6 * sigma).all(), counts


def test_blocked_randint_is_elementwise():
    # randint works in blocks of _BLOCK offsets; the split must not show in the result or its shape
    offs = torch.randint(0, 2**40, (3, dropout._BLOCK + 7))
    words = randint(9, offs)
    assert words.shape == offs.shape
    assert torch.equal(words, philox(9, offs & 0xFFFFFFFF, offs >> 32)[0])


def test_negative_seed_is_its_residue_mod_2_64():
    offs = torch.arange(50)
    assert torch.equal(rand_uniform(-5, offs), rand_uniform(2**64 - 5, offs))


def test_offsets_formula():
    offs = dropout_offsets(1000, torch.tensor([0, 2]), 3, torch.arange(4), torch.arange(5), 7, 11)
    b, h, i, j = 1, 2, 3, 4  # batch_idx[1] = 2
    assert offs[b, h, i, j] == 1000 + ((2 * 3 + h) * 7 + i) * 11 + j
    assert offs.shape == (2, 3, 4, 5)


def test_keep_mask_matches_definition():
    seed, off, b, h, sq, sk, p = 99, 2**33 + 5, 2, 3, 9, 13, 0.3
    mask = dropout_keep_mask(seed, off, b, h, sq, sk, p)
    assert mask.dtype == torch.bool and mask.shape == (b, h, sq, sk)
    bb, hh, ii, jj = torch.meshgrid(*(torch.arange(n) for n in (b, h, sq, sk)), indexing="ij")
    u = rand_uniform(seed, off + ((bb * h + hh) * sq + ii) * sk + jj)
    assert torch.equal(mask, u >= torch.tensor(p, dtype=torch.float32))


def test_chunks_tile_the_mask():
    kw = dict(max_seqlen_q=20, max_seqlen_k=30)
    full = dropout_keep_mask(5, 17, 3, 2, 20, 30, 0.4, **kw)
    for i0, i1, j0, j1 in [(0, 7, 0, 30), (7, 20, 11, 29), (19, 20, 29, 30)]:
        chunk = dropout_keep_chunk(5, 17, [1, 2], 2, i0, i1, j0, j1, 0.4, **kw)
        assert torch.equal(chunk, full[1:3, :, i0:i1, j0:j1])


def test_varlen_mask_is_a_corner_of_the_max_mask():
    full = dropout_keep_mask(5, 0, 2, 2, 16, 16, 0.5)
    part = dropout_keep_mask(5, 0, 2, 2, 10, 12, 0.5, max_seqlen_q=16, max_seqlen_k=16)
    assert torch.equal(part, full[:, :, :10, :12])
    with pytest.raises(ValueError, match="max_seqlen"):
        dropout_keep_mask(5, 0, 2, 2, 17, 12, 0.5, max_seqlen_q=16, max_seqlen_k=16)


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
def test_kept_fraction(p):
    n = 2 * 4 * 64 * 80
    mask = dropout_keep_mask(2024, 0, 2, 4, 64, 80, p)
    kept = mask.sum().item()
    # binomial(n, 1 - p): 6 sigma, a false alarm about once in 10^9 runs
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(kept - n * (1 - p)) <= 6 * sigma + 1e-9, (kept, n * (1 - p), sigma)


def test_seeds_and_offsets_decorrelate():
    a = dropout_keep_mask(1, 0, 1, 2, 64, 64, 0.5)
    b = dropout_keep_mask(2, 0, 1, 2, 64, 64, 0.5)
    c = dropout_keep_mask(1, 64 * 64 * 2, 1, 2, 64, 64, 0.5)
    n = a.numel()
    for other in (b, c):
        agree = (a == other).sum().item()
        # independent masks agree on about half the entries
        assert abs(agree - n / 2) <= 6 * math.sqrt(n / 4)
    assert torch.equal(a, dropout_keep_mask(1, 0, 1, 2, 64, 64, 0.5))


def test_bad_dropout_p():
    for p in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="dropout_p"):
            dropout_keep_mask(0, 0, 1, 1, 2, 2, p)
