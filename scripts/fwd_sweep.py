"""The Gluon forward's variants at d = 64 and 128, side by side with FlashAttention-2 (the M1 bar is 1.4x it),
H200 only.

The forward points of the train grid under the bar in the s11 table are d=64: causal 1K and 2K. This times, in
one process, the shipped choice, the Triton forward, and the Gluon forward (forced past its shape rule) under
its tile configs and switches (NOTES v32, v33), each checked against the shipped output first; do_bench
medians as `flashattn bench`, and the GPU time from a CUDA graph.

    python scripts/fwd_sweep.py OUT.json [HEAD_DIM ...]    # default: 64 128

FWD_SWEEP_SHAPES="16,1024,1;8,2048,1" narrows the shapes (batch, N, causal); FWD_SWEEP_EXTRA='{"name": {"VAR":
"value"}}' adds variants of the Gluon forward (forced) at every head dim, e.g. other FLASHATTN_CONFIG rows;
FWD_SWEEP_KERNEL=FILE adds the Gluon forward with FILE's attn_fwd_ws_kernel in place of the package's (an
earlier version of the kernel, for an A/B in one process); FWD_SWEEP_REPEAT=R times every variant R times,
interleaved (drift shows as the spread between rounds); FWD_SWEEP_ONLY="shipped,..." keeps the variants named.
cuDNN's time is printed beside the bar.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from sweep_rows import kernel_from_file, record, shapes
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench, do_bench_cudagraph

from flashattn import flash_attn_func
from flashattn.kernels import attn_fwd_ws
from flashattn.ops import attention, attention_ws

# (batch, N, causal) at 16K tokens, hidden 2048: the short d=64 points that were under the bar in the s10-s12
# tables, and the long row (steady state)
SHAPES = shapes("FWD_SWEEP_SHAPES",
                [(16, 1024, False), (16, 1024, True), (8, 2048, True), (4, 4096, True), (1, 16384, False)])
THREE, TWO = {"FLASHATTN_CONFIG": "fwd_ws=192,128,4,3"}, {"FLASHATTN_CONFIG": "fwd_ws=128,128,4,3"}
VARIANTS = {  # head dim -> name -> (environment, Gluon forced)
    64: {
        "shipped": ({}, False),
        "triton": ({"FLASHATTN_WS": "0"}, False),
        "gluon 2 consumers": (TWO, True),
        "gluon 3 consumers": (THREE, True),
        "gluon 3c full diag": ({**THREE, "FLASHATTN_FWD_HALF_DIAG": "0"}, True),
    },
    128: {
        "shipped": ({}, False),
        "triton": ({"FLASHATTN_WS": "0"}, False),
        "gluon full diag": ({"FLASHATTN_FWD_HALF_DIAG": "0"}, True),
    },
}
_EXTRA = json.loads(os.environ.get("FWD_SWEEP_EXTRA", "{}"))
for _table in VARIANTS.values():
    _table.update({name: (env, True) for name, env in _EXTRA.items()})
_SHIPPED_KERNEL = attn_fwd_ws.attn_fwd_ws_kernel
_OTHER_KERNEL = None
if os.environ.get("FWD_SWEEP_KERNEL"):
    _OTHER_KERNEL = kernel_from_file(os.environ["FWD_SWEEP_KERNEL"], "attn_fwd_ws_kernel")
    for _table in VARIANTS.values():
        # the package's kernel, forced, beside the other file's under the same switches
        _table.update({"gluon (package)": ({}, True),
                       "gluon (FWD_SWEEP_KERNEL)": ({"FWD_SWEEP_OTHER": "1"}, True)})
_REPEAT = int(os.environ.get("FWD_SWEEP_REPEAT", "1"))
if os.environ.get("FWD_SWEEP_ONLY"):
    _keep = os.environ["FWD_SWEEP_ONLY"].split(",")
    VARIANTS = {d: {name: v for name, v in table.items() if name in _keep} for d, table in VARIANTS.items()}
# cleared before each variant
_ENV_NAMES = {name for table in VARIANTS.values() for env, _ in table.values() for name in env}
_takes = attention_ws.takes


def _run_variant(env, forced, fn):
    for name in _ENV_NAMES:
        os.environ.pop(name, None)
    os.environ.update(env)
    attention_ws.takes = (lambda d: True) if forced else _takes
    other = env.get("FWD_SWEEP_OTHER") == "1"
    attn_fwd_ws.attn_fwd_ws_kernel = _OTHER_KERNEL if other else _SHIPPED_KERNEL
    # the launchers' per-signature caches hold the kernel of the call that filled them
    attention._forward_cache.clear()
    try:
        return fn()
    finally:
        attention_ws.takes = _takes
        attn_fwd_ws.attn_fwd_ws_kernel = _SHIPPED_KERNEL
        attention._forward_cache.clear()


def _shape(d, b, n, causal, rows, path):
    q, k, v = (torch.randn(b, n, 2048 // d, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * b * 2048 * n * n / (2 if causal else 1)
    ref = _run_variant({}, False, lambda: flash_attn_func(q, k, v, causal=causal))  # the shipped choice
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def fa2():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    def call():
        return flash_attn_func(q, k, v, causal=causal)

    def bench():
        return do_bench(call, warmup=25, rep=100, return_mode="median")

    def graph():
        return do_bench_cudagraph(call, rep=100, return_mode="median")
    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    bar = 1.4 * flops / do_bench(fa2, warmup=25, rep=100, return_mode="median") * 1e-9
    cudnn_tflops = flops / do_bench(cudnn, warmup=25, rep=100, return_mode="median") * 1e-9
    print(f"d={d} N={n} causal={causal}: 1.4 x FA2 = {bar:.0f} TFLOP/s, cuDNN {cudnn_tflops:.0f}", flush=True)
    for rnd, (name, (env, forced)) in ((r, v) for r in range(_REPEAT) for v in VARIANTS[d].items()):

        def measure(row, env=env, forced=forced):
            out = _run_variant(env, forced, call)
            torch.cuda.synchronize()
            row["rel_err"] = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            ms, graph_ms = _run_variant(env, forced, bench), _run_variant(env, forced, graph)
            row.update(ms=ms, tflops=flops / ms * 1e-9, graph_tflops=flops / graph_ms * 1e-9)

        record(rows, path, dict(d=d, n=n, causal=causal, variant=name, round=rnd, bar_tflops=bar,
                                cudnn_tflops=cudnn_tflops), measure,
               lambda row: f"{row['tflops']:5.0f} TFLOP/s ({row['tflops'] / bar:.3f} of the bar), "
                           f"graph {row['graph_tflops']:5.0f}, rel err {row['rel_err']:.1e}")


def main(path, head_dims):
    rows = []
    for d in head_dims:
        for b, n, causal in SHAPES:
            _shape(d, b, n, causal, rows, path)


if __name__ == "__main__":
    main(sys.argv[1], [int(d) for d in sys.argv[2:]] or list(VARIANTS))
