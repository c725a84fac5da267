"""An FP8 (e4m3) KV cache on the GPU at real sizes: bf16 q, 32 query / 8 kv heads, d = 128, batch 4, 8K cache,
contiguous and paged (64, 256), per-tensor and per-head descales, one new token appended (with and without
rotary). Against the fp64 oracle on the dequantised cache (the tolerance rule, plain PyTorch on the cache
dequantised to bf16 as the yardstick), against the bf16 cache on the same data, and a DecodePlan's run
captured in a CUDA graph. Run on the device: `PYTHONPATH=src pytest -m gpu tests/test_kvcache_fp8_gpu.py`."""

from __future__ import annotations

import pytest
import torch
from utils import assert_close_to_ref, max_abs_err

from flashattn import DecodePlan
from flashattn.fp8 import FP8, FP8_MAX, quantize
from flashattn.kvcache import flash_attn_with_kvcache
from flashattn.reference import attention_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

B, H, HK, D, CAP = 4, 32, 8, 128, 8192
DT = torch.bfloat16


def _bytes(x):
    """An e4m3 tensor as bytes (indexing it needs no e4m3 kernels), any other unchanged."""
    return x.view(torch.uint8) if x.dtype == FP8 else x


def _paged(k, page, perm):
    """A pool of pages holding k (b, cap, hk, d) at the places perm (b · cap / page,) gives."""
    if k.dtype == FP8:
        return _paged(_bytes(k), page, perm).view(FP8)
    b, cap = k.shape[:2]
    pool = torch.empty(b * cap // page, page, HK, D, dtype=k.dtype, device=k.device)
    pool[perm] = k.reshape(-1, page, HK, D)
    return pool


def _rope(x, cos, sin, pos):
    """x (b, s, hk, d) rotated at positions pos (b, s), GPT-J pairs, fp32."""
    c, s = cos.float()[pos][:, :, None], sin.float()[pos][:, :, None]
    a, bb = x.float()[..., 0::2], x.float()[..., 1::2]
    return torch.stack((a * c - bb * s, bb * c + a * s), -1).flatten(-2)


def _setup(page, granularity, rotary, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # each (sequence, KV head) at a scale of its own, so that per-head descales differ from each other
    spread = [torch.rand(B, 1, HK, 1, device="cuda", generator=gen) * 1.5 + 0.25 for _ in range(2)]
    k0 = (torch.randn(B, CAP, HK, D, device="cuda", generator=gen) * spread[0]).to(DT)
    v0 = (torch.randn(B, CAP, HK, D, device="cuda", generator=gen) * spread[1]).to(DT)
    k8, kd = quantize(k0, granularity)
    v8, vd = quantize(v0, granularity)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=DT, generator=gen)
    kn = torch.randn(B, 1, HK, D, device="cuda", dtype=DT, generator=gen)
    vn = torch.randn(B, 1, HK, D, device="cuda", dtype=DT, generator=gen)
    # ragged lengths: one appends the last slot, the others mid-tile / mid-page
    seqlens = torch.randint(CAP // 2, CAP - 1, (B,), device="cuda", generator=gen, dtype=torch.int32)
    seqlens[-1] = CAP - 1
    cos = sin = None
    if rotary:
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
        freqs = torch.outer(torch.arange(CAP, device="cuda", dtype=torch.float32), inv)
        cos, sin = freqs.cos().to(DT), freqs.sin().to(DT)
    bt = None
    caches = {"fp8": [k8, v8], "bf16": [k0.clone(), v0.clone()]}
    if page is not None:
        perm = torch.randperm(B * CAP // page, device="cuda", generator=gen)
        bt = perm.view(B, -1).to(torch.int32)
        caches = {name: [_paged(x, page, perm) for x in pair] for name, pair in caches.items()}
    return dict(q=q, kn=kn, vn=vn, kd=kd, vd=vd, seqlens=seqlens, cos=cos, sin=sin, bt=bt, caches=caches)


def _call(s, name, plan=None):
    kc, vc = s["caches"][name]
    descales = dict(k_descale=s["kd"], v_descale=s["vd"]) if name == "fp8" else {}
    if plan is not None:
        return plan.run(s["q"], kc, vc, s["seqlens"], s["bt"], k=s["kn"], v=s["vn"], rotary_cos=s["cos"],
                        rotary_sin=s["sin"], **descales)
    return flash_attn_with_kvcache(s["q"], kc, vc, s["kn"], s["vn"], rotary_cos=s["cos"], rotary_sin=s["sin"],
                                   cache_seqlens=s["seqlens"], block_table=s["bt"], causal=True, **descales)


def _gathered(s, name):
    """The (b, cap, hk, d) caches of each sequence after the call."""
    kc, vc = s["caches"][name]
    if s["bt"] is None:
        return kc, vc
    return tuple(_bytes(x)[s["bt"].long()].flatten(1, 2).view(x.dtype) for x in (kc, vc))


def _real(x8, descale):
    d = descale.double()
    return x8.double() * (d.view(1, 1, 1, 1) if d.dim() == 1 else d[:, None, :, None])


@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("page", [None, 64, 256], ids=["contiguous", "page64", "page256"])
def test_fp8_cache_decode(page, granularity, rotary):
    s = _setup(page, granularity, rotary)
    k8_before = _gathered(s, "fp8")[0].clone()
    out8 = _call(s, "fp8")
    out16 = _call(s, "bf16")
    (k8, v8), (k16, v16) = _gathered(s, "fp8"), _gathered(s, "bf16")
    rows, pos = torch.arange(B, device="cuda"), s["seqlens"].long()
    # the appended token, quantised as torch quantises it (rotated in fp32 first; the GPU's fused
    # multiply-adds in the rotation may move a value across a rounding boundary: one e4m3 step at most)
    kd = s["kd"].expand(B, HK) if s["kd"].dim() == 1 else s["kd"]
    vd = s["vd"].expand(B, HK) if s["vd"].dim() == 1 else s["vd"]
    k_new = _rope(s["kn"], s["cos"], s["sin"], pos[:, None])[:, 0] if rotary else s["kn"][:, 0].float()
    k_want = (k_new / kd[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    v_want = (s["vn"][:, 0].float() / vd[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    assert torch.equal(_bytes(v8)[rows, pos], _bytes(v_want))
    k_got = _bytes(k8)[rows, pos]
    if rotary:
        step = 2.0 ** (torch.floor(torch.log2(k_want.float().abs().clamp_min(2.0**-6))) - 3)
        assert ((k_got.view(FP8).float() - k_want.float()).abs() <= step).all()
    else:
        assert torch.equal(k_got, _bytes(k_want))
    # every other slot is untouched
    keep = torch.ones(B, CAP, dtype=torch.bool, device="cuda")
    keep[rows, pos] = False
    assert torch.equal(_bytes(k8)[keep], _bytes(k8_before)[keep])

    k_real, v_real = _real(k8, s["kd"]), _real(v8, s["vd"])
    q = s["q"]
    if rotary:
        q = _rope(q, s["cos"], s["sin"], pos[:, None]).to(DT)  # at its own position, the new key's
    for i in (0, B - 1):
        n = int(s["seqlens"][i]) + 1
        kr, vr = k_real[i : i + 1, :n], v_real[i : i + 1, :n]
        ref8 = attention_ref(q[i : i + 1], kr, vr, causal=True)[0]
        pt8 = attention_ref(q[i : i + 1], kr.to(DT), vr.to(DT), causal=True, upcast=False)[0]
        assert_close_to_ref(out8[i : i + 1], ref8, pt8, name=f"out[{i}] against the dequantised cache")
        ref16 = attention_ref(q[i : i + 1], k16[i : i + 1, :n], v16[i : i + 1, :n], causal=True)[0]
        # the harness's check of an fp8-cache provider: against the bf16 data, within plain PyTorch's error
        # on the same fp8 cache
        assert_close_to_ref(out8[i : i + 1], ref16, pt8, name=f"out[{i}] against the bf16 data")
        errs = [max_abs_err(o[i : i + 1], ref16) for o in (out8, out16)]
        print(f"seq {i}: max|out(fp8) - out(bf16)| = {max_abs_err(out8[i], out16[i]):.3g}; against the bf16 "
              f"oracle: fp8 {errs[0]:.3g}, bf16 {errs[1]:.3g}")


@pytest.mark.parametrize("page", [None, 64])
def test_fp8_plan_in_a_cuda_graph(page):
    # a serving step: plan once, capture the run (append + attend) in a graph, replay at the next length
    s = _setup(page, "head", True, seed=1)
    plan = DecodePlan(B, H, HK, D, page_size=page, max_seqlen_k=CAP, dtype=DT, cache_dtype=FP8, causal=True)
    kc, vc = s["caches"]["fp8"]
    kc0, vc0 = kc.clone(), vc.clone()
    seqlens = s["seqlens"].clone() - 1
    s["seqlens"] = seqlens
    _call(s, "fp8", plan)  # compile outside the capture
    kc.copy_(kc0)
    vc.copy_(vc0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _call(s, "fp8", plan)
    kc.copy_(kc0)
    vc.copy_(vc0)
    seqlens += 1  # the captured step reads the lengths at replay time
    graph.replay()
    torch.cuda.synchronize()
    kc_replayed, vc_replayed = kc.clone(), vc.clone()
    kc.copy_(kc0)
    vc.copy_(vc0)
    expect = _call(s, "fp8", plan)
    assert torch.equal(out, expect)
    assert torch.equal(_bytes(kc_replayed), _bytes(kc)) and torch.equal(_bytes(vc_replayed), _bytes(vc))


@pytest.mark.parametrize("s", [24, -24])
def test_bf16_q_far_from_fp16_range(s):
    # a bf16 q at 2^24 (past fp16's 65504) or 2^-24 (fp16's subnormals) times a unit one, with softmax_scale
    # times the inverse: the same call. The fp16 dots take q scaled by a power of two into fp16's range, so
    # the output and LSE match the unit call's bit for bit; cast to fp16 unscaled, 2^24 would be inf.
    st = _setup(None, "head", False)
    kc, vc = st["caches"]["fp8"]
    descales = dict(k_descale=st["kd"], v_descale=st["vd"])
    runs = [flash_attn_with_kvcache(st["q"] * 2.0**e, kc, vc, cache_seqlens=st["seqlens"],
                                    softmax_scale=D**-0.5 * 2.0**-e, return_softmax_lse=True, **descales)
            for e in (0, s)]
    (out0, lse0), (out, lse) = runs
    assert torch.isfinite(out).all()
    assert torch.equal(out, out0) and torch.equal(lse, lse0)


@pytest.mark.parametrize("page", [None, 64], ids=["contiguous", "page64"])
def test_fp8_cache_at_batch_16_on_its_route(page):
    # 16 x 8 (batch, kv head) programs: an FP8 cache at d = 128 plans two programs an SM (2 splits, not 3)
    # and keeps its 128-key tiles paged; checked against the oracle on the dequantised cache
    from flashattn.backends.triton.configs import TileConfig

    b, cap = 16, 16384
    plan = DecodePlan(b, H, HK, D, page_size=page, max_seqlen_k=cap, dtype=DT, cache_dtype=FP8)
    assert plan.route.num_splits == 2
    assert plan.route.tiles == TileConfig(64, 128, 4, 5 if page else 3)
    gen = torch.Generator(device="cuda").manual_seed(3)
    k8, kd = quantize(torch.randn(b, cap, HK, D, device="cuda", dtype=DT, generator=gen), "head")
    v8, vd = quantize(torch.randn(b, cap, HK, D, device="cuda", dtype=DT, generator=gen), "head")
    q = torch.randn(b, 1, H, D, device="cuda", dtype=DT, generator=gen)
    seqlens = torch.randint(1, cap, (b,), device="cuda", generator=gen, dtype=torch.int32)
    seqlens[-1] = cap
    kc, vc, bt = k8, v8, None
    if page is not None:
        perm = torch.randperm(b * cap // page, device="cuda", generator=gen)
        bt = perm.view(b, -1).to(torch.int32)
        kc, vc = (_paged(x, page, perm) for x in (k8, v8))
    out = plan.run(q, kc, vc, seqlens, bt, k_descale=kd, v_descale=vd)
    k_real, v_real = _real(k8, kd), _real(v8, vd)
    for i in (0, 7, b - 1):
        n = int(seqlens[i])
        kr, vr = k_real[i : i + 1, :n], v_real[i : i + 1, :n]
        ref = attention_ref(q[i : i + 1], kr, vr)[0]
        pt = attention_ref(q[i : i + 1], kr.to(DT), vr.to(DT), upcast=False)[0]
        assert_close_to_ref(out[i : i + 1], ref, pt, name=f"out[{i}]")
