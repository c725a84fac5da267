"""Where the time of a short forward goes: the bench's timer, the GPU alone, and the host alone (H200 only).

The train table's N <= 2K forward rows moved by up to 40% between runs of unchanged kernels (NOTES v23). This
times each call three ways, side by side in one process:
  - bench: triton.testing.do_bench's median, as `flashattn bench` does (an L2 flush before each call; the
    flush's GPU time hides the host's launch work only as long as that work is shorter);
  - graph: do_bench_cudagraph's median of the same call captured in a CUDA graph (GPU time alone, no flush);
  - host: wall time per call of 50 back-to-back calls without a sync (the host's launch work, while the
    GPU queue is not full), and the flush alone.

    python scripts/short_n_probe.py OUT.json
"""

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench, do_bench_cudagraph

from flashattn import flash_attn_func

SHAPES = [  # (batch, heads, seqlen, head dim, causal): 16K tokens, as the train suite
    (16, 16, 1024, 128, False), (16, 16, 1024, 128, True), (8, 16, 2048, 128, True), (4, 16, 4096, 128, True),
    (16, 32, 1024, 64, False), (16, 32, 1024, 64, True), (8, 32, 2048, 64, True),
]
VARIANTS = {  # name -> environment for our calls; "cudnn" is torch's SDPA on its cuDNN backend
    "ours": {}, "ws-tiles": {"FLASHATTN_WS_GRID": "tiles"}, "triton": {"FLASHATTN_WS": "0"}, "cudnn": None,
}


def _call(name, q, k, v, causal):
    if name == "cudnn":
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def fn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        return fn
    return lambda: flash_attn_func(q, k, v, causal=causal)


def _host_us(fn, calls=50):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main(path):
    cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # do_bench's flush buffer size
    flush_ms = do_bench(lambda: cache.zero_(), warmup=10, rep=50, return_mode="median")
    print(f"L2 flush alone: {flush_ms * 1e3:.0f} us", flush=True)
    rows = []
    for b, h, n, d, causal in SHAPES:
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        for name, env in VARIANTS.items():
            os.environ.pop("FLASHATTN_WS", None)
            os.environ.pop("FLASHATTN_WS_GRID", None)
            os.environ.update(env or {})
            fn = _call(name, q, k, v, causal)
            fn()
            bench = do_bench(fn, warmup=25, rep=100, return_mode="median")
            host = _host_us(fn)
            with torch.no_grad():
                graph = do_bench_cudagraph(fn, rep=100, return_mode="median")
            row = dict(b=b, h=h, n=n, d=d, causal=causal, variant=name, bench_ms=bench, graph_ms=graph,
                       host_us=host, bench_tflops=flops / bench * 1e-9, graph_tflops=flops / graph * 1e-9)
            rows.append(row)
            print(f"d={d} N={n} causal={causal!s:5} {name:9} "
                  f"bench {bench * 1e3:6.0f} us ({row['bench_tflops']:4.0f} TF/s)  "
                  f"graph {graph * 1e3:6.0f} us ({row['graph_tflops']:4.0f})  host {host:5.0f} us/call",
                  flush=True)
    os.environ.pop("FLASHATTN_WS", None)
    os.environ.pop("FLASHATTN_WS_GRID", None)
    with open(path, "w") as f:
        json.dump({"flush_ms": flush_ms, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
