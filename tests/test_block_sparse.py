"""block_sparse_attn_func against a dense-mask fp64 oracle (forward, LSE, gradients), with the tolerance rule.

Also: fully masked rows, GQA, softcap, dropout (the flash_attn keep-mask convention), token trees against
per-token flash_attn_func calls, agreement with flash_attn_func for causal / window masks, bounded memory,
validation messages, torch.compile and the registered ops. On the CPU the op runs the torch path (or the
Triton kernels under TRITON_INTERPRET=1 once they support block sparsity: the shapes here stay small).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from utils import INTERPRET, LaunchRecorder, assert_close_to_ref, make_qkv, program_pairs, use_tiles

import flashattn
from flashattn import backends
from flashattn import config as flashattn_config
from flashattn.backends.torch import block_sparse as torch_block_sparse
from flashattn.block_sparse import block_sparse_attn_func
from flashattn.kernels.triton.attn_sparse import _program
from flashattn.masks import BlockMask, MaskRule
from flashattn.ops import block_sparse as ops
from flashattn.ops import registry
from flashattn.reference import masked_attention_ref as dense_mask_attention


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def check_against_oracle(q, k, v, mask, *, grads=True, **kw):
    """Forward, LSE and (optionally) gradients within the tolerance rule."""
    q, k, v = _leaves(q, k, v)
    out, lse, _ = block_sparse_attn_func(q, k, v, mask, return_attn_probs=True, **kw)
    dense = mask.to_dense()
    q64, k64, v64 = _leaves(q.double(), k.double(), v.double())
    ref, lse_ref = dense_mask_attention(q64, k64, v64, dense, **kw)
    qp, kp, vp = _leaves(q, k, v)
    pt, _ = dense_mask_attention(qp, kp, vp, dense, upcast=False, **kw)
    assert_close_to_ref(out, ref, pt, name="out")
    assert_close_to_ref(lse, lse_ref, lse_ref.float(), atol_floor=1e-4, name="lse")
    empty_rows = ~dense.any(-1)  # (B|1, H|1, sq)
    assert (out.transpose(1, 2)[empty_rows.expand(out.shape[0], out.shape[2], -1)] == 0).all()
    if not grads:
        return
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    base = torch.autograd.grad(pt, (qp, kp, vp), dout.to(pt.dtype))
    for name, g, r, p in zip(("dq", "dk", "dv"), got, want, base, strict=True):
        assert_close_to_ref(g, r, p, factor=3.0, name=name)


PATTERNS = {
    "causal_sq<sk": lambda sq, sk, bs: BlockMask.causal(sq, sk, block_size=bs),
    "window": lambda sq, sk, bs: BlockMask.sliding_window(sq, sk, (24, 9), block_size=bs),
    "causal_window": lambda sq, sk, bs: BlockMask.sliding_window(sq, sk, (40, -1), causal=True,
                                                                 block_size=bs),
    "random_per_head": lambda sq, sk, bs: BlockMask.from_dense(
        torch.rand(1, 4, sq, sk, generator=torch.Generator().manual_seed(1)) < 0.2, block_size=bs),
    "random_blocks": lambda sq, sk, bs: BlockMask.from_blocks(
        torch.rand(2, 1, -(-sq // bs[0]), -(-sk // bs[1]), generator=torch.Generator().manual_seed(2)) < 0.4,
        sq, sk, block_size=bs),
}


# every pattern in fp32, two in the 16-bit dtypes (computed in fp32 inside: the dtype only moves the inputs)
CASES = [(p, torch.float32) for p in PATTERNS] + [
    (p, dt) for p in ("causal_sq<sk", "random_per_head") for dt in (torch.float16, torch.bfloat16)]


@pytest.mark.parametrize("pattern,dtype", CASES)
def test_matches_dense_oracle(pattern, dtype):
    interpreted = backends.backend_name(torch.empty(0)) == "triton" and not torch.cuda.is_available()
    if dtype == torch.bfloat16 and interpreted:
        pytest.skip("the Triton interpreter computes bf16 wrong (numpy has no bf16); the GPU covers bf16")
    sq, sk, bs = 70, 113, (32, 16)
    q, k, v = make_qkv(2, sq, sk, 4, 2, 40, dtype=dtype, generator=torch.Generator().manual_seed(0))
    check_against_oracle(q, k, v, PATTERNS[pattern](sq, sk, bs))


RULE_MASKS = {  # the constructors whose partial blocks the Triton kernels compute from a MaskRule
    "local_global": lambda n, bs: BlockMask.local_global(n, (20, 7), 19, block_size=bs),
    "local_global_causal": lambda n, bs: BlockMask.local_global(n, 24, 40, causal=True, block_size=bs),
    "local_global_left_only": lambda n, bs: BlockMask.local_global(n, (30, -1), 5, block_size=bs),
    "causal": lambda n, bs: BlockMask.causal(n - 9, n, block_size=bs),
    "window_sq>sk": lambda n, bs: BlockMask.sliding_window(n + 13, n, (11, 3), block_size=bs),
    "full_tail": lambda n, bs: BlockMask.full(n, n, block_size=bs),
}


@pytest.mark.parametrize("name", RULE_MASKS)
def test_rule_masks_match_oracle_and_bits(name):
    """The public call against the oracle (where the mask is a band, through the dense kernels:
    tests/backends/triton/test_block_sparse_routes.py), and the block-sparse kernels on the route that takes
    partial blocks by the rule against the oracle too, and bitwise equal to the route that reads the
    bitmasks: the two differ only in where the predicate comes from."""
    n, bs = 83, (32, 16)
    mask = RULE_MASKS[name](n, bs)
    assert mask.to_kernel_tensors().rule is not None
    sq, sk = mask.seqlen_q, mask.seqlen_k
    q, k, v = make_qkv(1, sq, sk, 4, 2, 32, dtype=torch.float32, generator=torch.Generator().manual_seed(3))
    check_against_oracle(q, k, v, mask)
    if backends.backend_name(q) != "triton":
        return
    from flashattn.backends.triton import block_sparse as launchers

    kt = mask.to_kernel_tensors(q.device)
    rule = launchers.triton_route(q, v, kt)
    assert rule.by_rule
    dout = torch.randn_like(q)
    runs = []
    for route in (rule, dataclasses.replace(rule, by_rule=False)):
        out, lse = launchers.block_sparse_forward(q, k, v, kt, softmax_scale=32 ** -0.5, route=route)
        grads = launchers.block_sparse_backward(dout, q, k, v, out, lse, kt, softmax_scale=32 ** -0.5,
                                                route=route)
        runs.append((out, lse, *grads))
    ref, _ = dense_mask_attention(q.double(), k.double(), v.double(), mask.to_dense())
    pt, _ = dense_mask_attention(q, k, v, mask.to_dense(), upcast=False)
    assert_close_to_ref(runs[0][0], ref, pt, name="out")
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_backward_one_launch_per_role(monkeypatch):
    """The backward's dK/dV and dQ programs run as two launches of one kernel, whatever warps each role's
    tile config asks for, and the gradients do not depend on the warps."""
    mask = BlockMask.local_global(90, (12, 5), 7, block_size=(32, 16))
    q, k, v = make_qkv(1, 90, 90, 4, 2, 32, dtype=torch.float16, generator=torch.Generator().manual_seed(4))
    if backends.backend_name(q) != "triton":
        pytest.skip("the Triton launchers run on CUDA or under TRITON_INTERPRET=1")
    from flashattn.backends.triton import block_sparse as launchers

    counts = []
    runs = []
    for spec in ("dkdv=16,32,4,1;dq=32,16,4,1", "dkdv=16,32,4,1;dq=32,16,2,1"):
        use_tiles(monkeypatch, spec)
        calls = []
        kernel = launchers.sparse_bwd_kernel
        monkeypatch.setattr(launchers, "sparse_bwd_kernel", LaunchRecorder(kernel, calls))
        qq, kk, vv = _leaves(q, k, v)
        out = block_sparse_attn_func(qq, kk, vv, mask)
        runs.append(torch.autograd.grad(out, (qq, kk, vv), torch.ones_like(out)))
        counts.append(len(calls))
        monkeypatch.setattr(launchers, "sparse_bwd_kernel", kernel)
    assert counts == [2, 2]
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_rule_follows_the_mask():
    lg = BlockMask.local_global(256, (20, 7), 19, causal=True, block_size=32)
    rule = lg.to_kernel_tensors().rule
    assert (rule.diag, rule.left, rule.right, rule.global_tokens, rule.global_causal) == (0, 20, 0, 19, True)
    assert BlockMask.causal(100, 160).to_kernel_tensors().rule.as_list() == [1, 60, -1, 0, 0, 0]
    assert BlockMask.sliding_window(50, 50, (-1, 4)).to_kernel_tensors().rule.as_list() == [1, 0, -1, 4, 0, 0]
    assert MaskRule.from_list(rule.as_list()) == rule and MaskRule.from_list(MaskRule.NONE) is None
    # kept where the element mask is unchanged, dropped where it is rebuilt from bits
    assert lg.with_block_size(64).to_kernel_tensors().rule == rule
    assert lg.to("cpu").to_kernel_tensors().rule == rule
    assert (lg & BlockMask.causal(256, 256, block_size=32)).to_kernel_tensors().rule is None
    assert BlockMask.from_dense(lg.to_dense(), block_size=32).to_kernel_tensors().rule is None
    assert BlockMask.strided(256, 16, block_size=32).to_kernel_tensors().rule is None


@pytest.mark.parametrize("softcap,scale", [(3.0, None), (0.0, 0.3), (1.5, 0.9)])
def test_softcap_and_scale(softcap, scale):
    n = 96
    q, k, v = make_qkv(1, n, n, 2, 1, 32, generator=torch.Generator().manual_seed(1), scale=2.0)
    mask = BlockMask.local_global(n, 10, 8, causal=True, block_size=16)
    check_against_oracle(q, k, v, mask, softcap=softcap, softmax_scale=scale)


def test_document_and_strided_inputs():
    cu = torch.tensor([0, 17, 60, 61, 100])
    q, k, v = make_qkv(2, 100, 100, 3, 3, 24, layout="strided", generator=torch.Generator().manual_seed(2))
    assert not q.is_contiguous()
    check_against_oracle(q, k, v, BlockMask.document(cu, causal=True, block_size=(16, 32)))
    check_against_oracle(q, k, v, BlockMask.strided(100, 12, block_size=16))


def test_fully_masked_rows_and_empty_mask():
    sq, sk = 50, 40
    dense = torch.rand(1, 1, sq, sk, generator=torch.Generator().manual_seed(3)) < 0.3
    dense[..., 5:20, :] = False  # a band of rows that see nothing
    q, k, v = make_qkv(2, sq, sk, 2, 2, 16, generator=torch.Generator().manual_seed(3))
    check_against_oracle(q, k, v, BlockMask.from_dense(dense, block_size=16))
    # causal with sq > sk: the first sq - sk rows see nothing
    check_against_oracle(q, k, v, BlockMask.causal(sq, sk, block_size=16))
    q, k, v = _leaves(q, k, v)
    none = BlockMask.from_dense(torch.zeros(sq, sk, dtype=torch.bool), block_size=16)
    out, lse, _ = block_sparse_attn_func(q, k, v, none, return_attn_probs=True)
    assert (out == 0).all() and torch.isposinf(lse).all()
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all((g == 0).all() for g in grads)


def test_agrees_with_flash_attn_func():
    q, k, v = make_qkv(2, 90, 130, 4, 2, 32, generator=torch.Generator().manual_seed(4))
    window = BlockMask.sliding_window(90, 130, (17, 5), block_size=(16, 32))
    for mask, kw in ((BlockMask.causal(90, 130, block_size=32), dict(causal=True)),
                     (window, dict(window_size=(17, 5))),
                     (BlockMask.full(90, 130, block_size=64), {})):
        out = block_sparse_attn_func(q, k, v, mask)
        ref = flashattn.flash_attn_func(q, k, v, **kw)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_tree_matches_per_token_attention():
    """Speculative decoding: each tree token attends to the prefix and its ancestors, as if it were decoded
    alone after exactly those tokens."""
    parents = [-1, 0, 0, 1, 1, 2, 5, -1, 7, 3]
    prefix, t = 45, len(parents)
    q, _, _ = make_qkv(1, t, t, 4, 2, 32, generator=torch.Generator().manual_seed(5))
    _, k, v = make_qkv(1, prefix + t, prefix + t, 4, 2, 32, generator=torch.Generator().manual_seed(6))
    mask = BlockMask.tree(parents, prefix, block_size=16)
    out = block_sparse_attn_func(q, k, v, mask)
    for i in range(t):
        keys, a = list(range(prefix)), i
        while a >= 0:
            keys.append(prefix + a)
            a = parents[a]
        keys = sorted(keys)
        alone = flashattn.flash_attn_func(q[:, i:i + 1], k[:, keys], v[:, keys])
        torch.testing.assert_close(out[:, i:i + 1], alone, rtol=1e-5, atol=1e-5)
    check_against_oracle(q, k, v, mask)


def test_dropout_uses_the_keep_mask_it_returns():
    n, p = 64, 0.25
    q, k, v = make_qkv(2, n, n, 2, 1, 16, generator=torch.Generator().manual_seed(7))
    mask = BlockMask.sliding_window(n, n, (20, 3), block_size=16)
    q, k, v = _leaves(q, k, v)
    torch.manual_seed(11)
    out, _, keep = block_sparse_attn_func(q, k, v, mask, dropout_p=p, return_attn_probs=True)
    assert keep.shape == (2, 2, n, n) and 0.6 < keep.float().mean() < 0.9
    q64, k64, v64 = _leaves(q.double(), k.double(), v.double())
    ref, _ = dense_mask_attention(q64, k64, v64, mask.to_dense(), keep=keep, dropout_p=p)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), r, rtol=0, atol=1e-5)
    torch.manual_seed(11)
    again = block_sparse_attn_func(q, k, v, mask, dropout_p=p)
    assert torch.equal(again, out)


@settings(max_examples=20, deadline=None)
@given(
    sq=st.integers(1, 60), sk=st.integers(1, 60), hk=st.sampled_from([1, 2]), group=st.sampled_from([1, 2]),
    mask_heads=st.booleans(), bm=st.sampled_from([16, 32]), bn=st.sampled_from([16, 32]),
    density=st.floats(0.0, 1.0), seed=st.integers(0, 999),
)
def test_random_masks(sq, sk, hk, group, mask_heads, bm, bn, density, seed):
    g = torch.Generator().manual_seed(seed)
    h = hk * group
    dense = torch.rand(2, h if mask_heads else 1, sq, sk, generator=g) < density
    q, k, v = make_qkv(2, sq, sk, h, hk, 16, generator=g)
    check_against_oracle(q, k, v, BlockMask.from_dense(dense, block_size=(bm, bn)))


def test_memory_stays_below_dense(monkeypatch):
    """With a small step budget no tensor of the torch path reaches seqlen_q x seqlen_k elements. (The torch
    backend is forced: under TRITON_INTERPRET=1 the Triton path runs, whose interpreter copies whole storages
    through torch ops, and eager calls no longer hide them behind the custom op.)"""
    monkeypatch.setattr(flashattn_config, "backend", "torch")
    monkeypatch.setitem(torch_block_sparse._STEP_BUDGET, "cpu", 16 * 16 * 8)
    n = 256
    q, k, v = _leaves(*make_qkv(1, n, n, 1, 1, 16, generator=torch.Generator().manual_seed(8)))
    mask = BlockMask.local_global(n, 24, 16, block_size=16)

    class Largest(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for t in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(t, torch.Tensor):
                    Largest.biggest = max(Largest.biggest, t.numel())
            return result

    with Largest():
        out = block_sparse_attn_func(q, k, v, mask)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert 0 < Largest.biggest < n * n // 4


def test_empty_tiles_cost_no_matmul():
    class Matmuls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.bmm, torch.ops.aten.mm):
                Matmuls.count += 1
            return func(*args, **(kwargs or {}))

    q, k, v = _leaves(*make_qkv(1, 64, 64, 2, 2, 16))
    none = BlockMask.from_dense(torch.zeros(64, 64, dtype=torch.bool), block_size=16)
    with Matmuls():
        out = block_sparse_attn_func(q, k, v, none)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert Matmuls.count == 0


def test_validation_messages():
    q, k, v = make_qkv(2, 64, 80, 4, 2, 16)
    with pytest.raises(TypeError, match="block_mask must be a flashattn.BlockMask"):
        block_sparse_attn_func(q, k, v, torch.ones(64, 80, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"block_mask is for \(seqlen_q, seqlen_k\) = \(64, 64\) but q and k "
                                         r"have \(64, 80\)"):
        block_sparse_attn_func(q, k, v, BlockMask.causal(64, 64))
    with pytest.raises(ValueError, match="block_mask has batch 3 but q has batch 2"):
        block_sparse_attn_func(q, k, v, BlockMask.from_dense(torch.ones(3, 1, 64, 80, dtype=torch.bool)))
    with pytest.raises(ValueError, match="block_mask has 2 heads but q has 4 query heads"):
        block_sparse_attn_func(q, k, v, BlockMask.from_dense(torch.ones(1, 2, 64, 80, dtype=torch.bool)))
    with pytest.raises(ValueError, match="dropout_p"):
        block_sparse_attn_func(q, k, v, BlockMask.causal(64, 80), dropout_p=1.0)


def test_the_torch_backend_serves_its_calls(monkeypatch):
    from flashattn.backends.torch import entry as torch_entry

    monkeypatch.setattr(flashattn_config, "backend", "torch")
    assert backends.entry(torch.zeros(1)) is torch_entry


def _loss(q, k, v, mask):
    return block_sparse_attn_func(q, k, v, mask, softcap=2.0).square().sum()


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    q, k, v = _leaves(*make_qkv(2, 48, 48, 4, 2, 16, generator=torch.Generator().manual_seed(9)))
    mask = BlockMask.local_global(48, 8, 4, causal=True, block_size=16)
    mask.to_kernel_tensors()  # built outside the graph, as a model would hold it
    compiled = torch.compile(_loss, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v, mask)
    want = _loss(q, k, v, mask)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(torch.autograd.grad(got, (q, k, v)), torch.autograd.grad(want, (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch._dynamo.reset()


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "flashattn":
            self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def test_eager_calls_skip_the_registered_ops_and_match_them(monkeypatch):
    # eager calls run the op bodies through a plain autograd.Function (the custom-op dispatch costs more host
    # time than a sparse mask's kernels); torch.compile goes through the ops: both must compute the same
    q, k, v = make_qkv(1, 40, 40, 2, 1, 16, generator=torch.Generator().manual_seed(11))
    mask = BlockMask.local_global(40, 6, 3, block_size=16)
    dout = torch.randn(1, 40, 2, 16, generator=torch.Generator().manual_seed(12))
    results = {}
    for through_ops in (False, True):
        monkeypatch.setattr(registry, "_registered_only", through_ops)
        leaves = _leaves(q, k, v)
        with _RecordOps() as rec:
            out = block_sparse_attn_func(*leaves, mask, softcap=3.0)
            grads = torch.autograd.grad(out, leaves, dout)
        results[through_ops] = (out, *grads)
        ops = {"flashattn::block_sparse_fwd", "flashattn::block_sparse_bwd"}
        assert (ops <= set(rec.names)) if through_ops else not ops & set(rec.names)
    for a, b in zip(results[False], results[True], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("through_ops", [False, True])
def test_deterministic_reaches_the_backward(monkeypatch, through_ops):
    """block_sparse_attn_func's deterministic goes to the backend's backward (which picks kernels by it),
    eager and through the registered ops; the forward is the same either way."""
    monkeypatch.setattr(registry, "_registered_only", through_ops)
    q, k, v = make_qkv(1, 40, 40, 2, 1, 16, generator=torch.Generator().manual_seed(13))
    mask = BlockMask.from_mask_mod(lambda b, h, i, j: (i + j) % 3 != 0, 1, 1, 40, 40, block_size=16)
    backend = backends.entry(q)
    seen = []
    real = backend.block_sparse_backward
    monkeypatch.setattr(backend, "block_sparse_backward",
                        lambda *a, **kw: seen.append(kw["deterministic"]) or real(*a, **kw))
    outs = []
    for deterministic in (False, True):
        leaves = _leaves(q, k, v)
        out = block_sparse_attn_func(*leaves, mask, deterministic=deterministic)
        torch.autograd.grad(out.sum(), leaves)
        outs.append(out)
    assert seen == [False, True]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_opcheck():
    q, k, v = make_qkv(1, 40, 56, 2, 1, 16, generator=torch.Generator().manual_seed(10))
    q, k, v = _leaves(q, k, v)
    kt = BlockMask.sliding_window(40, 56, (10, 10), block_size=16).to_kernel_tensors()
    args = (q, k, v, kt.tensors(), kt.block_m, kt.block_n, kt.rule.as_list(), kt.partial_permille, 0.25, 1.0,
            0.0, False)
    # aot_dispatch is what test_torch_compile_fullgraph_matches_eager exercises, at a fraction of the cost
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(ops.block_sparse_fwd.library_op, args, test_utils=utils)
    out, lse, rng = ops.block_sparse_fwd(*args)
    bwd_args = (torch.randn_like(out), q, k, v, out, lse, rng, *args[3:])
    torch.library.opcheck(ops.block_sparse_bwd.library_op, bwd_args, test_utils=utils)


# -- the `sparse` bench suite (CPU smoke: the harness, the oracle, the masks flex gets)


def _sparse_cases(n=200, densities=(0.5,)):
    from flashattn.bench.suites import sparse

    grid = sparse.SparseGrid(dtype="fp32", seqlens=(n,), headdims=(32,), causal=(False,), batch=1, nheads=2,
                             densities=densities)
    return sparse.build_cases(grid)


def test_sparse_suite_grid():
    from flashattn.bench import suites
    from flashattn.bench.providers.sparse import MaskSpec, random_blocks
    from flashattn.bench.suites import sparse

    suite = suites.get("sparse")
    assert isinstance(suite, sparse.SparseSuite)
    assert suite.providers == ("flashattn-sparse", "flashattn", "flex-sparse")
    assert suite.modes == ("fwd", "fwd+bwd")
    grid = sparse._grid(False)
    assert (grid.seqlens, grid.densities) == ((16384, 65536), sparse.DENSITIES)
    assert (grid.nheads, grid.headdims, grid.dtype) == (16, (128,), "bf16")
    for n in grid.seqlens:  # the parameters hit their target densities (the masks are built on the device)
        for t in grid.densities:
            w, g = sparse.local_global_params(n, t)
            assert abs(sparse._local_global_density(n, w, g, 128) - t) < 0.01
            assert abs(random_blocks(MaskSpec("random", n, 1, target_density=t)).float().mean() - t) < 0.01
    quick = sparse.build_cases(sparse._grid(True))
    assert [c.extra["pattern"] for c in quick] == ["dense", "causal"] + ["local_global"] * 2 + ["random"] * 2
    assert all(abs(c.extra["density"] - c.extra["target_density"]) < 0.02 for c in quick)


def test_sparse_suite_runs_and_checks_on_cpu(monkeypatch):
    from flashattn.bench import providers, runner
    from flashattn.bench.providers.base import Prepared, Provider, make_leaves
    from flashattn.bench.suites import sparse
    from flashattn.bench.timing import TimerConfig

    # a provider that ignores the mask must be caught by the suite's oracle
    def unmasked(case, q, k, v):
        leaves = make_leaves(q, k, v, "bshd")
        return Prepared(fwd=lambda: flashattn.flash_attn_func(*leaves), leaves=leaves)

    # the harness is under test here, not the kernels: the interpreter would only make it slow
    monkeypatch.setattr(flashattn_config, "backend", "torch")
    providers.register(Provider("test-unmasked", unmasked, "test double"), replace=True)
    try:
        names = ["flashattn-sparse", "flashattn", "test-unmasked"]
        timer = TimerConfig(cpu_min_reps=1, cpu_max_reps=1, cpu_budget_s=0.0)
        cases = [c for c in _sparse_cases() if c.extra["pattern"] in ("dense", "local_global")]
        cfg = runner.RunConfig(sparse.SUITE, cases, names, ("fwd", "fwd+bwd"), torch.device("cpu"), timer,
                               quiet=True)
        rows = runner.Runner(cfg).run()["rows"]
    finally:
        providers.unregister("test-unmasked")
    sparse.annotate(rows)
    by = {(r["provider"], r["pattern"], r["mode"]): r for r in rows}
    for pattern in ("dense", "local_global"):
        for mode in ("fwd", "fwd+bwd"):
            r = by["flashattn-sparse", pattern, mode]
            assert r["error"] is None and r["ms"] > 0 and r["speedup_vs_dense"] > 0, r
            assert r["density"] is not None and r["tflops"] > 0
    assert by["flashattn", "dense", "fwd+bwd"]["speedup_vs_dense"] == 1.0
    skipped = by["flashattn", "local_global", "fwd"]["error"]
    assert skipped.startswith("skipped: the dense kernel cannot express")
    causal, random = (c for c in _sparse_cases() if c.extra["pattern"] in ("causal", "random"))
    assert sparse._skip(causal, "flashattn") is None and sparse._skip(random, "flashattn") is not None
    assert by["test-unmasked", "local_global", "fwd"]["error"].startswith("wrong result")
    assert by["test-unmasked", "dense", "fwd"]["error"] is None


@pytest.mark.parametrize("pattern,params", [
    ("dense", {}), ("causal", {}), ("local_global", dict(window=40, global_tokens=16)),
    ("random", dict(target_density=0.4, seed=3))])
def test_flex_gets_the_same_mask(pattern, params):
    pytest.importorskip("torch.nn.attention.flex_attention")
    from flashattn.bench.providers import sparse

    spec = sparse.MaskSpec(pattern, 384, 2, **params)
    ours = sparse.block_mask(spec, torch.device("cpu"))
    theirs = BlockMask.from_flex(sparse.flex_block_mask(spec, torch.device("cpu")))
    assert theirs.shape == (1, 2, 384, 384)  # per head always: one flex compilation per N
    assert torch.equal(theirs.to_dense(), ours.to_dense().expand(1, 2, -1, -1))
    # flex on FA4's kernels takes the pattern's own mask_mod (no captured tensors): the same mask
    rule = sparse.pattern_mask_mod(spec.pattern, spec.window, spec.global_tokens)
    fa4s = BlockMask.from_flex(sparse.flex_block_mask(spec, torch.device("cpu"), rule))
    assert torch.equal(fa4s.to_dense(), ours.to_dense().expand(1, 2, -1, -1))
    # flex's FLASH backend drops the block lists where the mask_mod is noop_mask: only the dense mask has it
    from torch.nn.attention.flex_attention import noop_mask

    assert (rule is noop_mask) == (pattern == "dense")


@pytest.mark.parametrize("n_bh, n_blocks, subtiles",
                         [(1, 1, 1), (3, 1, 2), (4, 5, 1), (16, 128, 1), (6, 70, 2)])
def test_program_mapping_covers_every_tile_once(n_bh, n_blocks, subtiles):
    """The kernels' 1D grid (_program with ops.block_sparse._grid's hoist): every (head, tile) pair exactly
    once, the hoisted tiles of all heads before any other, then head by head."""
    if not INTERPRET:
        pytest.skip("runs the Triton helper under TRITON_INTERPRET=1")
    from flashattn.backends.triton.block_sparse import _grid

    (n,), (nbh, n_tiles, hoist) = _grid(n_bh, n_blocks, subtiles)
    assert n == n_bh * n_blocks * subtiles and 0 <= hoist < n_tiles
    pairs = program_pairs(_program, n, nbh, n_tiles, hoist)
    assert sorted(pairs) == [(b, t) for b in range(n_bh) for t in range(n_tiles)]
    lead = n_bh * hoist
    assert all(t < hoist for _, t in pairs[:lead]) and all(t >= hoist for _, t in pairs[lead:])
    rest = pairs[lead:]
    assert [b for b, _ in rest] == sorted(b for b, _ in rest)  # head by head


def test_flex_fa4_provider_needs_cuda_and_says_so():
    # flex on FlashAttention-4's kernels (kernel_options BACKEND=FLASH) runs only where FA4 is installed on
    # a GPU: elsewhere its setup fails with one line the bench reports as the row's error
    from flashattn.bench import providers

    provider = providers.get("flex-fa4-sparse")
    case = _sparse_cases()[0]
    q, k, v = (torch.randn(1, case.seqlen_q, case.nheads, case.headdim) for _ in range(3))
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        provider.setup(case, q, k, v)
