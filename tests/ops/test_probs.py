"""S_dmask (return_attn_probs=True with dropout) in exactly the form flash_attn's tests decode.

`convert` and `normalize` re-implement what flash_attn 2.8's tests/test_flash_attn.py does with S_dmask
(convert_flash_attn_S_to_softmax, normalize_flash_attn_S): cut it to the sequence, zero what a query does not
see, take the sign as the keep mask and undo the per-key-tile running max with the row's LSE. The decoded
probabilities must match the fp64 oracle's under the tolerance rule, and the keep mask must be the one the
kernels drew (flashattn.dropout reproduces the kernels' Philox stream). Both backends, so the interpreter
runs the Triton kernel.
"""

from __future__ import annotations

import math

import pytest
import torch
from utils import DEVICE, assert_close_to_ref, is_interpreted

from flashattn import flash_attn_func, flash_attn_varlen_func
from flashattn.dropout import dropout_keep_mask
from flashattn.flash_attn_interface import _get_block_size_n
from flashattn.ops.rng import draw_rng_state


def visible(sq, sk, causal, window, device, len_q=None, len_k=None):
    """bool (sq, sk): query i sees key j (bottom-right aligned, window (left, right), -1 unbounded), for a
    sequence of len_q queries and len_k keys inside the (sq, sk) box."""
    len_q, len_k = sq if len_q is None else len_q, sk if len_k is None else len_k
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq, device=device).view(-1, 1)
    j = torch.arange(sk, device=device).view(1, -1)
    vis = (i < len_q) & (j < len_k)
    diag = i + len_k - len_q
    if right >= 0:
        vis &= j <= diag + right
    if left >= 0:
        vis &= j >= diag - left
    return vis


def scores(q, k, scale, vis, alibi_slopes=None, dtype=torch.float32):
    """(b, h, sq, sk) scaled scores in dtype (k repeated over GQA groups), ALiBi added, -inf where unseen."""
    h = q.shape[2]
    k = k.repeat_interleave(h // k.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(dtype), k.to(dtype)) * scale
    if alibi_slopes is not None:
        sq, sk = s.shape[-2:]
        dist = (torch.arange(sq).view(-1, 1) + sk - sq - torch.arange(sk).view(1, -1)).abs().to(s)
        s = s - alibi_slopes.to(s).view(-1 if alibi_slopes.dim() == 2 else 1, h, 1, 1) * dist
    return s.masked_fill(~vis, -math.inf)


def convert(s_dmask, sq, sk, vis):
    """convert_flash_attn_S_to_softmax: S_dmask cut to (sq, sk), 0 where the query sees nothing."""
    return s_dmask[:, :, :sq, :sk].masked_fill(~vis, 0.0)


def normalize(unnorm, s, block_n):
    """normalize_flash_attn_S: entry j of a row was exp(s_j - M) with M the max of the row's scores over the
    key tiles at and after j's; multiplying by exp(M - lse) gives the softmax."""
    tiles = s.split(block_n, dim=-1)
    lse = torch.logsumexp(torch.stack([torch.logsumexp(t, dim=-1) for t in tiles], dim=-1), dim=-1)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)  # rows that see no key
    tile_max = torch.stack([t.amax(dim=-1) for t in tiles], dim=-1)
    running = torch.cummax(tile_max.flip(-1), dim=-1).values.flip(-1).unbind(-1)
    parts = unnorm.split(block_n, dim=-1)
    return torch.cat([a * torch.exp(m - lse).unsqueeze(-1) for a, m in zip(parts, running, strict=True)], -1)


def oracle_probs(q, k, scale, vis, alibi_slopes):
    """(fp64 oracle, plain PyTorch in q's dtype) softmax probabilities; rows that see no key are 0."""
    out = []
    for dtype in (torch.float64, q.dtype):
        s = scores(q, k, scale, vis, alibi_slopes, dtype)
        p = torch.softmax(s.float() if dtype != torch.float64 else s, dim=-1)
        out.append(torch.nan_to_num(p, nan=0.0).to(dtype))
    return out


def check_s_dmask(q, k, v, p, causal=False, window=(-1, -1), alibi_slopes=None, seed=0):
    b, sq, h, d = q.shape
    sk = k.shape[1]
    torch.manual_seed(seed)
    rng_seed, rng_offset = draw_rng_state(q.device, 0).tolist()  # what the call below draws
    torch.manual_seed(seed)
    _, _, s_dmask = flash_attn_func(q, k, v, p, causal=causal, window_size=window, alibi_slopes=alibi_slopes,
                                    return_attn_probs=True)
    assert s_dmask.shape == (b, h, -(-sq // 128) * 128, -(-sk // 128) * 128) and s_dmask.dtype == q.dtype
    assert (s_dmask[:, :, sq:] == 0).all() and (s_dmask[:, :, :, sk:] == 0).all()
    vis = visible(sq, sk, causal, window, q.device)
    conv = convert(s_dmask, sq, sk, vis)
    # the keep mask: the kernels' Philox stream, on every entry a query sees
    keep = dropout_keep_mask(rng_seed, rng_offset, b, h, sq, sk, p, device=q.device)
    decoded = ~torch.signbit(conv)
    assert torch.equal(decoded | ~vis, keep | ~vis), "S_dmask's sign is not the kernels' keep mask"
    # flash_attn's tests take `S >= 0` as the mask: it differs only on dropped entries of probability 0
    assert torch.equal(((conv >= 0) != decoded) & vis, (conv == 0) & ~decoded & vis)
    scale = d ** -0.5
    block_n = _get_block_size_n(q.device, d, True, causal)
    probs = normalize(conv.abs().float(), scores(q, k, scale, vis, alibi_slopes), block_n)
    ref, pt = oracle_probs(q, k, scale, vis, alibi_slopes)
    assert_close_to_ref(probs, ref, pt, factor=2.0, name="probabilities decoded from S_dmask")
    return s_dmask


# (b, sq, sk, h, hk, d): key tiles of 128 (d <= 32), 64 (d = 40, 96) and 32 (d = 111), several per row
CASES = [
    (1, 37, 150, 2, 1, 32),
    (1, 70, 45, 4, 2, 40),
    (1, 1, 97, 2, 2, 96),
    (1, 45, 70, 2, 1, 111),
]


def _case_id(c):
    return "b{}-sq{}-sk{}-h{}-hk{}-d{}".format(*c)


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (9, 4))],
                         ids=["full", "causal", "window"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_s_dmask_decodes_to_the_probabilities(backend, case, causal, window):
    b, sq, sk, h, hk, d = case
    q, k, v = (torch.randn(b, s, n, d, device=DEVICE, dtype=torch.float16)
               for s, n in ((sq, h), (sk, hk), (sk, hk)))
    check_s_dmask(q, k, v, 0.17, causal=causal, window=window)


def test_s_dmask_with_alibi(backend):
    q, k, v = (torch.randn(2, s, 2, 24, device=DEVICE, dtype=torch.float16) for s in (33, 80, 80))
    check_s_dmask(q, k, v, 0.3, causal=True, alibi_slopes=torch.rand(2, 2, device=DEVICE))


def test_s_dmask_rows_that_see_no_key(backend):
    # causal with sq > sk: the first rows see nothing and are all +0
    q, k, v = (torch.randn(1, s, 2, 16, device=DEVICE, dtype=torch.float16) for s in (50, 20, 20))
    s_dmask = check_s_dmask(q, k, v, 0.5, causal=True)
    assert not torch.signbit(s_dmask[:, :, :30]).any() and (s_dmask[:, :, :30] == 0).all()


def test_backends_agree_bitwise():
    # the same scores, running maxima and keep mask on both backends (the interpreter runs the kernel)
    if not is_interpreted("triton"):
        pytest.skip("compares the interpreted kernel with the torch backend")
    from flashattn import config

    q, k, v = (torch.randn(2, s, 2, 40, dtype=torch.float16) for s in (45, 70, 70))
    got = []
    for name in ("torch", "triton"):
        with config.use_backend(name):
            torch.manual_seed(3)
            got.append(flash_attn_func(q, k, v, 0.25, causal=True, window_size=(20, 3),
                                       return_attn_probs=True)[2])
    assert torch.equal(torch.signbit(got[0]), torch.signbit(got[1]))
    torch.testing.assert_close(got[0], got[1], rtol=2e-3, atol=0)


def test_varlen_s_dmask(backend):
    # sequence b's entries at [b, :, :len_q, :len_k], each decoding to its own softmax; the keep mask is the
    # varlen counter layout (max_seqlen strides)
    lens_q, lens_k = [5, 0, 37], [40, 3, 70]
    h, d, p = 2, 32, 0.2
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(lens_q), h, d, device=DEVICE, dtype=torch.float16)
    k, v = (torch.randn(sum(lens_k), h, d, device=DEVICE, dtype=torch.float16) for _ in range(2))
    mq, mk = 40, 75  # larger than the longest: the counters' strides and S_dmask's size follow them
    torch.manual_seed(1)
    rng_seed, rng_offset = draw_rng_state(q.device, 0).tolist()
    torch.manual_seed(1)
    s_dmask = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, p, causal=True, return_attn_probs=True)[2]
    assert s_dmask.shape == (3, h, 128, 128)
    keep = dropout_keep_mask(rng_seed, rng_offset, 3, h, mq, mk, p, device=q.device)
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k, strict=True)):
        vis = visible(128, 128, True, (-1, -1), q.device, lq, lk)
        block = s_dmask[i : i + 1]
        unseen = block.masked_fill(vis, 0)
        assert (unseen == 0).all() and not torch.signbit(unseen).any()
        vis = vis[:mq, :mk]
        assert torch.equal((~torch.signbit(block[:, :, :mq, :mk]) | ~vis), keep[i : i + 1] | ~vis)
        if lq and lk:
            qs, ks = q[cu_q[i] : cu_q[i + 1]].unsqueeze(0), k[cu_k[i] : cu_k[i + 1]].unsqueeze(0)
            v_lq = visible(lq, lk, True, (-1, -1), q.device)
            conv = convert(block, lq, lk, v_lq)
            probs = normalize(conv.abs().float(), scores(qs, ks, d ** -0.5, v_lq), _get_block_size_n(
                q.device, d, True, True))
            ref, pt = oracle_probs(qs, ks, d ** -0.5, v_lq, None)
            assert_close_to_ref(probs, ref, pt, factor=2.0, name=f"sequence {i}")


# -- GPU: the Triton kernel at flash_attn's test sizes, its cost, the upstream race test's workload ---------

GPU_CASES = [(2, 113, 203, 4, 2, d) for d in (32, 59, 64, 96, 111, 128, 160, 192, 256)] + [
    (1, 1023, 1024, 2, 1, 128), (1, 1024, 1023, 2, 2, 64), (1, 97, 97, 4, 4, 40), (1, 2048, 2048, 1, 1, 96)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (50, 7))],
                         ids=["full", "causal", "window"])
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_gpu_s_dmask_decodes_to_the_probabilities(case, causal, window, dtype):
    b, sq, sk, h, hk, d = case
    q, k, v = (torch.randn(b, s, n, d, device="cuda", dtype=dtype) for s, n in ((sq, h), (sk, hk), (sk, hk)))
    check_s_dmask(q, k, v, 0.17, causal=causal, window=window,
                  alibi_slopes=torch.rand(b, h, device="cuda") * 0.3 if d == 64 else None)


@pytest.mark.gpu
def test_gpu_s_dmask_varlen():
    test_varlen_s_dmask("triton")


def _time_ms(fn, reps=20):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_return_attn_probs_costs_a_few_plain_calls(d):
    # S_dmask comes from a kernel: with it a call costs a few times the same call without it
    q, k, v = (torch.randn(4, 2048, 16, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    plain = _time_ms(lambda: flash_attn_func(q, k, v, 0.1, causal=True))
    probs = _time_ms(lambda: flash_attn_func(q, k, v, 0.1, causal=True, return_attn_probs=True))
    assert probs <= 4 * plain, f"return_attn_probs: {probs:.3f} ms against {plain:.3f} ms without"


@pytest.mark.gpu
def test_gpu_upstream_race_condition_workload():
    # flash_attn's test_flash_attn_race_condition: 251 calls with return_attn_probs and dropout at batch 60,
    # 4 heads, 257 x 257, each forward and backward bitwise the same (it did not finish in 150 s when
    # S_dmask was rebuilt in PyTorch)
    import time

    q, k, v = (torch.randn(60, 257, 4, 64, device="cuda", dtype=torch.float16, requires_grad=True)
               for _ in range(3))
    start = time.perf_counter()
    torch.manual_seed(42)
    out0, lse0, s0 = flash_attn_func(q, k, v, 0.17, causal=True, return_attn_probs=True)
    g = torch.randn_like(out0)
    grads0 = torch.autograd.grad(out0, (q, k, v), g)
    for _ in range(250):
        torch.manual_seed(42)
        out, lse, s_dmask = flash_attn_func(q, k, v, 0.17, causal=True, return_attn_probs=True)
        assert torch.equal(out, out0) and torch.equal(lse, lse0) and torch.equal(s_dmask, s0)
        grads = torch.autograd.grad(out, (q, k, v), g)
        assert all(torch.equal(a, b) for a, b in zip(grads, grads0, strict=True))
    elapsed = time.perf_counter() - start
    assert elapsed < 60, f"251 calls took {elapsed:.1f} s"
