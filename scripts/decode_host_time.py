"""Host time per decode call beside SDPA's, in one process (CUDA only).

Decode at batch 1, 32 query / 8 KV heads, d = 128, bf16, 4K cached keys (and batch 16): the calls of a
serving loop that runs eagerly.
  flashattn-kvcache          flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=...), contiguous
  flashattn-kvcache-paged64  the same on a paged cache (pages of 64)
  flashattn-kvcache-append   paged, appending the new k/v with rotary (a real decode step)
  flashattn-plan             DecodePlan.run on the paged cache
  flashattn-plan-append      DecodePlan.run appending with rotary
  sdpa-cudnn, sdpa-flash     F.scaled_dot_product_attention(q, k, v, enable_gqa=True) forced to a backend
Two numbers per call, medians over alternating rounds (every round runs every call; the CPU's speed drifts):
  host_us  CPU time to issue one call while the GPU is held busy by a sleep kernel queued first, so no call
           waits for the device: the host cost alone;
  wall_us  wall time per call of back-to-back calls without a sync (host or GPU, whichever bounds).
Then a cProfile of flash_attn_with_kvcache's eager path.

    PYTHONPATH=src python scripts/decode_host_time.py OUT.json [--rounds 15]
"""

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn

H, HK, D, N = 32, 8, 128, 4096
BF = dict(device="cuda", dtype=torch.bfloat16)
_SLEEP_CYCLES = 50_000_000  # ~25 ms at the H200's clock: longer than any round's calls take to issue


def _host_us(fn, calls):
    torch.cuda.synchronize()
    torch.cuda._sleep(_SLEEP_CYCLES)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def _wall_us(fn, calls):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def _sdpa(backend, q, k, v):
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def call():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
    return call


def _calls(b):
    q = torch.randn(b, 1, H, D, **BF)
    k, v = (torch.randn(b, N, HK, D, **BF) for _ in range(2))
    seqlens = torch.full((b,), N - 1, dtype=torch.int32, device="cuda")
    page = 64
    table = torch.randperm(b * N // page, device="cuda").view(b, -1).to(torch.int32)
    kp, vp = (torch.empty(b * N // page, page, HK, D, **BF) for _ in range(2))
    kp[table.flatten().long()] = k.view(-1, page, HK, D)
    vp[table.flatten().long()] = v.view(-1, page, HK, D)
    kn, vn = (torch.randn(b, 1, HK, D, **BF) for _ in range(2))
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(N, device="cuda", dtype=torch.float32), inv)
    cos, sin = freqs.cos().to(torch.bfloat16), freqs.sin().to(torch.bfloat16)
    plan = flashattn.DecodePlan(b, H, HK, D, page_size=page, max_seqlen_k=N, causal=True)
    fa = flashattn.flash_attn_with_kvcache
    return {
        "flashattn-kvcache": lambda: fa(q, k, v, cache_seqlens=seqlens),
        "flashattn-kvcache-paged64": lambda: fa(q, kp, vp, cache_seqlens=seqlens, block_table=table),
        # the same position every call: the step is repeatable, the host work is a real step's
        "flashattn-kvcache-append": lambda: fa(q, kp, vp, kn, vn, cos, sin, cache_seqlens=seqlens,
                                               block_table=table, causal=True),
        "flashattn-plan": lambda: plan.run(q, kp, vp, seqlens, table),
        "flashattn-plan-append": lambda: plan.run(q, kp, vp, seqlens, table, k=kn, v=vn, rotary_cos=cos,
                                                  rotary_sin=sin),
        "sdpa-cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v),
        "sdpa-flash": _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    torch.manual_seed(0)
    cases = {f"decode b{b} 4K": _calls(b) for b in (1, 16)}
    for calls in cases.values():  # compile, fill the caches
        for fn in calls.values():
            for _ in range(3):
                fn()
    torch.cuda.synchronize()
    times = {case: {impl: ([], []) for impl in calls} for case, calls in cases.items()}
    for _ in range(args.rounds):
        for case, calls in cases.items():
            for impl, fn in calls.items():
                host, wall = times[case][impl]
                host.append(_host_us(fn, args.calls))
                wall.append(_wall_us(fn, args.calls))
    report = {}
    for case, per_impl in times.items():
        report[case] = {}
        for impl, (host, wall) in per_impl.items():
            row = {"host_us": statistics.median(host), "wall_us": statistics.median(wall)}
            cudnn_host = per_impl["sdpa-cudnn"][0]
            row["host/cudnn"] = statistics.median(a / c for a, c in zip(host, cudnn_host, strict=True))
            report[case][impl] = row
            print(f"{case:14} {impl:26} host {row['host_us']:6.1f} us  wall {row['wall_us']:6.1f} us  "
                  f"host/cudnn {row['host/cudnn']:.2f}", flush=True)

    fn = cases["decode b1 4K"]["flashattn-kvcache-paged64"]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())
    with open(args.out, "w") as f:
        json.dump({"medians": report, "rounds": args.rounds, "cprofile": text.getvalue()}, f, indent=1)


if __name__ == "__main__":
    main()
