"""Host time per call of two builds of flashattn side by side in one process, with SDPA-cuDNN's and
FlashAttention-4's (CUDA only; FA4 where its wheels came along: carry .fa4a / .fa4b as device_run.sh says).

The device machine's CPU speed moves by up to 2x between processes and within one, so host times from two
processes do not compare. This imports this tree's `flashattn` and a second copy of another revision under
another name (scripts/vendor_tree.sh REV NAME makes it: `.baseline/src/NAME`, its imports and op namespace
renamed), then times each call in alternating rounds: every round runs each build, cuDNN and FA4 back to back,
and the report gives the medians over rounds and the median of the per-round ratios; the order within a
round flips from one round to the next.

Calls (tiny problems, so the GPU never holds the host back; wall time per call of back-to-back calls without
a sync): the forward with inputs that require grad (what training does), forward + backward, inference
(no grad), at b=1 h=2 N=256 d=128 causal and b=1 h=2 N=256 d=64; and decode (flash_attn_with_kvcache, batch 1,
32 / 8 heads, 4K keys, d=128) beside SDPA-cuDNN's and SDPA-flash's decode; then packed documents (forward,
forward + backward; FA4's varlen call beside them) and a paged prefill, which SDPA cannot express.

    PYTHONPATH=src:.baseline/src python scripts/host_ab.py OUT.json [NAME] [--rounds 15]
"""

import argparse
import importlib
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def _per_call_us(fn, calls=100):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def _sdpa(backend, q, k, v, causal):
    def call():
        with sdpa_kernel(backend):
            gqa = q.shape[1] != k.shape[1]
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return call


def _fa4():
    """FlashAttention-4's interface where its wheels came along (device_run.sh's fa4-libs), else None."""
    try:
        from flash_attn.cute import interface
    except ImportError:
        return None
    return interface


def _cases(builds):
    """{case: {impl: closure}}: each build's calls, SDPA-cuDNN's and FA4's (where it imports) on the same
    tensors."""
    fa4 = _fa4()
    cases = {}
    for d, causal in ((128, True), (64, False)):
        q, k, v = (torch.randn(1, 256, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn_like(q)
        qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
        dot = do.transpose(1, 2)
        cudnn = _sdpa(SDPBackend.CUDNN_ATTENTION, qt, kt, vt, causal)
        name = f"d={d} {'causal' if causal else 'full'}"
        fwd, train, infer = {}, {}, {}
        for label, fa in builds.items():
            fwd[label] = lambda fa=fa, q=q, k=k, v=v, c=causal: fa.flash_attn_func(q, k, v, causal=c)
            train[label] = lambda fa=fa, q=q, k=k, v=v, do=do, c=causal: torch.autograd.grad(
                fa.flash_attn_func(q, k, v, causal=c), (q, k, v), do)

            def nograd(fa=fa, q=q, k=k, v=v, c=causal):
                with torch.no_grad():
                    return fa.flash_attn_func(q, k, v, causal=c)
            infer[label] = nograd
        fwd["cudnn"] = cudnn
        train["cudnn"] = lambda cudnn=cudnn, dot=dot, qt=qt, kt=kt, vt=vt: torch.autograd.grad(
            cudnn(), (qt, kt, vt), dot)
        if fa4 is not None:
            fwd["fa4"] = lambda q=q, k=k, v=v, c=causal: fa4.flash_attn_func(q, k, v, causal=c)[0]
            train["fa4"] = lambda q=q, k=k, v=v, do=do, c=causal: torch.autograd.grad(
                fa4.flash_attn_func(q, k, v, causal=c)[0], (q, k, v), do)

            def fa4_nograd(q=q, k=k, v=v, c=causal):
                with torch.no_grad():
                    return fa4.flash_attn_func(q, k, v, causal=c)[0]
            infer["fa4"] = fa4_nograd

        def cudnn_nograd(cudnn=cudnn):
            with torch.no_grad():
                return cudnn()
        infer["cudnn"] = cudnn_nograd
        cases[f"{name} fwd"], cases[f"{name} fwd+bwd"], cases[f"{name} inference"] = fwd, train, infer
    # decode: one new token, 4K cached keys
    b, h, hk, d, n = 1, 32, 8, 128, 4096
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(b, n, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    decode = {label: (lambda fa=fa: fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens))
              for label, fa in builds.items()}
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    for backend, label in ((SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.FLASH_ATTENTION, "sdpa-flash")):
        decode[label] = _sdpa(backend, qt, kt, vt, False)
    cases["decode b1 4K"] = decode
    cases.update(_varlen_cases(builds, fa4))
    return cases


def _varlen_cases(builds, fa4):
    """Packed documents (8 short ones, h2 d128 causal: forward with grad, forward + backward) and a paged
    prefill on its pools (pages of 128, no grad): calls cuDNN has no argument for."""
    lens = [17, 64, 3, 100, 40, 9, 23, 0]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    lens_k = [300, 17, 200]
    cu_q = torch.tensor([0, 17, 34, 51], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    table = torch.arange(9, dtype=torch.int32, device="cuda").view(3, 3)
    kp, vp = (torch.randn(9, 128, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    qp = torch.randn(51, 4, 128, device="cuda", dtype=torch.bfloat16)
    fwd, train, paged = {}, {}, {}
    for label, fa in builds.items():
        def call(fa=fa):
            return fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
        fwd[label] = call
        train[label] = lambda call=call: torch.autograd.grad(call(), (q, k, v), do)

        def pages(fa=fa):
            with torch.no_grad():
                return fa.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 17, max(lens_k), causal=True,
                                                 block_table=table)
        paged[label] = pages
    if fa4 is not None:
        def fa4_call():
            return fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                              max_seqlen_q=max(lens), max_seqlen_k=max(lens), causal=True)[0]
        fwd["fa4"] = fa4_call
        train["fa4"] = lambda: torch.autograd.grad(fa4_call(), (q, k, v), do)
    return {"varlen docs fwd": fwd, "varlen docs fwd+bwd": train, "paged prefill": paged}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("baseline", nargs="?", default=None, help="the vendored copy's package name")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    builds = {"current": importlib.import_module("flashattn")}
    if args.baseline:
        builds["baseline"] = importlib.import_module(args.baseline)
    torch.manual_seed(0)
    cases = _cases(builds)
    for impls in cases.values():  # compile and warm every call first
        for fn in impls.values():
            for _ in range(3):
                fn()
    torch.cuda.synchronize()
    times = {case: {impl: [] for impl in impls} for case, impls in cases.items()}
    for r in range(args.rounds):
        for case, impls in cases.items():
            # every other round in reverse: what runs first in a round reads a few percent slower (the
            # 12-07 run's decode row, whose path the two builds shared, read 1.03x)
            for impl, fn in list(impls.items())[::-1 if r % 2 else 1]:
                times[case][impl].append(_per_call_us(fn, calls=20 if "fwd+bwd" in case else 100))
    report = {}
    for case, per_impl in times.items():
        row = {impl: statistics.median(ts) for impl, ts in per_impl.items()}
        for impl in per_impl:
            if impl != "cudnn" and "cudnn" in per_impl:
                pairs = zip(per_impl[impl], per_impl["cudnn"], strict=True)
                row[f"{impl}/cudnn"] = statistics.median(a / c for a, c in pairs)
        for other in ("baseline", "fa4"):
            if other in per_impl:
                row[f"current/{other}"] = statistics.median(
                    a / b for a, b in zip(per_impl["current"], per_impl[other], strict=True))
        report[case] = row
        shown = (f"{k} {v:.3f}" if "/" in k else f"{k} {v:.1f} us" for k, v in row.items())
        print(f"{case:22}", "  ".join(shown), flush=True)
    with open(args.out, "w") as f:
        json.dump({"us_per_call_medians_and_ratios": report, "rounds": args.rounds}, f, indent=1)


if __name__ == "__main__":
    main()
