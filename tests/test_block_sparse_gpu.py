"""block_sparse_attn_func on a CUDA GPU at realistic sizes (run on the device with ``pytest -m gpu``).

bf16 / fp16 at N = 4K against the dense-mask fp64 oracle on a slice that is still exact: batch 0, all heads,
a block of the first and a block of the last query rows with every key (the mask rows cut from the
BlockMask), gradients from a dout that is zero outside those rows, so dk / dv hold exactly their
contributions. Tolerance rule as everywhere: 2x (forward) / 3x (gradients) the error of plain PyTorch in the
same precision, plus a floor of two units of rounding. Runs the Triton kernels once flashattn.ops.block_sparse
exists, the torch path before that (both must pass).
"""

from __future__ import annotations

import pytest
import torch
from utils import LaunchRecorder, assert_close_to_ref

from flashattn import BlockMask, block_sparse_attn_func
from flashattn import config as flashattn_config
from flashattn.reference import masked_attention_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

N = 4096
ROWS = ((0, 256), (N - 256, N))


@pytest.fixture(autouse=True)
def force_triton(monkeypatch):
    monkeypatch.setattr(flashattn_config, "backend", "triton")


def _qkv(b, sq, sk, h, hk, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g).requires_grad_()

    return rand(b, sq, h, d), rand(b, sk, hk, d), rand(b, sk, hk, d)


def _eps_floor(dtype, ref):
    return 2 * torch.finfo(dtype).eps * ref.abs().max().item()


def check_slice(q, k, v, mask, rows=ROWS, **kw):
    """Output rows, dq rows and whole dk / dv of batch 0 against the oracle (fp64) and plain PyTorch."""
    out = block_sparse_attn_func(q, k, v, mask, **kw)
    dout = torch.zeros_like(out)
    for r0, r1 in rows:
        dout[:1, r0:r1] = torch.randn_like(out[:1, r0:r1])
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
    # batch > 0 got dout = 0: nothing may leak there
    assert (dq[1:] == 0).all() and (dk[1:] == 0).all() and (dv[1:] == 0).all()

    k0, v0 = k[:1].detach(), v[:1].detach()
    refs = {}
    for upcast in (True, False):
        dtype = torch.float64 if upcast else q.dtype
        kk, vv = k0.to(dtype).requires_grad_(), v0.to(dtype).requires_grad_()
        outs, dqs = [], []
        dk_sum = torch.zeros_like(kk, dtype=torch.float64)
        dv_sum = torch.zeros_like(vv, dtype=torch.float64)
        for r0, r1 in rows:
            qq = q[:1, r0:r1].detach().to(dtype).requires_grad_()
            m = mask.to_dense(rows=(r0, r1))[:1]
            o, _ = masked_attention_ref(qq, kk, vv, m, upcast=upcast, **kw)
            gq, gk, gv = torch.autograd.grad(o, (qq, kk, vv), dout[:1, r0:r1].to(o.dtype))
            outs.append(o.detach())
            dqs.append(gq)
            dk_sum += gk.double()
            dv_sum += gv.double()
        refs[upcast] = (torch.cat(outs, 1), torch.cat(dqs, 1), dk_sum, dv_sum)
    def take(x):
        return torch.cat([x[:1, r0:r1] for r0, r1 in rows], 1)

    got = (take(out), take(dq), dk[:1], dv[:1])
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        ref, pt = refs[True][i], refs[False][i]
        assert_close_to_ref(got[i], ref, pt, factor=2.0 if i == 0 else 3.0,
                            atol_floor=_eps_floor(q.dtype, ref), name=name)


def _random_blocks(h, n, density, block=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = n // block
    table = torch.rand(1, h, nb, nb, generator=g) < density
    return BlockMask.from_blocks(table | torch.eye(nb, dtype=torch.bool), n, n, block_size=block)


MASKS = {
    "causal": lambda h: BlockMask.causal(N, N),
    "local_global": lambda h: BlockMask.local_global(N, 256, 64),
    "random_per_head": lambda h: _random_blocks(h, N, 0.2),
    "document_causal": lambda h: BlockMask.document(torch.tensor([0, N // 4, N // 4 + 1, 3 * N // 4 - 7, N]),
                                                     causal=True),
    "strided": lambda h: BlockMask.strided(N, 128, block_size=(64, 128)),
    "sliding_window_64x64": lambda h: BlockMask.sliding_window(N, N, (300, 0), block_size=64),
}


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_patterns_at_4k(name, dtype):
    q, k, v = _qkv(2, N, N, 8, 2, 128, dtype)  # GQA 4:1
    check_slice(q, k, v, MASKS[name](8))


def test_softcap_odd_headdim_and_non_multiple_length():
    n = 3000  # not a multiple of the tiles: key tail blocks are partial
    q, k, v = _qkv(2, n, n, 4, 4, 72, torch.bfloat16, seed=1)
    mask = BlockMask.local_global(n, 200, 32, causal=True) | BlockMask.strided(n, 500)
    check_slice(q, k, v, mask, rows=((0, 200), (n - 300, n)), softcap=30.0)


def test_tree_after_a_long_prefix():
    parents = [-1] + [i // 2 for i in range(63)]  # a binary tree of 64 draft tokens
    prefix = 4000
    q, _, _ = _qkv(2, 64, 64, 8, 2, 128, torch.bfloat16, seed=2)
    _, k, v = _qkv(2, prefix + 64, prefix + 64, 8, 2, 128, torch.bfloat16, seed=3)
    check_slice(q, k, v, BlockMask.tree(parents, prefix), rows=((0, 64),))


def test_kernel_tensors_move_to_the_gpu():
    mask = BlockMask.local_global(N, 256, 64)  # built on the CPU
    kt = mask.to_kernel_tensors("cuda")
    for name in kt.TENSORS:
        t = getattr(kt, name)
        assert t.is_cuda and t.is_contiguous(), name
    assert mask.to_kernel_tensors(torch.device("cuda")) is kt
    cuda_mask = BlockMask.local_global(N, 256, 64, device="cuda")
    assert torch.equal(cuda_mask.to_dense().cpu(), mask.to_dense())


def test_dropout_matches_its_keep_mask():
    n, p = 1024, 0.2
    q, k, v = _qkv(1, n, n, 4, 2, 64, torch.float16, seed=4)
    mask = BlockMask.local_global(n, 128, 32, block_size=64)
    torch.manual_seed(0)
    out, _, keep = block_sparse_attn_func(q, k, v, mask, dropout_p=p, return_attn_probs=True)
    ref, _ = masked_attention_ref(q.double(), k.double(), v.double(), mask.to_dense().cuda(), keep=keep,
                                  dropout_p=p)
    pt, _ = masked_attention_ref(q, k, v, mask.to_dense().cuda(), keep=keep, dropout_p=p, upcast=False)
    assert_close_to_ref(out, ref, pt, atol_floor=_eps_floor(q.dtype, ref))
    torch.manual_seed(0)
    assert torch.equal(block_sparse_attn_func(q, k, v, mask, dropout_p=p), out)


def test_memory_is_not_quadratic():
    n, h = 32768, 16
    q, k, v = _qkv(1, n, n, h, h, 128, torch.bfloat16, seed=5)
    mask = BlockMask.local_global(n, 512, 64, device="cuda")
    mask.to_kernel_tensors("cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = block_sparse_attn_func(q, k, v, mask)
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    dense_scores = h * n * n * 2  # one bf16 score matrix
    assert peak < dense_scores / 4, f"peak extra memory {peak / 2**30:.2f} GiB"


def test_torch_compile_inductor_matches_eager():
    torch._dynamo.reset()
    q, k, v = _qkv(2, 1024, 1024, 8, 2, 64, torch.bfloat16, seed=6)
    mask = BlockMask.local_global(1024, 100, 16, causal=True, block_size=64, device="cuda")
    mask.to_kernel_tensors("cuda")

    def loss(q, k, v):
        return block_sparse_attn_func(q, k, v, mask).float().square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="inductor")
    got, want = compiled(q, k, v), loss(q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    for a, b in zip(torch.autograd.grad(got, (q, k, v)), torch.autograd.grad(want, (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    torch._dynamo.reset()


def test_cuda_calls_run_the_triton_kernels(monkeypatch):
    # a silent fallback to the torch path would pass every accuracy test above at a fraction of the speed
    from flashattn.backends.triton import entry

    monkeypatch.setattr(flashattn_config, "backend", None)
    calls = []
    real = entry.block_sparse_forward
    monkeypatch.setattr(entry, "block_sparse_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = (torch.randn(1, 256, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    block_sparse_attn_func(q, k, v, BlockMask.causal(256, 256))
    assert calls == [1]



@pytest.mark.parametrize("name, band", [("causal", True), ("sliding_window_64x64", True),
                                        ("local_global", False), ("document_causal", False)])
def test_a_band_mask_runs_the_gluon_kernels(monkeypatch, name, band):
    """A mask that is a band takes the dense call's Gluon forward and backward (DenseBandRoute), any other
    the block-sparse kernels: a fallback either way would pass the accuracy tests above."""
    from flashattn.backends.triton import block_sparse, gluon

    calls = {"gluon": [], "sparse_fwd": [], "sparse_bwd": []}
    for launcher in ("forward", "backward"):
        real = getattr(gluon, launcher)
        monkeypatch.setattr(gluon, launcher, lambda *a, real=real, name=launcher, **kw:
                            calls["gluon"].append(name) or real(*a, **kw))
    for kernel, key in (("sparse_fwd_kernel", "sparse_fwd"), ("sparse_bwd_kernel", "sparse_bwd")):
        monkeypatch.setattr(block_sparse, kernel, LaunchRecorder(getattr(block_sparse, kernel), calls[key]))
    q, k, v = _qkv(1, N, N, 8, 2, 128, torch.bfloat16)
    out = block_sparse_attn_func(q, k, v, MASKS[name](8))
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    if band:
        assert calls == {"gluon": ["forward", "backward"], "sparse_fwd": [], "sparse_bwd": []}
    else:
        assert calls["gluon"] == [] and len(calls["sparse_fwd"]) == 1 and len(calls["sparse_bwd"]) == 2


def _empty_rows_mask(n):
    """Rows below 300 see no key (query block 0 has no listed block at all; block 2 is partly empty), the
    others every 7th key before them: partial blocks only, and the kernel's first-row and empty-row cases."""
    return BlockMask.from_mask_mod(lambda b, h, i, j: (i >= 300) & (j <= i) & ((i - j) % 7 == 0), None, None,
                                   n, n)


def _gqa_inputs(n, d, dv, seed, count=3):
    """q (2, n, 4, d), k (2, n, 2, d), v (2, n, 2, dv) and, with count 4, a dout like the output: bf16 on the
    GPU, drawn in that order from one seeded generator."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((2, n, 4, d), (2, n, 2, d), (2, n, 2, dv), (2, n, 4, dv))[:count]
    return [torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g) for s in shapes]


SPARSE_FWD_MASKS = {
    # per head and per batch element, 128 x 128 blocks, full and partial ones
    "random_per_head": lambda n: BlockMask.from_mask_mod(
        lambda b, h, i, j: ((i // 128 + 3 * (j // 128) + 5 * h + 7 * b) % 3 != 0) & ((i + j + h) % 5 != 0)
        | ((i // 128 + j // 128 + h) % 4 == 0), 2, 4, n, n),
    "local_global": lambda n: BlockMask.local_global(n, 200, 64),
    "empty_rows": _empty_rows_mask,
    # key blocks of 256: two or four of the kernel's key tiles per listed block
    "wide_key_blocks": lambda n: BlockMask.from_mask_mod(lambda b, h, i, j: (i - j) % 5 != 1, None, 4, n, n,
                                                         block_size=(128, 256)),
}


@pytest.mark.parametrize("mask_name", list(SPARSE_FWD_MASKS))
@pytest.mark.parametrize("d, dv", [(64, 64), (128, 128), (256, 256), (96, 96), (192, 128)])
def test_gluon_sparse_forward(monkeypatch, mask_name, d, dv):
    """The Gluon forward's block-sparse variant (block_sparse.gluon_route) against the oracle on the whole
    output and LSE: lengths that are no multiple of the tiles (the last key block holds keys past seqlen_k,
    the last query block rows past seqlen_q), GQA 4:2, masks per head and batch element or shared, query
    blocks with no listed block, and key blocks of several key tiles; the kernel it ran is asserted."""
    from flashattn.backends.triton import block_sparse, gluon

    calls = []
    real = gluon.forward
    monkeypatch.setattr(gluon, "forward",
                        lambda *a, **kw: calls.append(kw.get("block_mask")) or real(*a, **kw))
    triton_fwd = []
    monkeypatch.setattr(block_sparse, "sparse_fwd_kernel",
                        LaunchRecorder(block_sparse.sparse_fwd_kernel, triton_fwd))
    n = 1000
    q, k, v = _gqa_inputs(n, d, dv, seed=7)
    mask = SPARSE_FWD_MASKS[mask_name](n)
    kt = mask.to_kernel_tensors("cuda")
    route = block_sparse.gluon_route(q, k, v, kt)
    out, lse = block_sparse.block_sparse_forward(q, k, v, kt, softmax_scale=d ** -0.5, route=route)
    assert len(calls) == 1 and calls[0] is kt and triton_fwd == []
    dense = mask.to_dense().cuda()
    ref, ref_lse = masked_attention_ref(q.double(), k.double(), v.double(), dense)
    pt, pt_lse = masked_attention_ref(q, k, v, dense, upcast=False)
    assert_close_to_ref(out, ref, pt, atol_floor=_eps_floor(q.dtype, ref))
    assert_close_to_ref(lse, ref_lse, pt_lse, name="lse")  # +inf where a row sees no key, as the oracle
    if mask_name == "empty_rows":
        assert (out[:, :300] == 0).all() and torch.isinf(lse[:, :, :300]).all()


SPARSE_BWD_MASKS = {
    "random_per_head": SPARSE_FWD_MASKS["random_per_head"],
    "local_global": SPARSE_FWD_MASKS["local_global"],
    "empty_rows": _empty_rows_mask,
}


@pytest.mark.parametrize("mask_name", list(SPARSE_BWD_MASKS))
@pytest.mark.parametrize("d, dv, softcap", [(64, 64, 0.0), (128, 128, 0.0), (96, 96, 0.0), (128, 64, 0.0),
                                            (128, 128, 20.0)])
def test_gluon_sparse_backward(monkeypatch, mask_name, d, dv, softcap):
    """The Gluon backward's block-sparse variant (block_sparse.gluon_route's gluon_bwd) against the oracle
    on the whole of dq, dk and dv: lengths that are no multiple of the tiles (the last key block holds keys
    past seqlen_k, the last query block rows past seqlen_q), GQA 4:2 with masks per head and batch element
    (a program per query head) or one mask for all (a program per group), key blocks that no query sees
    (zero dk / dv), rows that see no key, softcap; the kernel it ran is asserted."""
    from flashattn.backends.triton import block_sparse, gluon

    calls = []
    real = gluon.backward
    monkeypatch.setattr(gluon, "backward",
                        lambda *a, **kw: calls.append((a[1], kw.get("block_mask"))) or real(*a, **kw))
    triton_bwd = []
    monkeypatch.setattr(block_sparse, "sparse_bwd_kernel",
                        LaunchRecorder(block_sparse.sparse_bwd_kernel, triton_bwd))
    n = 1000
    q, k, v, dout = _gqa_inputs(n, d, dv, seed=11, count=4)
    mask = SPARSE_BWD_MASKS[mask_name](n)
    kt = mask.to_kernel_tensors("cuda")
    route = block_sparse.gluon_route(q, k, v, kt, softcap)
    assert route is not None and route.gluon_bwd is not None
    # a mask per query head under GQA: a program per head; one mask for all: the dense split
    per_head = kt.kv_full_num.shape[1] > 1
    assert (route.gluon_bwd.group_split == 2) == per_head
    options = dict(softmax_scale=d ** -0.5, softcap=softcap)
    out, lse = block_sparse.block_sparse_forward(q, k, v, kt, route=route, **options)
    dq, dk, dv_ = block_sparse.block_sparse_backward(dout, q, k, v, out, lse, kt, route=route, **options)
    assert [c[1] is kt for c in calls] == [True] and calls[0][0] == route.gluon_bwd and triton_bwd == []
    dense = mask.to_dense().cuda()
    grads = {}
    for upcast in (True, False):
        dtype = torch.float64 if upcast else q.dtype
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        o, _ = masked_attention_ref(*leaves, dense, softcap=softcap, upcast=upcast)
        grads[upcast] = torch.autograd.grad(o, leaves, dout.to(o.dtype))
    for name, got, ref, pt in zip(("dq", "dk", "dv"), (dq, dk, dv_), grads[True], grads[False], strict=True):
        assert torch.isfinite(got).all(), name
        assert_close_to_ref(got, ref, pt, factor=3.0, atol_floor=_eps_floor(q.dtype, ref), name=name)
    if mask_name == "empty_rows":
        assert (dq[:, :300] == 0).all()


def test_gluon_sparse_backward_declines_wide_key_blocks():
    """Key blocks of 256 keys are two of the backward's key tiles: its variant declines them (the Triton
    kernels run that backward), while the Gluon forward takes them."""
    from flashattn.backends.triton import block_sparse

    q, k, v = (torch.randn(1, 512, h, 128, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
    kt = SPARSE_FWD_MASKS["wide_key_blocks"](512).to_kernel_tensors("cuda")
    route = block_sparse.gluon_route(q, k, v, kt)
    assert route.gluon_fwd is not None and route.gluon_bwd is None


def test_default_route_by_partial_blocks(monkeypatch):
    """block_sparse_attn_func's default: a mask of whole blocks runs the Gluon kernels' variants forward and
    backward, a mask of mostly partial blocks the Triton kernels, and deterministic=True the Triton backward
    after the Gluon forward, its gradients bitwise equal from call to call."""
    from flashattn.backends.triton import block_sparse, gluon

    ran = []
    for name in ("forward", "backward"):
        real = getattr(gluon, name)
        monkeypatch.setattr(gluon, name, lambda *a, _n=name, _r=real, **kw: ran.append(
            (_n, kw.get("block_mask") is not None)) or _r(*a, **kw))
    triton_ran = []
    for name in ("sparse_fwd_kernel", "sparse_bwd_kernel"):
        monkeypatch.setattr(block_sparse, name, LaunchRecorder(getattr(block_sparse, name), triton_ran))
    n = 2048
    q, k, v = _qkv(1, n, n, 4, 2, 128, torch.bfloat16)
    whole = _random_blocks(4, n, 0.3)
    partial = BlockMask.local_global(n, 40, 16)
    assert whole.to_kernel_tensors("cuda").partial_permille == 0
    assert partial.to_kernel_tensors("cuda").partial_permille > 500

    def run(mask, **kw):
        ran.clear()
        triton_ran.clear()
        out = block_sparse_attn_func(q, k, v, mask, **kw)
        return torch.autograd.grad(out.float().square().sum(), (q, k, v))

    run(whole)
    assert ran == [("forward", True), ("backward", True)] and triton_ran == []
    run(partial)
    assert ran == [] and len(triton_ran) == 3  # the forward, then the backward's two roles
    first = run(whole, deterministic=True)
    assert ran == [("forward", True)] and len(triton_ran) == 2
    again = run(whole, deterministic=True)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
