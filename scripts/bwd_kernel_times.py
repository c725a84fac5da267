"""GPU time per kernel of one training backward (NOTES v34): the preprocess, the Gluon kernel and the dQ
conversion copy, apart, at the train grid's shapes (b x N = 16K tokens, h = 2048 / d, bf16).

    python scripts/bwd_kernel_times.py OUT.json [N ...]

torch.profiler's CUDA times over 20 backwards after 3 warm-ups, per kernel name, in microseconds per backward.
"""

import json
import sys

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from flashattn import flash_attn_func


def kernel_times(d: int, n: int, causal: bool, reps: int = 20) -> dict:
    shape = (16384 // n, n, 2048 // d, d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    for _ in range(3):
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        # kernels only: an operator's device time repeats its kernels'
        if event.device_type == DeviceType.CUDA:
            times[event.key[:80]] = round(event.device_time_total / reps, 1)
    return times


def main(path: str, seqlens: list[int]) -> None:
    rows = []
    for d in (64, 128):
        for n in seqlens:
            for causal in (False, True):
                times = kernel_times(d, n, causal)
                rows.append(dict(d=d, n=n, causal=causal, us_per_backward=times))
                total = sum(times.values())
                ranked = sorted(times.items(), key=lambda item: -item[1])
                parts = ", ".join(f"{name[:40]} {us:.0f}" for name, us in ranked)
                print(f"d={d} N={n} causal={causal}: {total:.0f} us: {parts}", flush=True)
                with open(path, "w") as f:
                    json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], [int(x) for x in sys.argv[2:]] or [1024, 4096, 16384])
