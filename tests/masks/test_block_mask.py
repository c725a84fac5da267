"""BlockMask: every constructor against an independent element formula, the kernel-tensor contract rebuilt
from its lists and bits, the combinators, re-blocking, random masks (hypothesis) and the validation errors."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashattn.masks import BlockMask, BlockMaskKernelTensors

SIZES = [(1, 1), (17, 17), (70, 100), (100, 70), (64, 64), (129, 33)]
BLOCKS = [(16, 16), (32, 16), (16, 64)]


def _grid(*sizes):
    return itertools.product(*(range(n) for n in sizes))


def _ij(sq, sk):
    return torch.arange(sq).view(-1, 1), torch.arange(sk).view(1, -1)


def dense_from_kernel_tensors(kt: BlockMaskKernelTensors, batch: int, heads: int) -> torch.Tensor:
    """The mask the kernels would apply, rebuilt from the lists and bits alone (loops: no shared code)."""
    bm, bn, sq, sk = kt.block_m, kt.block_n, kt.seqlen_q, kt.seqlen_k
    out = torch.zeros(batch, heads, kt.n_qblocks * bm, kt.n_kblocks * bn, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            for m in range(kt.n_qblocks):
                for s in range(int(kt.kv_full_num[b, h, m])):
                    n = int(kt.kv_full_idx[b, h, m, s])
                    out[b, h, m * bm : (m + 1) * bm, n * bn : (n + 1) * bn] = True
                for s in range(int(kt.kv_part_num[b, h, m])):
                    n = int(kt.kv_part_idx[b, h, m, s])
                    bits = kt.part_bits[b, h, m, s]  # (bm, bn // 8)
                    for j in range(bn):
                        out[b, h, m * bm : (m + 1) * bm, n * bn + j] = (
                            (bits[:, j // 8] >> (j % 8)) & 1
                        ).bool()
    return out[..., :sq, :sk]


def check_contract(mask: BlockMask) -> None:
    """Shapes, dtypes, sortedness, the transposed lists, q_part_slot, tails, full/partial classification."""
    kt = mask.to_kernel_tensors()
    nb, nh, sq, sk = mask.shape
    mq, nk = kt.n_qblocks, kt.n_kblocks
    bm, bn = kt.block_m, kt.block_n
    assert (mq, nk) == (-(-sq // bm), -(-sk // bn))
    for name in BlockMaskKernelTensors.TENSORS:
        t = getattr(kt, name)
        assert t.is_contiguous(), name
        assert t.dtype == (torch.uint8 if name == "part_bits" else torch.int32), name
        assert t.shape[:2] == (nb, nh), name
    assert kt.part_bits.shape[2:] == (mq, kt.kv_part_idx.shape[-1], bm, bn // 8)
    # launch orders: permutations of the blocks, longest lists first, ties by index
    for order, count in ((kt.q_order, kt.kv_full_num + kt.kv_part_num),
                         (kt.k_order, kt.q_full_num + kt.q_part_num)):
        blocks = torch.arange(order.shape[-1], dtype=torch.int32).expand_as(order)
        assert torch.equal(order.sort(-1).values, blocks)
        ranked = count.gather(-1, order.long())
        assert (ranked[..., :-1] >= ranked[..., 1:]).all()
        ties = ranked[..., :-1] == ranked[..., 1:]
        assert (order[..., :-1] < order[..., 1:])[ties].all()
    assert kt.q_part_slot.shape == kt.q_part_idx.shape
    dense = mask.to_dense()
    assert torch.equal(dense_from_kernel_tensors(kt, nb, nh), dense)
    grid = torch.zeros(nb, nh, mq, nk, dtype=torch.int8)  # 1 partial, 2 full
    for num, idx, val in ((kt.kv_full_num, kt.kv_full_idx, 2), (kt.kv_part_num, kt.kv_part_idx, 1)):
        for b, h, m in _grid(nb, nh, mq):
            ids = idx[b, h, m, : int(num[b, h, m])].tolist()
            assert ids == sorted(set(ids)) and all(0 <= n < nk for n in ids)
            assert all(grid[b, h, m, n] == 0 for n in ids), "a block in both lists"
            grid[b, h, m, ids] = val
    # transposed lists: the same pairs, ascending, and q_part_slot finds the pair's bits
    for b, h, n in _grid(nb, nh, nk):
        full = kt.q_full_idx[b, h, n, : int(kt.q_full_num[b, h, n])].tolist()
        part = kt.q_part_idx[b, h, n, : int(kt.q_part_num[b, h, n])].tolist()
        assert full == sorted(set(full)) and part == sorted(set(part))
        assert full == (grid[b, h, :, n] == 2).nonzero().flatten().tolist()
        assert part == (grid[b, h, :, n] == 1).nonzero().flatten().tolist()
        for t, m in enumerate(part):
            s = int(kt.q_part_slot[b, h, n, t])
            assert int(kt.kv_part_idx[b, h, m, s]) == n and s < int(kt.kv_part_num[b, h, m])
    # full: every in-range row sees the whole block; partial: something visible, not everything
    pad = torch.zeros(nb, nh, mq * bm, nk * bn, dtype=torch.bool)
    pad[..., :sq, :sk] = dense
    for b, h, m, n in _grid(nb, nh, mq, nk):
        tile = pad[b, h, m * bm : min((m + 1) * bm, sq), n * bn : (n + 1) * bn]
        if grid[b, h, m, n] == 2:
            assert tile.all()
        elif grid[b, h, m, n] == 1:
            assert tile.any() and not tile.all()
        else:
            assert not tile.any()


# -- constructors against element formulas


@pytest.mark.parametrize("sq,sk", SIZES)
@pytest.mark.parametrize("bs", BLOCKS)
def test_causal(sq, sk, bs):
    m = BlockMask.causal(sq, sk, block_size=bs)
    i, j = _ij(sq, sk)
    assert torch.equal(m.to_dense()[0, 0], j <= i + sk - sq)
    check_contract(m)


@pytest.mark.parametrize("sq,sk", SIZES)
@pytest.mark.parametrize(
    "window,causal",
    [
        ((5, 3), False),
        ((0, 0), False),
        ((20, -1), False),
        ((-1, 7), False),
        ((33, 10), True),
        ((-1, -1), True),
    ],
)
def test_sliding_window(sq, sk, window, causal):
    m = BlockMask.sliding_window(sq, sk, window, causal=causal, block_size=(16, 32))
    i, j = _ij(sq, sk)
    left, right = window
    right = 0 if causal else right
    want = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        want &= j >= i + sk - sq - left
    if right >= 0:
        want &= j <= i + sk - sq + right
    assert torch.equal(m.to_dense()[0, 0], want)
    check_contract(m)


@pytest.mark.parametrize(
    "n,window,g,causal",
    [
        (200, 20, 16, False),
        (200, 20, 16, True),
        (97, (3, 40), 0, False),
        (64, 0, 64, True),
        (150, 130, 5, False),
    ],
)
def test_local_global(n, window, g, causal):
    m = BlockMask.local_global(n, window, g, causal=causal, block_size=32)
    i, j = _ij(n, n)
    left, right = (window, window) if isinstance(window, int) else window
    want = ((j >= i - left) & (j <= i + right)) | (j < g) | (i < g)
    if causal:
        want &= j <= i
    assert torch.equal(m.to_dense()[0, 0], want)
    check_contract(m)


@pytest.mark.parametrize(
    "n,stride,causal", [(100, 8, True), (100, 8, False), (77, 16, True), (64, 1, True), (90, 40, False)]
)
def test_strided(n, stride, causal):
    m = BlockMask.strided(n, stride, causal=causal, block_size=16)
    i, j = _ij(n, n)
    want = ((i - j).abs() < stride) | ((i - j) % stride == 0)
    if causal:
        want &= j <= i
    assert torch.equal(m.to_dense()[0, 0], want)
    check_contract(m)


@pytest.mark.parametrize("causal", [False, True])
def test_document_from_cu_seqlens_and_ids(causal):
    cu = torch.tensor([0, 30, 31, 31, 95, 130], dtype=torch.int32)
    m = BlockMask.document(cu, causal=causal, block_size=(16, 32))
    ids = torch.repeat_interleave(torch.arange(5), cu[1:] - cu[:-1])
    i, j = _ij(130, 130)
    want = ids[i] == ids[j]
    if causal:
        want &= j <= i
    assert torch.equal(m.to_dense()[0, 0], want)
    check_contract(m)
    assert torch.equal(
        BlockMask.document(document_ids=ids, causal=causal, block_size=(16, 32)).to_dense(), m.to_dense()
    )
    # unsorted ids: tokens with equal ids attend to each other wherever they are
    shuffled = torch.tensor([2, 0, 2, 1, 1, 0, 2] * 10)
    m2 = BlockMask.document(document_ids=shuffled, block_size=16)
    assert torch.equal(m2.to_dense()[0, 0], shuffled[:, None] == shuffled[None, :])
    check_contract(m2)


def test_tree():
    parents = [-1, 0, 0, 1, 1, 2, -1, 6, 3]
    prefix = 37
    m = BlockMask.tree(parents, prefix, block_size=16)
    t = len(parents)
    assert m.shape == (1, 1, t, prefix + t)
    want = torch.zeros(t, prefix + t, dtype=torch.bool)
    want[:, :prefix] = True
    for i in range(t):
        a = i
        while a >= 0:
            want[i, prefix + a] = True
            a = parents[a]
    assert torch.equal(m.to_dense()[0, 0], want)
    # causal in the bottom-right sense: a tree token never sees a later one
    assert not (m.to_dense()[0, 0] & ~BlockMask.causal(t, prefix + t, block_size=16).to_dense()[0, 0]).any()
    check_contract(m)


def test_from_mask_mod_per_batch_and_head():
    table = torch.rand(2, 3, 5, 7) < 0.5

    def mask_mod(b, h, q, kv):
        return table[b, h, q // 20, kv // 15] & ((q + kv + h) % 3 != 0)

    m = BlockMask.from_mask_mod(mask_mod, 2, 3, 90, 100, block_size=(32, 16))
    b, h = torch.arange(2).view(-1, 1, 1, 1), torch.arange(3).view(1, -1, 1, 1)
    q, kv = torch.arange(90).view(1, 1, -1, 1), torch.arange(100).view(1, 1, 1, -1)
    assert torch.equal(m.to_dense(), mask_mod(b, h, q, kv))
    check_contract(m)
    shared = BlockMask.from_mask_mod(lambda b, h, q, kv: kv <= q, None, None, 50, 50, block_size=16)
    assert shared.shape == (1, 1, 50, 50)
    assert torch.equal(shared.to_dense(), BlockMask.causal(50, 50, block_size=16).to_dense())


def test_from_blocks_and_from_kv_blocks():
    blocks = torch.rand(2, 1, 4, 5) < 0.5
    m = BlockMask.from_blocks(blocks, 60, 70, block_size=16)
    want = blocks.repeat_interleave(16, 2).repeat_interleave(16, 3)[..., :60, :70]
    assert torch.equal(m.to_dense(), want)
    check_contract(m)
    kt = m.to_kernel_tensors()
    again = BlockMask.from_kv_blocks(
        kt.kv_part_num,
        kt.kv_part_idx,
        kt.kv_full_num,
        kt.kv_full_idx,
        seqlen_q=60,
        seqlen_k=70,
        block_size=16,
        mask_mod=lambda b, h, q, kv: kv < 70,
    )
    assert torch.equal(again.to_dense(), want)


def test_from_flex_matches_from_mask_mod():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")

    def mask_mod(b, h, q, kv):
        return ((kv <= q) & (q - kv < 40)) | (kv < 8)

    fm = flex.create_block_mask(mask_mod, None, None, 100, 130, device="cpu", BLOCK_SIZE=32)
    a = BlockMask.from_flex(fm)
    b = BlockMask.from_mask_mod(mask_mod, None, None, 100, 130, block_size=32)
    assert torch.equal(a.to_dense(), b.to_dense())
    assert torch.equal(a.block_state, b.block_state)


# -- combinators, re-blocking, inspection


def test_and_or_are_exact_and_broadcast():
    sq, sk = 90, 110
    a = BlockMask.causal(sq, sk, block_size=16)
    b = BlockMask.from_dense(torch.rand(1, 3, sq, sk) < 0.3, block_size=16)
    c = BlockMask.sliding_window(sq, sk, (10, 10), block_size=16)
    for x, y in ((a, b), (b, c), (a, c)):
        assert torch.equal((x & y).to_dense(), x.to_dense() & y.to_dense())
        assert torch.equal((x | y).to_dense(), x.to_dense() | y.to_dense())
        check_contract(x & y)
        check_contract(x | y)
    assert (a & b).shape == (1, 3, sq, sk)
    # partial | partial can become full, partial & partial empty: the states are recomputed
    left = BlockMask.from_dense(torch.arange(32).view(1, -1).expand(32, 32) < 7, block_size=32)
    right = BlockMask.from_dense(torch.arange(32).view(1, -1).expand(32, 32) >= 7, block_size=32)
    doc = torch.repeat_interleave(torch.arange(4), torch.tensor([20, 30, 25, 15]))
    assert (left | right).num_blocks() == {"empty": 0, "partial": 0, "full": 1}
    assert (left & right).num_blocks() == {"empty": 1, "partial": 0, "full": 0}
    d = BlockMask.document(document_ids=doc, block_size=16)
    i, j = _ij(90, 90)
    assert torch.equal(
        (d & BlockMask.causal(90, 90, block_size=16)).to_dense()[0, 0],
        (doc[:, None] == doc[None, :]) & (j <= i),
    )


@pytest.mark.parametrize("new", [(16, 16), (64, 32), (32, 128), (256, 16)])
def test_with_block_size_keeps_the_elements(new):
    m = BlockMask.local_global(150, 12, 10, causal=True, block_size=32) | BlockMask.strided(
        150, 50, block_size=32
    )
    r = m.with_block_size(new)
    assert r.block_size == new
    assert torch.equal(r.to_dense(), m.to_dense())
    check_contract(r)


def test_dense_rows_slice():
    holes = BlockMask.from_dense(torch.rand(2, 1, 150, 150) < 0.8, block_size=32)
    m = BlockMask.local_global(150, 12, 10, block_size=32) & holes
    full = m.to_dense()
    for r0, r1 in ((0, 150), (5, 6), (31, 97), (140, 150)):
        assert torch.equal(m.to_dense(rows=(r0, r1)), full[:, :, r0:r1])
    with pytest.raises(ValueError, match="rows must be"):
        m.to_dense(rows=(10, 10))


def test_density():
    m = BlockMask.causal(100, 100, block_size=32)
    dense = m.to_dense()
    assert m.density("element") == pytest.approx(dense.float().mean().item())
    assert m.density() == pytest.approx(10 / 16)  # 4 x 4 tiles, the upper triangle without diagonal empty
    assert BlockMask.full(100, 100, block_size=32).density() == 1.0
    with pytest.raises(ValueError, match="level"):
        m.density("tiles")


def test_density_is_a_property_that_stays_callable():
    m = BlockMask.causal(100, block_size=32)
    assert isinstance(m.density, float) and m.density == pytest.approx(10 / 16)
    assert m.density() == m.density == m.density("block")
    assert f"{m.density:.2f}" == "0.62" and m.density < 0.7
    assert m.density("element") == pytest.approx(m.to_dense().float().mean().item())


def test_seqlen_k_defaults_to_seqlen_q():
    # self-attention constructors take one length, as local_global does
    one, two = BlockMask.causal(77, block_size=16), BlockMask.causal(77, 77, 16)
    assert torch.equal(one.to_dense(), two.to_dense())
    assert torch.equal(BlockMask.full(50).to_dense(), BlockMask.full(50, 50).to_dense())
    assert BlockMask.causal(40, 90).shape == (1, 1, 40, 90)


def test_kernel_tensors_cached_and_moved():
    m = BlockMask.causal(64, 64, block_size=16)
    assert m.to_kernel_tensors() is m.to_kernel_tensors("cpu")
    assert m.to(torch.device("cpu")) is m
    assert "BlockMask(shape=(1, 1, 64, 64)" in repr(m)


def test_empty_everything():
    m = BlockMask.from_dense(torch.zeros(40, 50, dtype=torch.bool), block_size=16)
    kt = m.to_kernel_tensors()
    assert int(kt.kv_full_num.sum()) == 0 and int(kt.kv_part_num.sum()) == 0
    assert kt.kv_full_idx.shape[-1] == 1  # at least one slot: no zero-size tensors reach the kernels
    check_contract(m)


# -- random masks


@settings(max_examples=30, deadline=None)
@given(
    sq=st.integers(1, 70),
    sk=st.integers(1, 70),
    nb=st.sampled_from([1, 2]),
    nh=st.sampled_from([1, 2]),
    bm=st.sampled_from([16, 32]),
    bn=st.sampled_from([16, 32]),
    p=st.floats(0.0, 1.0),
    seed=st.integers(0, 99),
    blocky=st.booleans(),
)
def test_random_round_trip(sq, sk, nb, nh, bm, bn, p, seed, blocky):
    g = torch.Generator().manual_seed(seed)
    if blocky:  # whole tiles on or off, with holes: many full and empty blocks
        tiles = torch.rand(nb, nh, -(-sq // bm), -(-sk // bn), generator=g) < p
        dense = tiles.repeat_interleave(bm, 2).repeat_interleave(bn, 3)[..., :sq, :sk].clone()
        dense &= torch.rand(nb, nh, sq, sk, generator=g) < 0.97
    else:
        dense = torch.rand(nb, nh, sq, sk, generator=g) < p
    m = BlockMask.from_dense(dense, block_size=(bm, bn))
    assert torch.equal(m.to_dense(), dense)
    check_contract(m)


# -- validation


@pytest.mark.parametrize("bs", [8, 48, 512, (16, 24), (0, 16), "128", (16, 16, 16)])
def test_bad_block_size(bs):
    with pytest.raises(ValueError, match="block_size"):
        BlockMask.causal(64, 64, block_size=bs)


def test_bad_lists():
    num = torch.tensor([[[2, 1]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 2], [1, 0]]]], dtype=torch.int32)
    kw = dict(seqlen_q=32, seqlen_k=48, block_size=16)
    BlockMask.from_kv_blocks(num, idx, **kw)  # valid
    with pytest.raises(ValueError, match=r"kv_idx is not sorted strictly ascending"):
        BlockMask.from_kv_blocks(num, torch.tensor([[[[2, 0], [1, 0]]]]), **kw)
    with pytest.raises(ValueError, match=r"kv_idx holds block indices in \[0, 3\]; expected 0 <= index < 3"):
        BlockMask.from_kv_blocks(num, torch.tensor([[[[0, 3], [1, 0]]]]), **kw)
    with pytest.raises(ValueError, match=r"kv_num has values in \[1, 3\]"):
        BlockMask.from_kv_blocks(torch.tensor([[[3, 1]]]), idx, **kw)
    with pytest.raises(ValueError, match=r"kv_num has shape \(1, 1, 2\); expected \(1, 1, 1\).*block size"):
        BlockMask.from_kv_blocks(num, idx, seqlen_q=32, seqlen_k=48, block_size=32)
    with pytest.raises(ValueError, match="both in kv_idx"):
        BlockMask.from_kv_blocks(num, idx, torch.tensor([[[1, 0]]]), torch.tensor([[[[2], [0]]]]), **kw)
    with pytest.raises(ValueError, match="integer tensor"):
        BlockMask.from_kv_blocks(num.float(), idx, **kw)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match=r"parents\[2\] is 2; expected -1"):
        BlockMask.tree([-1, 0, 2], 4)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        BlockMask.document(torch.tensor([1, 5, 9]))
    with pytest.raises(ValueError, match="exactly one of"):
        BlockMask.document()
    with pytest.raises(ValueError, match=r"mask\[None\]"):
        BlockMask.from_dense(torch.ones(2, 3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool tensor"):
        BlockMask.from_dense(torch.ones(3, 4))
    with pytest.raises(ValueError, match="window left must be an int >= -1"):
        BlockMask.sliding_window(8, 8, (-2, 0))
    with pytest.raises(ValueError, match="seqlen_q must be an int >= 1"):
        BlockMask.causal(0, 8)
    with pytest.raises(ValueError, match="stride must be an int >= 1"):
        BlockMask.strided(8, 0)
    with pytest.raises(ValueError, match=r"blocks has shape \(1, 1, 2, 2\); expected \(\.\.\., 2, 3\)"):
        BlockMask.from_blocks(torch.ones(2, 2, dtype=torch.bool), 32, 48, block_size=16)
    with pytest.raises(ValueError, match="cannot combine"):
        BlockMask.causal(32, 32, block_size=16) & BlockMask.causal(32, 32, block_size=32)
